// The relay's housekeeping against a real PostgreSQL: its backlog figures
// follow the partitions the relay owns at once, only the owner of
// partition 0 deletes old events, a stop cancels a delete waiting on a
// lock, many deletes by the worker bring a vacuum of the delivery table,
// a heal nobody can run is closed, and one that cannot run yet shows; on
// a partitioned outbox, every replica keeps children made ahead and that
// owner drops the oldest whole.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "common/metrics.h"
#include "common/schema.h"
#include "relay/housekeeping.h"
#include "relay/log_testing.h"
#include "tests/testing/metrics.h"
#include "tests/testing/pg.h"
#include "tests/testing/wait.h"

namespace outbox::relay {
namespace {

using ::outbox::testing::SumOf;

class HousekeepingTest : public ::testing::Test {
 protected:
  HousekeepingTest() : db_("housekeeping", {OutboxSchema()}) {}

  // Housekeeping of subscription "billing" for the partitions in owned_,
  // healing from `consumer` (null: none, as with a broker).
  std::unique_ptr<Housekeeping> Make(
      absl::Duration retention, v1::EventSink::Stub* consumer = nullptr) {
    Housekeeping::Options options{
        .db_url = db_.url(),
        .subscription = "billing",
        .retention = retention,
        // Only a change of the owned partitions refreshes the figures.
        .backlog_refresh = absl::Hours(1),
        .owned =
            [this] {
              std::lock_guard<std::mutex> lock(owned_mu_);
              return owned_;
            },
        .source = [] { return std::string("orders"); },
        .wake = [] {},
        .redelivered_heal = metrics_.AddCounter("redelivered", ""),
        .diverged = metrics_.AddCounter("diverged", "")};
    options.consumer = consumer;
    return std::make_unique<Housekeeping>(std::move(options), &metrics_);
  }

  void Own(std::vector<int> partitions) {
    std::lock_guard<std::mutex> lock(owned_mu_);
    owned_ = std::move(partitions);
  }

  // Appends `n` events of aggregate `aggregate` in partition `partition`.
  void Append(const std::string& aggregate, int partition, int n) {
    pqxx::connection c(db_.url());
    pqxx::work tx(c);
    for (int i = 0; i < n; ++i) relay::Append(tx, aggregate, 0, partition);
    tx.commit();
  }

  double Pending() { return SumOf(metrics_, "outbox_relay_pending_events"); }

  testing::TestDatabase db_;
  Metrics metrics_;
  std::mutex owned_mu_;
  std::vector<int> owned_;
};

TEST_F(HousekeepingTest, TheFiguresFollowTheOwnedPartitionsAtOnce) {
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  Append("a", 1, 3);
  Append("b", 2, 5);
  ASSERT_EQ(db_.Scalar("SELECT count(*) FROM outbox_delivery WHERE "
                       "subscription = 'billing' AND status = 'pending'"),
            8);
  Own({1, 2, 3});
  std::unique_ptr<Housekeeping> hk = Make(absl::ZeroDuration());
  hk->Start();
  ASSERT_TRUE(testing::WaitFor([&] { return Pending() == 8; }))
      << metrics_.Render();
  // A partition given up leaves the figures at the next round, not after
  // the refresh interval (an hour here).
  Own({2, 3});
  ASSERT_TRUE(testing::WaitFor([&] { return Pending() == 5; }))
      << metrics_.Render();
  EXPECT_NE(
      metrics_.Render().find("outbox_relay_pending_events{partition=\"3\""),
      std::string::npos)
      << "an owned partition without events shows as 0";
  hk->Stop();
  hk->Stop();  // again: nothing
}

// On a partitioned outbox every replica keeps children made ahead as the
// sequence moves (the gauge says how many seqs are left), and the owner
// of partition 0 drops the oldest whole once its events are old enough.
TEST_F(HousekeepingTest, AReplicaKeepsChildrenAheadTheOwnerOfZeroDropsThem) {
  Own({1});
  std::unique_ptr<Housekeeping> hk = Make(absl::Milliseconds(1));
  hk->Start();
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_EQ(metrics_.Render().find("\noutbox_partition_seqs_left "),
            std::string::npos)
      << "a gauge on a plain outbox: " << metrics_.Render();
  db_.Exec("SELECT outbox_partition_outbox(100, 2)");  // [1, 101), [101, 201)
  Append("a", 1, 150);
  ASSERT_TRUE(testing::WaitFor([&] {
    return SumOf(metrics_, "outbox_partition_seqs_left") == 250;
  })) << metrics_.Render();
  EXPECT_EQ(db_.Scalar("SELECT made_to FROM outbox_rotation"), 401);
  EXPECT_EQ(SumOf(metrics_, "outbox_partition_span_seqs"), 100);
  // Not the owner of partition 0: nothing dropped.
  absl::SleepFor(absl::Milliseconds(1200));
  EXPECT_EQ(db_.Scalar("SELECT min(seq) FROM outbox"), 1);
  Own({0, 1});
  // The first child (all 100 events old enough) goes within a step.
  ASSERT_TRUE(testing::WaitFor([&] {
    return db_.Scalar("SELECT deleted_through FROM outbox_retention_state") ==
           100;
  })) << metrics_.Render();
  EXPECT_EQ(db_.Scalar("SELECT min(seq) FROM outbox"), 101);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM pg_inherits WHERE inhparent = "
                       "'outbox'::regclass"),
            3);  // [101, 201) with 50 events, and two ahead
  // Counted once the drop committed.
  EXPECT_TRUE(testing::WaitFor([&] {
    return SumOf(metrics_, "outbox_relay_pruned_total") == 100;
  })) << metrics_.Render();
  hk->Stop();
}

// Children that cannot be made (a role without CREATE on the schema, here
// a function that refuses as it would) hold up nothing else a round does:
// a heal request is still closed, the children on hand still dropped.
TEST_F(HousekeepingTest, ChildrenThatCannotBeMadeHoldUpNothingElse) {
  db_.Exec("SELECT outbox_partition_outbox(100, 2)");  // [1, 101), [101, 201)
  Append("a", 1, 150);
  db_.Exec(
      "CREATE OR REPLACE FUNCTION outbox_extend_partitions() RETURNS bigint "
      "LANGUAGE plpgsql AS $$ BEGIN RAISE insufficient_privilege USING "
      "MESSAGE = 'permission denied for schema public'; END $$");
  db_.Exec(
      "INSERT INTO subscriptions (name, heal_requested_at, heal_reason) "
      "VALUES ('billing', now(), 'test')");
  db_.Exec("DELETE FROM outbox_delivery");  // all delivered
  Own({0});
  std::unique_ptr<Housekeeping> hk = Make(absl::Milliseconds(1));
  hk->Start();
  ASSERT_TRUE(testing::WaitFor([&] {
    return db_.Scalar("SELECT count(*) FROM subscriptions WHERE healed_at = "
                      "heal_requested_at") == 1;
  })) << "the heal request was not closed";
  ASSERT_TRUE(testing::WaitFor([&] {
    return db_.Scalar("SELECT deleted_through FROM outbox_retention_state") ==
           100;
  })) << "the full child was not dropped";
  hk->Stop();
}

// A sink without cursors (a broker) cannot be healed: the request is
// closed, so that verify and reconcile do not wait for it forever.
TEST_F(HousekeepingTest, AHealRequestWithoutAConsumerIsClosed) {
  db_.Exec(
      "INSERT INTO subscriptions (name, heal_requested_at, heal_reason) "
      "VALUES ('billing', now(), 'test')");
  Own({0});
  std::unique_ptr<Housekeeping> hk = Make(absl::ZeroDuration());
  hk->Start();
  ASSERT_TRUE(testing::WaitFor([&] {
    return db_.Scalar("SELECT count(*) FROM subscriptions WHERE healed_at = "
                      "heal_requested_at") == 1;
  }));
  hk->Stop();
}

// A heal that cannot run (its consumer does not answer) shows in the
// gauge, from when it was requested, on the replica that runs heals only;
// once done, the gauge is 0.
TEST_F(HousekeepingTest, TheGaugeSaysHowLongAHealHasBeenDue) {
  db_.Exec(
      "INSERT INTO subscriptions (name, heal_requested_at, heal_reason) "
      "VALUES ('billing', now() - interval '10 minutes', 'test')");
  // Nothing listens there: every call fails at once.
  auto channel = grpc::CreateChannel("127.0.0.1:1",
                                     grpc::InsecureChannelCredentials());
  auto consumer = v1::EventSink::NewStub(channel);
  const auto due = [&] {
    return SumOf(metrics_, "outbox_relay_heal_due_seconds");
  };
  Own({3});
  std::unique_ptr<Housekeeping> hk = Make(absl::ZeroDuration(), consumer.get());
  hk->Start();
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_EQ(due(), 0) << "a replica without partition 0 runs no heal";
  Own({0, 3});
  ASSERT_TRUE(testing::WaitFor([&] { return due() >= 600; }))
      << metrics_.Render();
  EXPECT_LT(due(), 700);
  db_.Exec("UPDATE subscriptions SET healed_at = heal_requested_at");
  EXPECT_TRUE(testing::WaitFor([&] { return due() == 0; }))
      << metrics_.Render();
  hk->Stop();
}

TEST_F(HousekeepingTest, OnlyTheOwnerOfPartitionZeroDeletesOldEvents) {
  // No subscription: every event is delivered to all there are.
  Append("a", 0, 4);
  Append("b", 5, 4);
  Own({5, 6});
  std::unique_ptr<Housekeeping> hk = Make(absl::Milliseconds(1));
  hk->Start();
  // Two rounds at least (one a second), and nothing goes.
  absl::SleepFor(absl::Milliseconds(2500));
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox"), 8);
  Own({0, 5, 6});
  ASSERT_TRUE(testing::WaitFor(
      [&] { return db_.Scalar("SELECT count(*) FROM outbox") == 0; }));
  // Counted once the delete committed: a moment after the rows are gone.
  EXPECT_TRUE(testing::WaitFor(
      [&] { return SumOf(metrics_, "outbox_relay_pruned_total") == 8; }))
      << SumOf(metrics_, "outbox_relay_pruned_total");
}

// A writer left open after writing holds retention back below its event,
// and the gauge says since when; once it commits, all goes.
TEST_F(HousekeepingTest, AnOpenWriterHoldsRetentionBackAndTheGaugeSaysSo) {
  Append("a", 0, 3);
  pqxx::connection writer_conn(db_.url());
  auto writer = std::make_unique<pqxx::work>(writer_conn);
  relay::Append(*writer, "late", 0, 0);
  Append("b", 0, 2);
  Own({0});
  std::unique_ptr<Housekeeping> hk = Make(absl::Milliseconds(1));
  const auto held = [&] {
    return SumOf(metrics_, "outbox_retention_held_back_seconds");
  };
  EXPECT_EQ(held(), 0);
  hk->Start();
  ASSERT_TRUE(testing::WaitFor([&] { return held() >= 1.0; }))
      << metrics_.Render();
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox"), 5);
  writer->commit();
  writer.reset();
  ASSERT_TRUE(testing::WaitFor([&] {
    return db_.Scalar("SELECT count(*) FROM outbox") == 0 && held() == 0;
  })) << metrics_.Render();
  EXPECT_TRUE(testing::WaitFor(
      [&] { return SumOf(metrics_, "outbox_relay_pruned_total") == 6; }))
      << SumOf(metrics_, "outbox_relay_pruned_total");
}

TEST_F(HousekeepingTest, ABacklogOfManyBatchesGoesWholeAndStopsAtWhatMustStay) {
  // Several full batches (1,000 each) in a step, then the first event a
  // subscription still owes stops the prefix: nothing after it goes.
  Append("a", 0, 2500);
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  Append("b", 0, 1);
  Append("c", 0, 3);
  db_.Exec(
      "DELETE FROM outbox_delivery WHERE seq <> (SELECT min(seq) FROM "
      "outbox_delivery)");
  Own({0});
  std::unique_ptr<Housekeeping> hk = Make(absl::Milliseconds(1));
  hk->Start();
  ASSERT_TRUE(testing::WaitFor(
      [&] { return SumOf(metrics_, "outbox_relay_pruned_total") >= 2500; }));
  hk->Stop();
  EXPECT_EQ(SumOf(metrics_, "outbox_relay_pruned_total"), 2500);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox"), 4);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'a'"),
            0);
}

TEST_F(HousekeepingTest, StopCancelsADeleteWaitingOnALock) {
  Append("a", 0, 2);
  pqxx::connection holder(db_.url());
  auto lock = std::make_unique<pqxx::work>(holder);
  // A table lock: a row lock would give the holder an xid, and retention
  // waits for a writer that may still commit below without deleting.
  lock->exec("LOCK TABLE outbox IN SHARE MODE");
  Own({0});
  std::unique_ptr<Housekeeping> hk = Make(absl::Milliseconds(1));
  hk->Start();
  ASSERT_TRUE(testing::WaitFor([&] {
    return db_.Scalar(
               "SELECT count(*) FROM pg_stat_activity WHERE "
               "wait_event_type = 'Lock' AND query LIKE '%DELETE "
               "FROM outbox%' AND datname = current_database()") == 1;
  }));
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    hk->Stop();
    stopped = true;
  });
  const bool stopped_while_locked =
      testing::WaitFor([&] { return stopped.load(); }, absl::Minutes(1));
  EXPECT_TRUE(stopped_while_locked) << "Stop waited for the delete's lock";
  lock.reset();  // frees a stop that hung on it
  stopper.join();
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox"), 2);
}

TEST_F(HousekeepingTest, ManyDeletesBringAVacuumOfTheDeliveryTable) {
  const auto vacuums = [&] {
    return db_.Scalar(
        "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = "
        "'outbox_delivery'");
  };
  const int64_t before = vacuums();
  Own({1});
  std::unique_ptr<Housekeeping> hk = Make(absl::ZeroDuration());
  hk->Deleted(9999);
  hk->Start();
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_EQ(vacuums(), before) << "vacuumed before 10000 deletes";
  hk->Deleted(1);
  EXPECT_TRUE(testing::WaitFor([&] { return vacuums() > before; }));
}

}  // namespace
}  // namespace outbox::relay
