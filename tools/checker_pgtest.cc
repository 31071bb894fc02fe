// The invariant checker (`outboxctl verify`, tools/checker.h) on staged
// data: databases made by the real migrations, filled by SQL with what a
// clean run leaves, then broken the way each violation would break them.
// Each verdict must be reported, counted once and named in an example;
// what retention deleted, on either side, must not count as a violation.

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"
#include "common/schema.h"
#include "consumer/billing.h"
#include "outbox/v1/event.pb.h"
#include "outbox/v1/order.pb.h"
#include "producer/order_schema.h"
#include "tools/checker.h"
#include "tools/staged_pgtest.h"

namespace outbox::tools {
namespace {

class CheckerTest : public StagedPipelineTest {
 protected:
  CheckerTest() : StagedPipelineTest("checker") {}

  CheckReport Check(absl::Duration wait = absl::ZeroDuration()) {
    auto r = tools::Check(orders_.url(), billing_.url(), wait);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.value_or(CheckReport{});
  }

  // Exactly the examples that mention `needle`, as many as `n`.
  static void ExpectExamples(const CheckReport& r, const std::string& needle,
                             size_t n) {
    size_t found = 0;
    for (const std::string& e : r.examples) {
      if (absl::StrContains(e, needle)) ++found;
    }
    EXPECT_EQ(found, n) << needle << " in:\n"
                        << absl::StrJoin(r.examples, "\n");
  }

  // Every counter of `r` is zero except those named in `nonzero`.
  static void ExpectOnly(const CheckReport& r,
                         const std::map<std::string, int64_t>& nonzero) {
    const std::map<std::string, int64_t> all = {
        {"lost", r.lost},
        {"missing_effects", r.missing_effects},
        {"duplicate_effects", r.duplicate_effects},
        {"order_violations", r.order_violations},
        {"phantoms", r.phantoms},
        {"view_mismatches", r.view_mismatches},
        {"pending", r.pending},
        {"held", r.held},
        {"dead_letters", r.dead_letters},
        {"behind_dead", r.behind_dead},
        {"pruned_from_outbox", r.pruned_from_outbox},
        {"pruned_from_inbox", r.pruned_from_inbox}};
    for (const auto& [name, value] : all) {
      auto it = nonzero.find(name);
      EXPECT_EQ(value, it == nonzero.end() ? 0 : it->second) << name << "\n"
                                                             << r.Summary();
    }
  }
};

TEST_F(CheckerTest, ACleanRunHoldsEveryInvariant) {
  const CheckReport r = Check();
  EXPECT_TRUE(r.ok()) << r.Summary();
  EXPECT_TRUE(r.drained);
  EXPECT_EQ(r.events, 6);
  EXPECT_EQ(r.applied, 6);
  EXPECT_TRUE(r.examples.empty()) << r.Summary();
  ExpectOnly(r, {});
  EXPECT_NE(r.Json().find("\"ok\":true"), std::string::npos) << r.Json();
}

TEST_F(CheckerTest, ADeliveredEventWithoutItsInboxRowIsLost) {
  billing_.Exec("DELETE FROM inbox WHERE event_id = '" + c1_.event_id + "'");
  const CheckReport r = Check();
  EXPECT_FALSE(r.ok());
  ExpectOnly(r, {{"lost", 1}});
  ExpectExamples(r, "I1 lost: OrderCreated " + c1_.event_id, 1);
  EXPECT_NE(r.Json().find("\"ok\":false"), std::string::npos) << r.Json();
}

TEST_F(CheckerTest, APaymentAppliedWithoutItsChargeIsAMissingEffect) {
  billing_.Exec("DELETE FROM charges WHERE event_id = '" + a2_.event_id + "'");
  const CheckReport r = Check();
  EXPECT_FALSE(r.ok());
  ExpectOnly(r, {{"missing_effects", 1}});
  ExpectExamples(r, "I1 effect: OrderPaid " + a2_.event_id, 1);
}

TEST_F(CheckerTest, AnEffectTwiceOrOfAnEventWithoutOneIsADuplicate) {
  // A charge for an event that charges nothing.
  billing_.Exec(absl::StrCat(
      "INSERT INTO charges (event_id, order_id, kind, amount_cents, currency) "
      "VALUES ('",
      c1_.event_id, "', '", c_, "', 'charge', 700, 'EUR')"));
  CheckReport r = Check();
  EXPECT_FALSE(r.ok());
  ExpectOnly(r, {{"duplicate_effects", 1}});
  ExpectExamples(r, "I2 duplicate effect: OrderCreated " + c1_.event_id, 1);
  // A payment charged twice (a schema without the constraints that would
  // refuse the second row).
  billing_.Exec("DELETE FROM charges WHERE event_id = '" + c1_.event_id + "'");
  billing_.Exec(
      "ALTER TABLE charges DROP CONSTRAINT charges_pkey, DROP CONSTRAINT "
      "charges_order_id_kind_key");
  Charge(a2_, "charge");
  r = Check();
  EXPECT_FALSE(r.ok());
  ExpectOnly(r, {{"duplicate_effects", 1}});
  ExpectExamples(r, "I2 duplicate effect: OrderPaid " + a2_.event_id, 1);
  ExpectExamples(r, "has 2 charge rows", 1);
}

TEST_F(CheckerTest, EventsAppliedOutOfTheirChainAreOrderViolations) {
  // b's payment applied before its creation.
  billing_.Exec("DELETE FROM inbox WHERE aggregate_id = '" + b_ + "'");
  for (const Staged* e : {&b2_, &b1_, &b3_}) Apply(*e);
  const CheckReport r = Check();
  EXPECT_FALSE(r.ok());
  // seq b2 after nothing, b1 after b2, b3 after b1: each step is off.
  ExpectOnly(r, {{"order_violations", 3}});
  ExpectExamples(r,
                 absl::StrCat("I3 order: aggregate order ", b_, " applied seq ",
                              b2_.seq, " (prev_seq ", b1_.seq, ") after seq 0"),
                 1);
}

// A consumer may take events from several outbox databases: what it
// applied from another source is that outbox's business, not a phantom of
// this one (nor is its charge), and its chain of the same id is its own.
TEST_F(CheckerTest, WhatAnotherSourceAppliedIsNotThisOutboxs) {
  const std::string other = NewUuid();
  billing_.Exec(absl::StrCat(
      "INSERT INTO inbox (event_id, source, aggregate_type, aggregate_id, "
      "seq, event_type) VALUES ('",
      other, "', 'shard-2', 'order', '", a_, "', 1000, 'OrderCreated'); ",
      "INSERT INTO charges (event_id, order_id, kind, amount_cents, currency) "
      "VALUES ('",
      other, "', '", other, "', 'charge', 700, 'EUR')"));
  CheckReport r = Check();
  EXPECT_TRUE(r.ok()) << r.Summary();
  ExpectOnly(r, {});
  // The same row as this source's is a phantom.
  billing_.Exec("UPDATE inbox SET source = 'shard-1' WHERE event_id = '" +
                other + "'");
  r = Check();
  EXPECT_FALSE(r.ok());
  EXPECT_GE(r.phantoms, 1);
}

TEST_F(CheckerTest, AnInboxRowOrAChargeNobodyCommittedIsAPhantom) {
  const std::string ghost = NewUuid();
  billing_.Exec(absl::StrCat(
      "INSERT INTO inbox (event_id, aggregate_id, seq, event_type) VALUES ('",
      ghost, "', 'nobody', ", b3_.seq + 100, ", 'OrderCreated')"));
  CheckReport r = Check();
  EXPECT_FALSE(r.ok());
  ExpectOnly(r, {{"phantoms", 1}});
  ExpectExamples(r, "I4 phantom: event " + ghost, 1);

  billing_.Exec("DELETE FROM inbox WHERE event_id = '" + ghost + "'");
  const std::string charge = NewUuid();
  billing_.Exec(absl::StrCat(
      "INSERT INTO charges (event_id, order_id, kind, amount_cents, currency) "
      "VALUES ('",
      charge, "', 'nobody', 'charge', 700, 'EUR')"));
  r = Check();
  EXPECT_FALSE(r.ok());
  ExpectOnly(r, {{"phantoms", 1}});
  ExpectExamples(r, "I4 phantom charge for event " + charge, 1);
}

TEST_F(CheckerTest, AViewThatDisagreesWithTheOrderIsAMismatch) {
  billing_.Exec("UPDATE order_view SET status = 'CREATED' WHERE order_id = '" +
                a_ + "'");
  billing_.Exec("DELETE FROM order_view WHERE order_id = '" + c_ + "'");
  const CheckReport r = Check();
  EXPECT_FALSE(r.ok());
  ExpectOnly(r, {{"view_mismatches", 2}});
  ExpectExamples(
      r, "order " + a_ + " is PAID but the consumer's view says CREATED", 1);
  ExpectExamples(
      r, "order " + c_ + " is CREATED but the consumer's view says nothing", 1);
}

TEST_F(CheckerTest, PendingOrHeldEventsAreNotDrainedAndNotYetLost) {
  const Staged c2 = Commit(c_, "OrderPaid");  // its delivery row pending
  CheckReport r = Check();
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.drained);
  ExpectOnly(r, {{"pending", 1}});
  EXPECT_NE(r.Summary().find("drained            NO"), std::string::npos)
      << r.Summary();

  // Delivered, but the consumer holds it (waiting for a predecessor).
  orders_.Exec("DELETE FROM outbox_delivery");
  billing_.Exec(absl::StrCat(
      "INSERT INTO held_events (event_id, aggregate_id, seq, prev_seq, "
      "payload) VALUES ('",
      c2.event_id, "', '", c_, "', ", c2.seq, ", ", c1_.seq, ", '\\x00')"));
  r = Check();
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.drained);
  ExpectOnly(r, {{"pending", 1}, {"held", 1}});
}

TEST_F(CheckerTest, ADeadLetterAndTheEventsBehindItAreReportedApart) {
  const Staged c2 = Commit(c_, "OrderPaid");
  const Staged c3 = Commit(c_, "OrderCancelled", 0);
  orders_.Exec(absl::StrCat(
      "UPDATE outbox_delivery SET status = 'dead', attempts = 5, last_error "
      "= 'boom', dead_at = now() WHERE seq = ",
      c2.seq));
  // Drained: nothing can drain behind a dead letter, so nothing is
  // waited for.
  const CheckReport r = Check(absl::Minutes(10));
  EXPECT_TRUE(r.drained) << r.Summary();
  EXPECT_TRUE(r.ok()) << r.Summary();  // dead letters are the run's to judge
  ExpectOnly(r, {{"dead_letters", 1}, {"behind_dead", 1}});
  EXPECT_EQ(r.events, 8);
  EXPECT_NE(r.Summary().find("dead letters       1 (and 1 events waiting"),
            std::string::npos)
      << r.Summary();
  (void)c3;
}

TEST_F(CheckerTest, RowsTheRelaysRetentionDeletedAreNotViolations) {
  // --retention deletes a prefix of the outbox: a's events and b's first.
  orders_.Exec(absl::StrCat("DELETE FROM outbox WHERE seq <= ", b1_.seq));
  orders_.Exec(absl::StrCat(
      "UPDATE outbox_retention_state SET deleted_through = ", b1_.seq));
  const CheckReport r = Check();
  EXPECT_TRUE(r.ok()) << r.Summary();
  // a1, a2 and b1 are applied and gone from the outbox; a's charge, whose
  // event only the inbox still holds, is no phantom.
  ExpectOnly(r, {{"pruned_from_outbox", 3}});
  EXPECT_EQ(r.events, 3);
}

TEST_F(CheckerTest, RowsTheInboxRetentionDeletedAreNotViolations) {
  // --inbox_retention deletes applied rows and records how far, per
  // aggregate: a's creation and b's first two events.
  billing_.Exec(absl::StrCat("DELETE FROM inbox WHERE event_id IN ('",
                             a1_.event_id, "', '", b1_.event_id, "', '",
                             b2_.event_id, "')"));
  billing_.Exec(absl::StrCat(
      "UPDATE aggregate_cursors SET pruned_through = CASE aggregate_id WHEN '",
      a_, "' THEN ", a1_.seq, " ELSE ", b2_.seq,
      " END WHERE aggregate_id IN ('", a_, "', '", b_, "')"));
  CheckReport r = Check();
  EXPECT_TRUE(r.ok()) << r.Summary();
  ExpectOnly(r, {{"pruned_from_inbox", 3}});
  // b's charge stays (retention never deletes effects): still no duplicate
  // and no phantom, though its inbox row is gone.

  // Deleted without the mark, the same rows are lost.
  billing_.Exec("UPDATE aggregate_cursors SET pruned_through = 0");
  r = Check();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.lost, 3) << r.Summary();
}

TEST_F(CheckerTest, RowsBothRetentionsDeletedAreNotViolations) {
  // Both sides let a's events go; its charge outlives both rows.
  orders_.Exec(absl::StrCat("DELETE FROM outbox WHERE seq <= ", a2_.seq));
  orders_.Exec(absl::StrCat(
      "UPDATE outbox_retention_state SET deleted_through = ", a2_.seq));
  billing_.Exec("DELETE FROM inbox WHERE aggregate_id = '" + a_ + "'");
  billing_.Exec(absl::StrCat(
      "UPDATE aggregate_cursors SET pruned_through = last_seq WHERE "
      "aggregate_id = '",
      a_, "'"));
  const CheckReport r = Check();
  EXPECT_TRUE(r.ok()) << r.Summary();
  ExpectOnly(r, {});
  EXPECT_EQ(r.events, 4);
  EXPECT_EQ(r.applied, 4);
}

}  // namespace
}  // namespace outbox::tools
