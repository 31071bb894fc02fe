// The batch planner without a database: every answer the consumer can
// give, for events alone, in one batch, and against what earlier batches
// left (cursors, the inbox, held events).

#include "inbox/batch_plan.h"

#include "common/ids.h"

#include <gtest/gtest.h>

#include <map>
#include <optional>

#include "absl/strings/str_cat.h"

namespace outbox::inbox {
namespace {

// The chain of Ev's events (no source, no type).
std::string K(const std::string& agg) { return ChainKey("", "", agg); }

// An event of aggregate `agg` at `seq` after `prev`; its id names both.
v1::Event Ev(const std::string& agg, int64_t seq, int64_t prev,
             const std::string& tag = "") {
  v1::Event e;
  e.set_event_id(absl::StrCat(agg, "/", seq, tag));
  e.set_aggregate_id(agg);
  e.set_seq(seq);
  e.set_prev_seq(prev);
  return e;
}

class Planner {
 public:
  Planner& Cursor(const std::string& agg, int64_t cursor, int64_t held = 0,
                  int64_t pruned_through = 0) {
    snap_.aggregates[K(agg)] = {cursor, held, pruned_through};
    return *this;
  }
  Planner& Applied(const v1::Event& e) {
    snap_.in_inbox[e.event_id()] = {e.aggregate_id(), e.seq()};
    return *this;
  }
  Planner& Held(const v1::Event& e) {
    snap_.held.push_back(e);
    return *this;
  }
  Planner& Release(const std::string& agg) {
    snap_.drain.insert(K(agg));
    return *this;
  }
  Planner& MaxHeld(int64_t n) {
    options_.max_held_per_aggregate = n;
    return *this;
  }
  const Plan& Run(std::vector<v1::Event> batch) {
    batch_ = std::move(batch);
    std::vector<const v1::Event*> ptrs;
    for (const auto& e : batch_) {
      ptrs.push_back(&e);
      snap_.aggregates.emplace(ChainKeyOf(e), AggregateState{});
    }
    plan_ = PlanBatch(ptrs, invalid_, snap_, options_);
    return plan_;
  }
  Planner& Invalid(std::vector<std::string> reasons) {
    invalid_ = std::move(reasons);
    return *this;
  }

  std::vector<v1::DeliveryOutcome> Outcomes() const {
    std::vector<v1::DeliveryOutcome> out;
    for (const auto& r : plan_.results) out.push_back(r.outcome());
    return out;
  }
  std::vector<std::string> Applies() const {
    std::vector<std::string> out;
    for (const v1::Event* e : plan_.apply) out.push_back(e->event_id());
    return out;
  }
  std::vector<std::string> Holds() const {
    std::vector<std::string> out;
    for (const v1::Event* e : plan_.hold) out.push_back(e->event_id());
    return out;
  }
  const std::string& Reason(size_t i) const {
    return plan_.results[i].reason();
  }
  const Plan& plan() const { return plan_; }

 private:
  Snapshot snap_;
  PlanOptions options_;
  std::vector<std::string> invalid_;
  std::vector<v1::Event> batch_;
  Plan plan_;
};

using V = std::vector<v1::DeliveryOutcome>;
using S = std::vector<std::string>;
constexpr auto A = v1::APPLIED;
constexpr auto D = v1::DUPLICATE;
constexpr auto H = v1::HELD;
constexpr auto R = v1::REJECTED;

TEST(PlanBatch, AppliesAChainInOrderAndMovesTheCursor) {
  Planner p;
  p.Run({Ev("a", 3, 0), Ev("a", 7, 3), Ev("a", 9, 7)});
  EXPECT_EQ(p.Outcomes(), (V{A, A, A}));
  EXPECT_EQ(p.Applies(), (S{"a/3", "a/7", "a/9"}));
  EXPECT_EQ(p.plan().changed.at(K("a")).cursor, 9);
  EXPECT_TRUE(p.Holds().empty());
}

TEST(PlanBatch, ContinuesFromTheCursor) {
  Planner p;
  p.Cursor("a", 7).Run({Ev("a", 9, 7)});
  EXPECT_EQ(p.Outcomes(), (V{A}));
  EXPECT_EQ(p.plan().changed.at(K("a")).cursor, 9);
}

TEST(PlanBatch, DuplicateOnlyWhenTheInboxHoldsTheEvent) {
  Planner p;
  p.Cursor("a", 9).Applied(Ev("a", 7, 3)).Run({Ev("a", 7, 3)});
  EXPECT_EQ(p.Outcomes(), (V{D}));
  EXPECT_TRUE(p.plan().changed.empty());
  EXPECT_TRUE(p.Applies().empty());
}

// Not the event's fault: the outbox's history of the aggregate is not the
// one applied here (a failover lost writes, a restore). No attempt, no
// dead letter: an operator decides.
TEST(PlanBatch, ADifferentEventAtAPassedPositionDiverges) {
  Planner p;
  p.Cursor("a", 9).Applied(Ev("a", 7, 3)).Run({Ev("a", 7, 3, "-restored")});
  EXPECT_EQ(p.Outcomes(), (V{v1::DIVERGED}));
  EXPECT_NE(p.Reason(0).find("position reused"), std::string::npos)
      << p.Reason(0);
  EXPECT_EQ(p.plan().position_reused, 1);
  EXPECT_EQ(p.plan().diverged, 1);
  EXPECT_EQ(p.plan().rejected, 0);
  EXPECT_EQ(p.plan().results[0].applied_seq(), 9);
  EXPECT_TRUE(p.plan().changed.empty());
}

TEST(PlanBatch, EventsAfterADivergedOneInTheBatchDefer) {
  Planner p;
  p.Cursor("a", 9).Applied(Ev("a", 7, 3));
  // The second would be held (its predecessor 15 is unknown here), but
  // its aggregate diverged: it waits at the sender.
  p.Run({Ev("a", 7, 3, "-new"), Ev("a", 20, 15, "-new"), Ev("b", 1, 0)});
  EXPECT_EQ(p.Outcomes(), (V{v1::DIVERGED, v1::DEFERRED, A}));
  EXPECT_TRUE(p.Holds().empty());
}

TEST(PlanBatch, HeldAnswersCarryTheAppliedPosition) {
  Planner p;
  p.Cursor("a", 3).Run({Ev("a", 9, 7)});
  EXPECT_EQ(p.Outcomes(), (V{H}));
  EXPECT_EQ(p.plan().results[0].applied_seq(), 3);
}

// Inbox retention deleted the rows up to seq 5: what arrives there is a
// redelivery; above, identity is still checked.
TEST(PlanBatch, BelowTheRetainedInboxAPassedPositionIsADuplicate) {
  Planner p;
  p.Cursor("a", 9, 0, 5)
      .Applied(Ev("a", 7, 5))
      .Run({Ev("a", 3, 0), Ev("a", 5, 3), Ev("a", 7, 5), Ev("a", 7, 5, "-x"),
            Ev("a", 9, 7)});
  EXPECT_EQ(p.Outcomes(), (V{D, D, D, v1::DIVERGED, v1::DIVERGED}));
  EXPECT_EQ(p.plan().pruned_duplicates, 2);
  EXPECT_EQ(p.plan().position_reused, 2);
  EXPECT_TRUE(p.plan().changed.empty());
}

TEST(PlanBatch, ASecondCopyInTheSameBatchIsADuplicate) {
  Planner p;
  p.Run({Ev("a", 3, 0), Ev("a", 3, 0), Ev("a", 5, 3), Ev("a", 5, 3)});
  EXPECT_EQ(p.Outcomes(), (V{A, D, A, D}));
  EXPECT_EQ(p.Applies(), (S{"a/3", "a/5"}));
}

TEST(PlanBatch, OneIdOnTwoAggregatesInABatchIsAppliedOnceAndThenRejected) {
  Planner p;
  v1::Event other = Ev("b", 4, 0);
  other.set_event_id("a/3");
  p.Run({Ev("a", 3, 0), other, Ev("b", 6, 4)});
  EXPECT_EQ(p.Outcomes(), (V{A, R, v1::DEFERRED}));
  EXPECT_EQ(p.Applies(), (S{"a/3"}));
  EXPECT_NE(p.Reason(1).find("a/3 is applied in this batch as seq 3 of "
                             "aggregate a"),
            std::string::npos)
      << p.Reason(1);
  EXPECT_EQ(p.plan().rejected, 1);
}

TEST(PlanBatch, OneIdAtAPassedPositionOfAnotherAggregateIsNotADuplicate) {
  // b's cursor is past seq 2, yet a/3 was applied to a, not b: no
  // DUPLICATE (which would mark it delivered), a rejection.
  Planner p;
  v1::Event other = Ev("b", 2, 0);
  other.set_event_id("a/3");
  p.Cursor("b", 5).Run({Ev("a", 3, 0), other});
  EXPECT_EQ(p.Outcomes(), (V{A, R}));
}

TEST(PlanBatch, AnIdAppliedEarlierElsewhereIsNotADuplicateAtAPassedPosition) {
  // The same as above across batches: the inbox holds a/3 as seq 3 of a.
  Planner p;
  v1::Event other = Ev("b", 2, 0);
  other.set_event_id("a/3");
  p.Cursor("b", 5).Applied(Ev("a", 3, 0)).Run({other});
  EXPECT_EQ(p.Outcomes(), (V{R}));
  EXPECT_NE(p.plan().results[0].reason().find("applied as seq 3 of aggregate a"),
            std::string::npos)
      << p.plan().results[0].reason();
  // And on its own aggregate at another passed seq.
  Planner q;
  v1::Event moved = Ev("a", 7, 3);
  moved.set_event_id("a/5");
  q.Cursor("a", 9).Applied(Ev("a", 5, 0)).Run({moved});
  EXPECT_EQ(q.Outcomes(), (V{R}));
}

TEST(PlanBatch, OneIdHeldAndAppliedOnTwoAggregatesIsAFork) {
  Planner p;
  v1::Event other = Ev("b", 1, 0);
  other.set_event_id("a/5");
  p.Run({Ev("a", 5, 3), other});
  EXPECT_EQ(p.Outcomes(), (V{H, R}));
  EXPECT_TRUE(p.Applies().empty());
}

TEST(PlanBatch, AnEarlyEventIsHeldAndCounted) {
  Planner p;
  p.Cursor("a", 3).Run({Ev("a", 9, 7)});
  EXPECT_EQ(p.Outcomes(), (V{H}));
  EXPECT_EQ(p.Holds(), (S{"a/9"}));
  EXPECT_EQ(p.plan().changed.at(K("a")).held_count, 1);
  EXPECT_EQ(p.plan().changed.at(K("a")).cursor, 3);
}

TEST(PlanBatch, HeldThenDrainedInOneBatchIsAppliedAndNeverWrittenAsHeld) {
  Planner p;
  p.Run({Ev("a", 9, 7), Ev("a", 7, 3), Ev("a", 3, 0)});
  EXPECT_EQ(p.Outcomes(), (V{A, A, A}));
  EXPECT_EQ(p.Applies(), (S{"a/3", "a/7", "a/9"}));
  EXPECT_TRUE(p.Holds().empty());
  EXPECT_EQ(p.plan().changed.at(K("a")).held_count, 0);
  EXPECT_EQ(p.plan().changed.at(K("a")).cursor, 9);
  EXPECT_EQ(p.plan().drained, 0);  // none came from earlier batches
}

TEST(PlanBatch, HeldEventsOfEarlierBatchesDrainInChainOrder) {
  Planner p;
  p.Cursor("a", 0, 2).Held(Ev("a", 9, 7)).Held(Ev("a", 7, 3));
  p.Run({Ev("a", 3, 0)});
  EXPECT_EQ(p.Outcomes(), (V{A}));
  EXPECT_EQ(p.Applies(), (S{"a/3", "a/7", "a/9"}));
  EXPECT_EQ(p.plan().unhold, (S{"a/7", "a/9"}));
  EXPECT_EQ(p.plan().drained, 2);
  EXPECT_EQ(p.plan().changed.at(K("a")), (AggregateState{9, 0}));
}

TEST(PlanBatch, AReleasedAggregateDrainsWithoutABatchEvent) {
  Planner p;
  p.Cursor("a", 2, 2).Held(Ev("a", 3, 2)).Held(Ev("a", 4, 3));
  p.Release("a").Run({});
  EXPECT_EQ(p.Applies(), (S{"a/3", "a/4"}));
  EXPECT_EQ(p.plan().drained, 2);
  EXPECT_EQ(p.plan().changed.at(K("a")).cursor, 4);
  EXPECT_EQ(p.plan().changed.at(K("a")).held_count, 0);
}

TEST(PlanBatch, DrainStopsAtAGap) {
  Planner p;
  p.Cursor("a", 0, 2).Held(Ev("a", 7, 3)).Held(Ev("a", 12, 10));
  p.Run({Ev("a", 3, 0)});
  EXPECT_EQ(p.Applies(), (S{"a/3", "a/7"}));
  EXPECT_EQ(p.plan().changed.at(K("a")), (AggregateState{7, 1}));
}

TEST(PlanBatch, ACopyOfAHeldEventIsHeldAgainAndNotWrittenTwice) {
  Planner p;
  p.Cursor("a", 3, 1).Held(Ev("a", 9, 7));
  p.Run({Ev("a", 9, 7)});
  EXPECT_EQ(p.Outcomes(), (V{H}));
  EXPECT_TRUE(p.Holds().empty());
  EXPECT_TRUE(p.plan().changed.empty());
}

TEST(PlanBatch, ACopyOfAHeldEventDrainedLaterInTheBatchIsApplied) {
  Planner p;
  p.Cursor("a", 3, 1).Held(Ev("a", 9, 7));
  p.Run({Ev("a", 9, 7), Ev("a", 7, 3)});
  EXPECT_EQ(p.Outcomes(), (V{A, A}));
  EXPECT_EQ(p.Applies(), (S{"a/7", "a/9"}));
  EXPECT_EQ(p.plan().unhold, (S{"a/9"}));
}

TEST(PlanBatch, ASecondEventForAHeldLinkIsAFork) {
  Planner p;
  p.Cursor("a", 3, 1).Held(Ev("a", 9, 7));
  p.Run({Ev("a", 11, 7)});
  EXPECT_EQ(p.Outcomes(), (V{R}));
  EXPECT_NE(p.Reason(0).find("fork"), std::string::npos) << p.Reason(0);
  EXPECT_EQ(p.plan().forks, 1);
  EXPECT_TRUE(p.Holds().empty());
}

TEST(PlanBatch, ASecondEventForAHeldPositionIsAFork) {
  Planner p;
  p.Cursor("a", 3, 1).Held(Ev("a", 9, 7));
  p.Run({Ev("a", 9, 8, "-other")});
  EXPECT_EQ(p.Outcomes(), (V{R}));
  EXPECT_EQ(p.plan().forks, 1);
}

TEST(PlanBatch, AForkWithinOneBatchKeepsTheFirst) {
  Planner p;
  p.Cursor("a", 3).Run({Ev("a", 9, 7), Ev("a", 10, 7)});
  EXPECT_EQ(p.Outcomes(), (V{H, R}));
  EXPECT_EQ(p.Holds(), (S{"a/9"}));
  EXPECT_EQ(p.plan().changed.at(K("a")).held_count, 1);
}

TEST(PlanBatch, ANextEventWhoseLinkIsHeldByAnotherIsAFork) {
  // Another event already holds the link at the cursor: nothing applies.
  Planner p;
  p.Cursor("a", 3, 1).Held(Ev("a", 9, 3, "-first"));
  p.Run({Ev("a", 7, 3)});
  EXPECT_EQ(p.Outcomes(), (V{R}));
  EXPECT_TRUE(p.Applies().empty());
}

TEST(PlanBatch, AnEventIdHeldWithAnotherPositionIsAFork) {
  Planner p;
  p.Cursor("a", 3, 1).Held(Ev("a", 9, 7));
  v1::Event forged = Ev("a", 12, 9);
  forged.set_event_id("a/9");
  p.Run({forged});
  EXPECT_EQ(p.Outcomes(), (V{R}));
  EXPECT_EQ(p.plan().forks, 1);
}

TEST(PlanBatch, AHeldForkThatTheChainPassesInTheSameBatchIsRejected) {
  // 5 waits for 3, but the chain goes 2 -> 6: 5 can never apply.
  Planner p;
  p.Run({Ev("a", 5, 3, "-fork"), Ev("a", 2, 0), Ev("a", 6, 2)});
  EXPECT_EQ(p.Outcomes(), (V{R, A, A}));
  EXPECT_NE(p.Reason(0).find("fork"), std::string::npos) << p.Reason(0);
  EXPECT_TRUE(p.Holds().empty());
  EXPECT_EQ(p.plan().changed.at(K("a")), (AggregateState{6, 0}));
}

TEST(PlanBatch, HeldEventsPerAggregateAreCapped) {
  Planner p;
  p.MaxHeld(2).Cursor("a", 1, 1).Held(Ev("a", 5, 4));
  p.Run({Ev("a", 9, 8), Ev("a", 11, 10), Ev("b", 7, 5)});
  EXPECT_EQ(p.Outcomes(), (V{H, R, H}));
  EXPECT_NE(p.Reason(1).find("max_held_per_aggregate"), std::string::npos);
  EXPECT_EQ(p.plan().over_cap, 1);
  EXPECT_EQ(p.plan().changed.at(K("a")).held_count, 2);
}

TEST(PlanBatch, TheCapDoesNotStopTheNextEvent) {
  Planner p;
  p.MaxHeld(1).Cursor("a", 1, 1).Held(Ev("a", 5, 4));
  p.Run({Ev("a", 4, 1)});
  EXPECT_EQ(p.Outcomes(), (V{A}));
  EXPECT_EQ(p.plan().changed.at(K("a")), (AggregateState{5, 0}));
}

// The outbox's chain left this one before its last applied event (seq 5
// is not in the outbox's history): a divergence, not a bad event.
TEST(PlanBatch, ABrokenChainDiverges) {
  Planner p;
  p.Cursor("a", 5).Run({Ev("a", 9, 3)});
  EXPECT_EQ(p.Outcomes(), (V{v1::DIVERGED}));
  EXPECT_NE(p.Reason(0).find("chain broken"), std::string::npos);
  EXPECT_EQ(p.plan().results[0].applied_seq(), 5);
}

TEST(PlanBatch, AnEventIdAppliedAtAnotherPositionIsRejected) {
  // Known only on the applier's second try, when the inbox is asked about
  // every id.
  Planner p;
  v1::Event reused = Ev("a", 9, 5);
  reused.set_event_id("a/5");
  p.Cursor("a", 5).Applied(Ev("a", 5, 0)).Run({reused});
  EXPECT_EQ(p.Outcomes(), (V{R}));
  EXPECT_TRUE(p.Applies().empty());
}

TEST(PlanBatch, AHeldEventAlreadyInTheInboxIsDiscardedNotApplied) {
  Planner p;
  v1::Event forged = Ev("a", 9, 7);
  forged.set_event_id("x/1");
  p.Cursor("a", 3, 1).Held(forged).Applied(forged);
  p.Run({Ev("a", 7, 3)});
  EXPECT_EQ(p.Applies(), (S{"a/7"}));
  EXPECT_EQ(p.plan().unhold, (S{"x/1"}));
  EXPECT_EQ(p.plan().changed.at(K("a")), (AggregateState{7, 0}));
}

TEST(PlanBatch, InvalidEventsAreRejectedWithTheirReasonAndOthersFlow) {
  Planner p;
  p.Invalid({"", "schema_version: 2 is not supported", ""});
  p.Run({Ev("a", 3, 0), Ev("a", 5, 3), Ev("b", 4, 0)});
  EXPECT_EQ(p.Outcomes(), (V{A, R, A}));
  EXPECT_EQ(p.Reason(1), "schema_version: 2 is not supported");
  EXPECT_EQ(p.Applies(), (S{"a/3", "b/4"}));
}

TEST(PlanBatch, EventsBehindARejectedOneInTheBatchAreDeferredNotHeld) {
  // The relay sends an aggregate's consecutive events together; when the
  // first is bad, the others must stay pending at the relay (behind what
  // may become a dead letter), not be parked here.
  Planner p;
  p.Invalid({"schema_version: 2 is not supported", "", "", ""});
  p.Run({Ev("a", 3, 0), Ev("a", 5, 3), Ev("a", 8, 5), Ev("b", 4, 0)});
  EXPECT_EQ(p.Outcomes(), (V{R, v1::DEFERRED, v1::DEFERRED, A}));
  EXPECT_TRUE(p.Holds().empty());
  EXPECT_EQ(p.plan().deferred, 2);
  EXPECT_FALSE(p.plan().changed.count(K("a")));
}

TEST(PlanBatch, AggregatesAreIndependent) {
  Planner p;
  p.Cursor("a", 3).Cursor("b", 0);
  p.Run({Ev("a", 9, 7), Ev("b", 2, 0), Ev("a", 7, 3), Ev("b", 1, 0, "-x")});
  EXPECT_EQ(p.Outcomes(), (V{A, A, A, v1::DIVERGED}));
  EXPECT_EQ(p.Applies(), (S{"b/2", "a/7", "a/9"}));
}

TEST(PlanBatch, OneIdUnderTwoTypesOrSourcesIsTwoChains) {
  Planner p;
  v1::Event order = Ev("x", 5, 0), parcel = Ev("x", 6, 0, "-parcel"),
            shard = Ev("x", 5, 0, "-shard"), late = Ev("x", 9, 8, "-late");
  order.set_aggregate_type("order");
  parcel.set_aggregate_type("parcel");
  shard.set_aggregate_type("order");
  shard.set_source("b");
  late.set_aggregate_type("parcel");
  p.Cursor("x", 0);  // a chain of neither (no type): untouched
  p.Run({order, parcel, shard, late});
  EXPECT_EQ(p.Outcomes(), (V{A, A, A, v1::HELD}));
  EXPECT_EQ(p.plan().changed.at(ChainKey("", "order", "x")).cursor, 5);
  EXPECT_EQ(p.plan().changed.at(ChainKey("", "parcel", "x")),
            (AggregateState{6, 1}));
  EXPECT_EQ(p.plan().changed.at(ChainKey("b", "order", "x")).cursor, 5);
  EXPECT_FALSE(p.plan().changed.count(K("x")));
}

TEST(Questions, InboxIsAskedOnlyAboutPassedPositionsUnlessAll) {
  Snapshot snap;
  snap.aggregates[K("a")] = {5, 0};
  v1::Event old = Ev("a", 3, 0), next = Ev("a", 7, 5);
  std::vector<const v1::Event*> batch = {&old, &next};
  EXPECT_EQ(InboxQuestions(batch, {}, snap, false), (S{"a/3"}));
  EXPECT_EQ(InboxQuestions(batch, {}, snap, true), (S{"a/3", "a/7"}));
  EXPECT_TRUE(InboxQuestions(batch, {"bad", "bad"}, snap, true).empty());
}

TEST(Questions, HeldEventsAreReadOnlyForAggregatesThatHoldSome) {
  Snapshot snap;
  snap.aggregates[K("a")] = {5, 0};
  snap.aggregates[K("b")] = {2, 3};
  v1::Event ea = Ev("a", 7, 5), eb = Ev("b", 9, 6);
  HeldQuery q = HeldQuestions({&ea, &eb}, {}, snap);
  using L = std::vector<std::pair<std::string, int64_t>>;
  EXPECT_EQ(q.links, (L{{K("b"), 2}, {K("b"), 6}, {K("b"), 9}}));
  EXPECT_EQ(q.positions, (L{{K("b"), 9}}));
  EXPECT_EQ(q.ids, (S{"b/9"}));
  snap.aggregates[K("b")].held_count = 0;
  EXPECT_TRUE(HeldQuestions({&ea, &eb}, {}, snap).empty());
}


// Foresee: the common batch, decided before the cursors are read.

std::vector<const v1::Event*> Ptrs(const std::vector<v1::Event>& events) {
  std::vector<const v1::Event*> out;
  for (const v1::Event& e : events) out.push_back(&e);
  return out;
}

TEST(Foresee, LinkedChainsAreForeseenWithTheirCursors) {
  const std::vector<v1::Event> batch = {Ev("a", 3, 0), Ev("b", 9, 4),
                                        Ev("a", 5, 3), Ev("a", 8, 5)};
  const std::optional<Foreseen> f = Foresee(Ptrs(batch), {});
  ASSERT_TRUE(f.has_value());
  ASSERT_EQ(f->chains.size(), 2u);
  EXPECT_EQ(f->chains.at(K("a")).from, 0);
  EXPECT_EQ(f->chains.at(K("a")).through, 8);
  EXPECT_EQ(f->chains.at(K("b")).from, 4);
  EXPECT_EQ(f->chains.at(K("b")).through, 9);

  Snapshot snap;
  snap.aggregates[K("a")] = {0, 0};
  snap.aggregates[K("b")] = {4, 0, 2};
  const Plan plan = PlanBatch(Ptrs(batch), {}, snap, {});
  EXPECT_TRUE(PlanIsForeseen(plan, Ptrs(batch), *f));
}

TEST(Foresee, OtherBatchesAreNot) {
  auto foreseen = [](std::vector<v1::Event> batch,
                     std::vector<std::string> invalid = {}) {
    return Foresee(Ptrs(batch), invalid).has_value();
  };
  EXPECT_FALSE(foreseen({}));
  EXPECT_FALSE(foreseen({Ev("a", 3, 0), Ev("b", 4, 0)}, {"", "bad"}));
  EXPECT_FALSE(foreseen({Ev("a", 3, 0), Ev("a", 3, 0)}));     // one id twice
  EXPECT_FALSE(foreseen({Ev("a", 3, 0), Ev("a", 6, 4)}));     // a gap
  EXPECT_FALSE(foreseen({Ev("a", 5, 3), Ev("a", 3, 0)}));     // out of order
  EXPECT_FALSE(foreseen({Ev("a", 3, 3)}));                    // no step
  EXPECT_FALSE(foreseen({Ev("a", 3, 0, "x"), Ev("a", 4, 0)}));  // a fork
  EXPECT_TRUE(foreseen({Ev("a", 3, 0), Ev("a", 4, 3)}, {"", ""}));
}

TEST(Foresee, APlanAgainstOtherCursorsIsNotTheForeseenOne) {
  const std::vector<v1::Event> batch = {Ev("a", 3, 1), Ev("a", 5, 3)};
  const Foreseen f = *Foresee(Ptrs(batch), {});
  for (const AggregateState& st :
       {AggregateState{0, 0}, AggregateState{3, 0}, AggregateState{5, 0},
        AggregateState{1, 1}}) {
    Snapshot snap;
    snap.aggregates[K("a")] = st;
    EXPECT_FALSE(PlanIsForeseen(PlanBatch(Ptrs(batch), {}, snap, {}),
                                Ptrs(batch), f))
        << "cursor " << st.cursor << ", held " << st.held_count;
  }
}

// The guarantee the engine relies on: whenever Foresee says yes and every
// cursor stands where it said with nothing held, PlanBatch applies the
// batch as foreseen. Random batches over a few chains; bounded.
TEST(Foresee, HoldsForEveryForeseenBatchAtItsCursors) {
  uint64_t state = 12345;
  auto next = [&](int n) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state >> 33) % static_cast<uint64_t>(n));
  };
  int foreseen = 0;
  for (int round = 0; round < 3000; ++round) {
    std::vector<v1::Event> batch;
    std::map<std::string, int64_t> at;
    const int size = 1 + next(6);
    for (int i = 0; i < size; ++i) {
      const std::string agg = std::string(1, static_cast<char>('a' + next(3)));
      auto [it, first] = at.try_emplace(agg, next(4));
      // Mostly linked; now and then a gap, a repeat or a step back.
      const int64_t prev = next(8) == 0 ? it->second + next(3) - 1 : it->second;
      const int64_t seq = prev + 1 + next(2);
      batch.push_back(Ev(agg, seq, prev, next(10) == 0 ? "" : "#"));
      it->second = seq;
    }
    const std::optional<Foreseen> f = Foresee(Ptrs(batch), {});
    if (!f.has_value()) continue;
    ++foreseen;
    Snapshot snap;
    for (const auto& [chain, c] : f->chains) {
      snap.aggregates[chain] = {c.from, 0, next(2) == 0 ? 0 : c.from};
    }
    EXPECT_TRUE(PlanIsForeseen(PlanBatch(Ptrs(batch), {}, snap, {}),
                               Ptrs(batch), *f))
        << "round " << round;
  }
  EXPECT_GT(foreseen, 300);  // the check above ran often enough to count
}

}  // namespace
}  // namespace outbox::inbox
