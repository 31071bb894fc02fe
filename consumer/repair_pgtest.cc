// The inbox's repair calls against a real PostgreSQL: the cursors a relay
// compares with what it delivered, paged and by name; and the rewind of a
// diverged aggregate to the producer's history, with what is superseded
// recorded and the billing handler's own state set back.

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/schema.h"
#include "consumer/billing.h"
#include "inbox/engine.h"
#include "inbox/repair.h"
#include "tests/testing/pg.h"

namespace outbox::consumer {
namespace {

BillingHandler* Billing() {
  static BillingHandler handler;
  return &handler;
}

// Created, paid, cancelled: seqs first, first + 1, first + 2.
std::vector<v1::Event> Order(const std::string& id, int64_t first) {
  std::vector<v1::Event> chain(3);
  const char* types[] = {"OrderCreated", "OrderPaid", "OrderCancelled"};
  for (int i = 0; i < 3; ++i) {
    v1::Event& e = chain[i];
    e.set_event_id(NewUuid());
    e.set_aggregate_type("order");
    e.set_aggregate_id(id);
    e.set_seq(first + i);
    e.set_prev_seq(i == 0 ? 0 : first + i - 1);
    e.set_event_type(types[i]);
    e.set_schema_version(1);
    ToTimestamp(absl::Now(), e.mutable_occurred_at());
  }
  v1::OrderCreated created;
  created.set_order_id(id);
  created.set_customer_id("c");
  created.set_currency("EUR");
  created.set_total_cents(500);
  chain[0].mutable_payload()->PackFrom(created);
  v1::OrderPaid paid;
  paid.set_order_id(id);
  paid.set_amount_cents(500);
  paid.set_currency("EUR");
  chain[1].mutable_payload()->PackFrom(paid);
  v1::OrderCancelled cancelled;
  cancelled.set_order_id(id);
  chain[2].mutable_payload()->PackFrom(cancelled);
  return chain;
}

class RepairTest : public ::testing::Test {
 protected:
  RepairTest()
      : billing_("repair",
                 {InboxSchema(), {"billing", &Billing()->migrations()}}),
        db_(billing_.url(), 2, "repair-test"),
        engine_(&db_, Billing(), &metrics_),
        repair_(&db_, Billing()) {}

  void Apply(const std::vector<const v1::Event*>& events) {
    auto r = engine_.ApplyBatch(events);
    ASSERT_TRUE(r.ok()) << r.status();
  }

  testing::TestDatabase billing_;
  Database db_;
  Metrics metrics_;
  inbox::Engine engine_;
  inbox::InboxRepair repair_;
};

TEST_F(RepairTest, CursorsPageInAggregateOrderAndAnswerByName) {
  std::vector<std::vector<v1::Event>> orders;
  for (int i = 0; i < 5; ++i) {
    orders.push_back(Order(absl::StrCat("order-", i), 10 * (i + 1)));
    Apply({&orders.back()[0], &orders.back()[1]});
  }
  inbox::CursorQuery q;
  q.limit = 2;
  std::vector<std::string> seen;
  for (int pages = 0; pages < 10; ++pages) {
    auto page = repair_.Cursors(q);
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_TRUE(page->identity.known());
    for (const inbox::Cursor& c : page->cursors) seen.push_back(c.aggregate_id);
    if (!page->more) break;
    q.after = page->cursors.back().aggregate_id;
  }
  EXPECT_EQ(seen, (std::vector<std::string>{"order-0", "order-1", "order-2",
                                            "order-3", "order-4"}));
  inbox::CursorQuery only;
  only.only = {"order-3", "nobody"};
  auto named = repair_.Cursors(only);
  ASSERT_TRUE(named.ok());
  ASSERT_EQ(named->cursors.size(), 1u);
  EXPECT_EQ(named->cursors[0].aggregate_id, "order-3");
  EXPECT_EQ(named->cursors[0].applied_seq, 41);
  EXPECT_EQ(named->cursors[0].applied_event_id, orders[3][1].event_id());
  q.limit = 0;
  EXPECT_EQ(repair_.Cursors(q).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The producer holds created only (its paid was lost with a failover):
// the consumer keeps created, supersedes paid, and its view and money
// follow: the order is CREATED again, the charge moves aside.
TEST_F(RepairTest, RewindKeepsTheSharedHistoryAndRecordsTheRest) {
  std::vector<v1::Event> o = Order("o", 100);
  Apply({&o[0], &o[1]});
  ASSERT_EQ(billing_.Scalar("SELECT count(*) FROM charges"), 1);
  inbox::RewindRequest r;
  r.aggregate_id = "o";
  r.keep_event_ids = {o[0].event_id()};
  r.reason = "the payment was lost with the old primary";
  r.operator_name = "spiffe://outbox/ops";
  auto done = repair_.Rewind(r);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->applied_seq, 100);
  ASSERT_EQ(done->superseded.size(), 1u);
  EXPECT_EQ(done->superseded[0].event_id, o[1].event_id());
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM inbox"), 1);
  EXPECT_EQ(billing_.Scalar(absl::StrCat(
                "SELECT count(*) FROM inbox_superseded WHERE event_id = '",
                o[1].event_id(),
                "' AND operator = 'spiffe://outbox/ops' AND reason LIKE "
                "'the payment%'")),
            1);
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM charges"), 0);
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM charges_superseded"), 1);
  EXPECT_EQ(
      billing_.Query("SELECT status FROM order_view")[0][0].as<std::string>(),
      "CREATED");
  // The producer's own next event applies at the shared position.
  v1::Event cancel = o[2];
  cancel.set_event_id(NewUuid());
  cancel.set_seq(120);
  cancel.set_prev_seq(100);
  auto res = engine_.ApplyBatch({&cancel});
  ASSERT_TRUE(res.ok());
  EXPECT_EQ((*res)[0].outcome(), v1::APPLIED);
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM charges"), 0);  // not paid
}

// The producer's retention deleted created and paid after they were
// delivered, and its cancel was lost with a failover: none of them is in
// keep_event_ids, yet created and paid are shared history (up to
// shared_through_seq); only the cancel is superseded, and the view stays
// PAID with its charge.
TEST_F(RepairTest, RewindKeepsWhatTheProducersRetentionDeleted) {
  std::vector<v1::Event> o = Order("kept", 200);
  Apply({&o[0], &o[1], &o[2]});
  inbox::RewindRequest r;
  r.aggregate_id = "kept";
  r.shared_through_seq = 201;
  r.reason = "the cancel was lost with the old primary";
  r.operator_name = "ops";
  auto done = repair_.Rewind(r);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->applied_seq, 201);
  ASSERT_EQ(done->superseded.size(), 1u);
  EXPECT_EQ(done->superseded[0].event_id, o[2].event_id());
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM inbox"), 2);
  EXPECT_EQ(
      billing_.Query("SELECT status FROM order_view")[0][0].as<std::string>(),
      "PAID");
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM charges"), 1);
}

TEST_F(RepairTest, RewindOfAnAggregateTheProducerLostEntirelyDropsItsView) {
  std::vector<v1::Event> o = Order("gone", 7);
  Apply({&o[0], &o[1]});
  v1::Event held = o[2];
  held.set_seq(30);
  held.set_prev_seq(20);  // waits for a predecessor that never comes
  Apply({&held});
  inbox::RewindRequest r;
  r.aggregate_id = "gone";
  r.reason = "not in the outbox any more";
  r.operator_name = "ops";
  auto done = repair_.Rewind(r);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->applied_seq, 0);
  EXPECT_EQ(done->superseded.size(), 2u);
  EXPECT_EQ(done->held_dropped, 1);
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM order_view"), 0);
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(
      billing_.Scalar("SELECT last_seq + held_count FROM aggregate_cursors"),
      0);
}

TEST_F(RepairTest, RewindRefusesWhatItCannotRecord) {
  inbox::RewindRequest r;
  r.aggregate_id = "o";
  r.operator_name = "ops";
  EXPECT_EQ(repair_.Rewind(r).status().code(),
            absl::StatusCode::kInvalidArgument);  // no reason
  r.reason = "x";
  r.keep_event_ids = {"not-a-uuid"};
  EXPECT_EQ(repair_.Rewind(r).status().code(),
            absl::StatusCode::kInvalidArgument);
  r.keep_event_ids.clear();
  r.shared_through_seq = -1;
  EXPECT_EQ(repair_.Rewind(r).status().code(),
            absl::StatusCode::kInvalidArgument);
  r.shared_through_seq = 0;
  r.operator_name.clear();
  EXPECT_EQ(repair_.Rewind(r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace outbox::consumer
