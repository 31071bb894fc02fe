// The checker's verdict from facts made by hand: each guarantee's count,
// what is not counted against it (retention, operators' decisions), and
// what cannot be told before the drain.
#include "tools/checker.h"

#include <gtest/gtest.h>

#include <string>

#include "common/ids.h"
#include "common/schema.h"

namespace outbox::tools {
namespace {

std::string OrderChain(const std::string& id) {
  return ChainKey("", "order", id);
}

// A chain of events of order `id`, seqs given, each after the one before.
class Facts {
 public:
  Facts() { f_.drained = true; }
  // Commits event `event_id` of order `id` at `seq` after `prev_seq`.
  Facts& Commit(const std::string& event_id, const std::string& id, int64_t seq,
                int64_t prev_seq, const std::string& type = "OrderCreated",
                const std::string& status = "delivered") {
    CommittedEvent c;
    c.chain = OrderChain(id);
    c.aggregate_id = id;
    c.seq = seq;
    c.prev_seq = prev_seq;
    c.type = type;
    c.status = status;
    c.created_us = 1000 * seq;
    f_.committed[event_id] = c;
    return *this;
  }
  Facts& Apply(const std::string& event_id, const std::string& id, int64_t seq,
               int64_t latency_ms = 5) {
    f_.applied.push_back(
        {event_id, OrderChain(id), id, seq, 1000 * seq + 1000 * latency_ms});
    return *this;
  }
  Facts& Charge(const std::string& event_id, int n = 1) {
    f_.charges_by_event[event_id] += n;
    return *this;
  }
  CheckFacts& operator*() { return f_; }
  CheckFacts* operator->() { return &f_; }
  CheckReport Verdict() const { return tools::Verdict(f_); }

 private:
  CheckFacts f_;
};

bool HasExample(const CheckReport& r, const std::string& part) {
  for (const std::string& e : r.examples) {
    if (e.find(part) != std::string::npos) return true;
  }
  return false;
}

TEST(Verdict, AChainAppliedInOrderWithItsChargeHoldsEveryInvariant) {
  Facts f;
  f.Commit("e1", "o1", 1, 0).Commit("e2", "o1", 2, 1, "OrderPaid");
  f.Apply("e1", "o1", 1, 4).Apply("e2", "o1", 2, 6).Charge("e2");
  f->order_status["o1"] = "paid";
  f->view_status["o1"] = "paid";
  CheckReport r = f.Verdict();
  EXPECT_TRUE(r.ok()) << r.Summary();
  EXPECT_EQ(r.events, 2);
  EXPECT_EQ(r.applied, 2);
  EXPECT_EQ(r.lost + r.pending + r.phantoms + r.order_violations, 0);
  EXPECT_DOUBLE_EQ(r.latency_p50_ms, 6);  // the upper of two
  EXPECT_TRUE(r.examples.empty());
}

TEST(Verdict, AnUnappliedEventIsPendingUntilDrainedThenLost) {
  Facts f;
  f.Commit("e1", "o1", 1, 0)
      .Commit("e2", "o2", 2, 0, "OrderCreated", "pending");
  f.Apply("e1", "o1", 1);
  f->drained = false;
  CheckReport early = f.Verdict();
  EXPECT_EQ(early.pending, 1);
  EXPECT_EQ(early.lost, 0);
  EXPECT_FALSE(early.ok());  // unknown, not known good
  f->drained = true;
  CheckReport late = f.Verdict();
  EXPECT_EQ(late.lost, 1);
  EXPECT_EQ(late.pending, 0);
  EXPECT_FALSE(late.ok());
  EXPECT_TRUE(HasExample(late, "I1 lost")) << late.Summary();
}

TEST(Verdict, AnEventAppliedBeforeItsPredecessorIsAnOrderViolation) {
  Facts f;
  f.Commit("e1", "o1", 1, 0).Commit("e2", "o1", 2, 1);
  f.Apply("e2", "o1", 2).Apply("e1", "o1", 1);
  CheckReport r = f.Verdict();
  EXPECT_GE(r.order_violations, 1);
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(HasExample(r, "I3 order"));
}

TEST(Verdict, AChainThatSkipsAnEventIsAnOrderViolationAndALoss) {
  Facts f;
  f.Commit("e1", "o1", 1, 0).Commit("e2", "o1", 2, 1).Commit("e3", "o1", 3, 2);
  f.Apply("e1", "o1", 1).Apply("e3", "o1", 3);
  CheckReport r = f.Verdict();
  EXPECT_EQ(r.order_violations, 1);
  EXPECT_EQ(r.lost, 1);
}

TEST(
    Verdict,
    AnAppliedEventNeverCommittedIsAPhantomUnlessRetentionOrADivergenceExplainsIt) {
  Facts f;
  f.Commit("e5", "o1", 5, 0);
  f.Apply("x9", "o2", 9).Apply("e5", "o1", 5);
  f->retained_from = 5;
  CheckReport r = f.Verdict();
  EXPECT_EQ(r.phantoms, 1);
  EXPECT_TRUE(HasExample(r, "I4 phantom"));

  Facts pruned;  // below the oldest retained row: deleted by retention
  pruned.Commit("e5", "o1", 5, 0);
  pruned.Apply("x3", "o2", 3).Apply("e5", "o1", 5);
  pruned->retained_from = 5;
  CheckReport p = pruned.Verdict();
  EXPECT_EQ(p.phantoms, 0);
  EXPECT_EQ(p.pruned_from_outbox, 1);
  EXPECT_TRUE(p.ok()) << p.Summary();

  Facts lost_by_outbox;  // a lossy failover, named by a divergence
  lost_by_outbox.Apply("x9", "o2", 9);
  lost_by_outbox->diverged[OrderChain("o2")] = "lost_by_outbox: ...";
  CheckReport d = lost_by_outbox.Verdict();
  EXPECT_EQ(d.phantoms, 0);
  EXPECT_EQ(d.orphaned, 1);
  EXPECT_EQ(d.diverged, 1);
  EXPECT_FALSE(d.ok());  // an operator must decide
  EXPECT_TRUE(HasExample(d, "outboxctl resolve"));
}

TEST(Verdict, EachPayingEventChargesExactlyOnce) {
  Facts f;
  f.Commit("p1", "o1", 1, 0, "OrderPaid").Commit("p2", "o2", 2, 0, "OrderPaid");
  f.Commit("c3", "o3", 3, 0, "OrderCancelled");  // no refund: no charge due
  f->committed["c3"].refund_cents = 0;
  f.Commit("c4", "o4", 4, 0, "OrderCancelled");
  f->committed["c4"].refund_cents = 250;
  f.Apply("p1", "o1", 1)
      .Apply("p2", "o2", 2)
      .Apply("c3", "o3", 3)
      .Apply("c4", "o4", 4);
  f.Charge("p1", 2);  // twice
  // p2 and c4: none
  CheckReport r = f.Verdict();
  EXPECT_EQ(r.duplicate_effects, 1);
  EXPECT_EQ(r.missing_effects, 2);
  EXPECT_TRUE(HasExample(r, "I2 duplicate effect: OrderPaid p1"));
  EXPECT_FALSE(r.ok());

  Facts extra;  // a charge for an event that pays nothing is a duplicate
  extra.Commit("c3", "o3", 3, 0, "OrderCancelled")
      .Apply("c3", "o3", 3)
      .Charge("c3");
  EXPECT_EQ(extra.Verdict().duplicate_effects, 1);
}

TEST(Verdict, AChargeOfNoKnownEventIsAPhantomUnlessSuperseded) {
  Facts f;
  f.Charge("ghost");
  EXPECT_EQ(f.Verdict().phantoms, 1);
  f->superseded.insert("ghost");
  CheckReport r = f.Verdict();
  EXPECT_EQ(r.phantoms, 0);
  EXPECT_EQ(r.superseded, 1);
}

TEST(Verdict, ADeadLetterStallsItsChainOnlyAndIsNotALoss) {
  Facts f;
  f.Commit("e1", "o1", 1, 0, "OrderCreated", kDeliveryDead);
  f.Commit("e2", "o1", 2, 1, "OrderPaid", kDeliveryPending);
  f.Commit("e3", "o2", 3, 0).Apply("e3", "o2", 3);
  f->order_status["o1"] = "paid";  // the view cannot follow a stalled chain
  CheckReport r = f.Verdict();
  EXPECT_EQ(r.dead_letters, 1);
  EXPECT_EQ(r.behind_dead, 1);
  EXPECT_EQ(r.lost, 0);
  EXPECT_EQ(r.view_mismatches, 0);
  EXPECT_TRUE(r.ok()) << r.Summary();  // I6 reports them apart
}

TEST(Verdict, DivergedDeliveriesWaitForAnOperator) {
  Facts f;
  f.Commit("e1", "o1", 1, 0, "OrderCreated", kDeliveryDiverged);
  f->diverged[ChainKey("", "", "o1")] = "forked";  // of every type of o1
  CheckReport r = f.Verdict();
  EXPECT_EQ(r.diverged_events, 1);
  EXPECT_EQ(r.diverged, 1);
  EXPECT_EQ(r.lost, 0);
  EXPECT_FALSE(r.ok());
}

TEST(Verdict, InboxRetentionExplainsMissingRowsAndTheChainsStart) {
  Facts f;
  f.Commit("e1", "o1", 1, 0).Commit("e2", "o1", 2, 1).Commit("e3", "o1", 3, 2);
  f.Apply("e3", "o1", 3);  // e1 and e2's inbox rows deleted
  f->pruned_through[OrderChain("o1")] = 2;
  CheckReport r = f.Verdict();
  EXPECT_EQ(r.pruned_from_inbox, 2);
  EXPECT_EQ(r.order_violations, 0);
  EXPECT_EQ(r.lost, 0);
  EXPECT_TRUE(r.ok()) << r.Summary();

  // A cursor from before chains had a type covers every type of its id.
  f->pruned_through.clear();
  f->pruned_through[ChainKey("", "", "o1")] = 2;
  EXPECT_TRUE(f.Verdict().ok());

  // Without it, the same facts are two losses and a broken chain.
  f->pruned_through.clear();
  CheckReport bad = f.Verdict();
  EXPECT_EQ(bad.lost, 2);
  EXPECT_EQ(bad.order_violations, 1);
}

TEST(Verdict, TheConsumersViewMustMatchEveryOrderOnceDrained) {
  Facts f;
  f->order_status = {{"o1", "paid"}, {"o2", "created"}};
  f->view_status = {{"o1", "created"}};
  CheckReport r = f.Verdict();
  EXPECT_EQ(r.view_mismatches, 2);  // wrong, and missing
  EXPECT_TRUE(HasExample(r, "the consumer's view says nothing"));
  f->drained = false;
  EXPECT_EQ(f.Verdict().view_mismatches, 0);  // not yet known
}

TEST(Verdict, ExamplesAreBounded) {
  Facts f;
  for (int i = 1; i <= 100; ++i) f.Charge("ghost" + std::to_string(i));
  CheckReport r = f.Verdict();
  EXPECT_EQ(r.phantoms, 100);
  EXPECT_EQ(r.examples.size(), 20u);
}

}  // namespace
}  // namespace outbox::tools
