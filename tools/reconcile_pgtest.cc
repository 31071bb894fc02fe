// outboxctl reconcile (tools/reconcile.h) on staged data: what a clean run
// leaves (tools/staged_pgtest.h), then each way an event can fail to be
// applied; every one is listed with why, oldest first, and counted once.

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "tools/reconcile.h"
#include "tools/staged_pgtest.h"

namespace outbox::tools {
namespace {

class ReconcileTest : public StagedPipelineTest {
 protected:
  ReconcileTest() : StagedPipelineTest("reconcile") {
    window_.grace = absl::ZeroDuration();
  }

  ReconcileReport Reconcile(const ReconcileOptions& o) {
    auto r = tools::Reconcile(orders_.url(), billing_.url(), o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.value_or(ReconcileReport{});
  }
  ReconcileReport Reconcile() { return Reconcile(window_); }

  // The relay owes `e` again: a delivery row in `status`.
  void Owe(const Staged& e, const std::string& status, int attempts = 0,
           const std::string& error = "") {
    orders_.Exec(absl::StrCat(
        "INSERT INTO outbox_delivery (subscription, seq, aggregate_id, "
        "partition, status, attempts, last_error, dead_at) SELECT 'billing', "
        "seq, aggregate_id, partition, '",
        status, "', ", attempts, ", nullif('", error, "', ''), CASE WHEN '",
        status, "' = 'dead' THEN now() END FROM outbox WHERE seq = ", e.seq));
  }
  void Unapply(const Staged& e) {
    billing_.Exec(
        absl::StrCat("DELETE FROM inbox WHERE event_id = '", e.event_id, "'"));
  }

  ReconcileOptions window_;
};

TEST_F(ReconcileTest, AllAppliedListsNothing) {
  const ReconcileReport r = Reconcile();
  EXPECT_TRUE(r.ok()) << r.Summary();
  EXPECT_EQ(r.events, 6);
  EXPECT_EQ(r.applied, 6);
  EXPECT_TRUE(r.findings.empty());
}

TEST_F(ReconcileTest, EventsWithinTheGracePeriodAreNotLookedAt) {
  Unapply(c1_);
  ReconcileOptions graced = window_;
  graced.grace = absl::Minutes(1);
  const ReconcileReport r = Reconcile(graced);
  EXPECT_EQ(r.events, 0);
  EXPECT_TRUE(r.ok()) << r.Summary();
}

TEST_F(ReconcileTest, EachUnappliedEventIsListedWithWhyOldestFirst) {
  Unapply(a1_);  // delivered, no trace at the consumer: lost
  Unapply(b2_);  // a dead letter ...
  Owe(b2_, "dead", 5, "boom");
  Unapply(b3_);  // ... and the event behind it
  Owe(b3_, "pending");
  Unapply(c1_);  // held at the consumer behind a gap
  billing_.Exec(
      absl::StrCat("INSERT INTO held_events (event_id, source, aggregate_type, "
                   "aggregate_id, seq, prev_seq, payload) VALUES ('",
                   c1_.event_id, "', '", source_, "', 'order', '",
                   c1_.aggregate_id, "', ", c1_.seq, ", 0, '\\x00')"));
  const ReconcileReport r = Reconcile();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.lost, 1) << r.Summary();
  EXPECT_EQ(r.dead, 1) << r.Summary();
  EXPECT_EQ(r.behind_dead, 1) << r.Summary();
  EXPECT_EQ(r.held, 1) << r.Summary();
  EXPECT_EQ(r.pending, 0) << r.Summary();
  EXPECT_EQ(r.not_applied(), 4);
  ASSERT_EQ(r.findings.size(), 4u) << r.Summary();
  const std::map<std::string, std::string> why = {
      {a1_.event_id, "lost"},
      {b2_.event_id, "dead letter"},
      {b3_.event_id, "behind a dead letter"},
      {c1_.event_id, "held at the consumer"}};
  for (size_t i = 0; i < r.findings.size(); ++i) {
    const Finding& f = r.findings[i];
    auto it = why.find(f.event_id);
    ASSERT_NE(it, why.end()) << f.event_id;
    EXPECT_EQ(f.reason, it->second) << f.event_id;
    if (i > 0) {
      EXPECT_LT(r.findings[i - 1].seq, f.seq);  // oldest first
    }
  }
  EXPECT_TRUE(absl::StrContains(r.Summary(), "boom")) << r.Summary();
  EXPECT_TRUE(absl::StrContains(r.Json(), "\"reason\":\"lost\"")) << r.Json();
}

TEST_F(ReconcileTest, AnOwedEventNotYetAppliedIsPendingNotLost) {
  Unapply(c1_);
  Owe(c1_, "pending", 2, "consumer unavailable");
  const ReconcileReport r = Reconcile();
  EXPECT_EQ(r.pending, 1) << r.Summary();
  EXPECT_EQ(r.lost, 0) << r.Summary();
  ASSERT_EQ(r.findings.size(), 1u);
  EXPECT_EQ(r.findings[0].event_id, c1_.event_id);
  EXPECT_EQ(r.findings[0].reason, "pending");
}

TEST_F(ReconcileTest, AnAppliedEventTheOutboxDoesNotHoldIsListed) {
  Staged ghost{999, NewUuid(), a_, "OrderShipped"};
  Apply(ghost);
  const ReconcileReport r = Reconcile();
  EXPECT_EQ(r.orphaned, 1) << r.Summary();
  EXPECT_EQ(r.not_applied(), 0);
  EXPECT_FALSE(r.ok());
  ASSERT_EQ(r.findings.size(), 1u);
  EXPECT_EQ(r.findings[0].event_id, ghost.event_id);
  EXPECT_EQ(r.findings[0].reason, "applied, not in the outbox");
}

// Retention deletes a prefix of the outbox and records how far: what the
// inbox applied up to there is not an orphan, down to an outbox emptied of
// every event; what it applied above is, even below the oldest event left.
TEST_F(ReconcileTest, EventsRetentionDeletedAreNoOrphans) {
  orders_.Exec(absl::StrCat("DELETE FROM outbox WHERE seq < ", c1_.seq));
  orders_.Exec(absl::StrCat(
      "UPDATE outbox_retention_state SET deleted_through = ", c1_.seq - 1));
  ReconcileReport r = Reconcile();
  EXPECT_TRUE(r.ok()) << r.Summary();
  EXPECT_EQ(r.orphaned, 0) << r.Summary();

  orders_.Exec(
      "UPDATE outbox_retention_state SET deleted_through = (SELECT max(seq) "
      "FROM outbox); DELETE FROM outbox");
  r = Reconcile();
  EXPECT_TRUE(r.ok()) << r.Summary();
  EXPECT_EQ(r.events, 0);

  Staged ghost{b3_.seq + 5, NewUuid(), a_, "OrderShipped"};
  Apply(ghost);
  r = Reconcile();
  EXPECT_EQ(r.orphaned, 1) << r.Summary();
  ASSERT_EQ(r.findings.size(), 1u) << r.Summary();
  EXPECT_EQ(r.findings[0].event_id, ghost.event_id);
}

TEST_F(ReconcileTest, AnUnknownSubscriptionIsNotFound) {
  ReconcileOptions other = window_;
  other.subscription = "nobody";
  EXPECT_EQ(
      tools::Reconcile(orders_.url(), billing_.url(), other).status().code(),
      absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace outbox::tools
