// End to end through JetStream: the producer's store writes orders into a
// real PostgreSQL outbox, a relay publishes them with its JetStream sink to
// a replicated stream on a real 3-node cluster (its own, on loopback), and
// the consumer's JetStream source applies them with the billing handler.
// The stream's leader is killed and the source restarted mid-way; a poison
// event keeps coming back without holding up other aggregates. At the end
// every event is in the inbox exactly once, each aggregate's in seq order.

#include <gtest/gtest.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "common/jetstream_subject.h"
#include "consumer/billing.h"
#include "inbox/engine.h"
#include "inbox/jetstream_source.h"
#include "producer/order_logic.h"
#include "producer/order_schema.h"
#include "producer/order_store.h"
#include "relay/jetstream_sink.h"
#include "relay/relay.h"
#include "tests/testing/nats_cluster.h"
#include "tests/testing/orders.h"
#include "tests/testing/pg.h"
#include "tests/testing/wait.h"

namespace outbox {
namespace {

using ::outbox::testing::NatsCluster;
using ::outbox::testing::WaitFor;

consumer::BillingHandler* Billing() {
  static consumer::BillingHandler handler;
  return &handler;
}

class ConsumerJetStreamTest : public ::outbox::testing::NatsClusterTest {
 protected:
  ConsumerJetStreamTest()
      : orders_("js_orders", producer::OrdersSchemas()),
        billing_("js_billing", {InboxSchema(),
                                {Billing()->name(), &Billing()->migrations()}}),
        orders_db_(orders_.url(), 4, "js-test-producer"),
        billing_db_(billing_.url(), 4, "js-test-consumer"),
        writer_({.notify_url = orders_.url()}),
        store_(&orders_db_, &writer_),
        engine_(&billing_db_, Billing(), &consumer_metrics_) {
    orders_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  }

  void SetUp() override {
    NatsClusterTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    const std::string test =
        ::testing::UnitTest::GetInstance()->current_test_info()->name();
    stream_ = absl::StrCat("E2E", test);
    // Subjects of its own: a stream an earlier test could not delete (its
    // cluster was changing leaders) must not overlap this one's.
    subjects_ = absl::StrCat("outbox.", test);
    auto conn = jetstream::Connection::Connect({.servers = cluster()->urls()});
    ASSERT_TRUE(conn.ok()) << conn.status();
    conn_ = std::move(*conn);
  }
  void TearDown() override {
    if (conn_ != nullptr) (void)conn_->DeleteStream(stream_);
  }

  std::shared_ptr<relay::JetStreamSink> Sink() {
    auto sink = relay::JetStreamSink::Create(
        {.connect = {.servers = cluster()->urls(),
                     .request_timeout = absl::Seconds(2)},
         .stream = stream_,
         .subject_prefix = subjects_,
         .replicas = 3,
         .subscription = "billing"});
    EXPECT_TRUE(sink.ok()) << sink.status();
    return sink.ok() ? std::shared_ptr<relay::JetStreamSink>(std::move(*sink))
                     : nullptr;
  }
  relay::RelayOptions RelayOptions(std::shared_ptr<relay::Sink> sink) {
    relay::RelayOptions o;
    o.db_url = orders_.url();
    o.log_delivery = false;  // delivery rows (the log's: chaos_jetstream_ci)
    o.sink = std::move(sink);
    o.batch_size = 32;
    o.window = 128;
    o.poll_interval = absl::Milliseconds(100);
    o.rebalance_interval = absl::Milliseconds(100);
    o.retry_initial = absl::Milliseconds(20);
    o.retry_max = absl::Milliseconds(500);
    o.ack_timeout = absl::Seconds(8);
    return o;
  }
  std::unique_ptr<inbox::JetStreamSource> Source() {
    return std::make_unique<inbox::JetStreamSource>(
        inbox::JetStreamSourceOptions{
            .connect = {.servers = cluster()->urls(),
                        .connect_timeout = absl::Milliseconds(500),
                        .request_timeout = absl::Seconds(2),
                        .max_reconnects = max_reconnects_,
                        .reconnect_wait = absl::Milliseconds(100)},
            .stream = stream_,
            .durable = "billing",
            .filter_subject = jetstream::AllEventsUnder(subjects_),
            .batch = 64,
            .ack_wait = absl::Seconds(5),
            .reject_backoff = absl::Milliseconds(100),
            .reject_backoff_max = absl::Milliseconds(400),
            .park_after = park_after_},
        &engine_, &consumer_metrics_);
  }

  // `n` orders from `first`; every second one paid, every third cancelled.
  std::vector<std::string> MakeOrders(int n, int first = 0) {
    return testing::MakeOrders(store_, n, first);
  }
  int64_t Events() { return orders_.Scalar("SELECT count(*) FROM outbox"); }
  int64_t Applied() { return billing_.Scalar("SELECT count(*) FROM inbox"); }

  // Every outbox event but those of `except` is in the inbox exactly once,
  // each aggregate's applied in seq order.
  void ExpectExactlyOnceInOrder(const std::string& except = "") {
    std::set<std::string> sent, applied;
    for (const auto& r : orders_.Query(
             "SELECT event_id::text FROM outbox WHERE aggregate_id <> '" +
             except + "'")) {
      sent.insert(r[0].as<std::string>());
    }
    for (const auto& r : billing_.Query(
             "SELECT event_id::text FROM inbox WHERE aggregate_id <> '" +
             except + "'")) {
      applied.insert(r[0].as<std::string>());
    }
    EXPECT_EQ(sent, applied);
    EXPECT_EQ(static_cast<size_t>(billing_.Scalar(
                  "SELECT count(*) FROM inbox WHERE aggregate_id <> '" +
                  except + "'")),
              applied.size());
    EXPECT_EQ(billing_.Scalar(
                  "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION "
                  "BY aggregate_id ORDER BY apply_id) AS before FROM inbox) x "
                  "WHERE before >= seq"),
              0);
  }

  // A stream per test: NATS 2.9 has brought a stream deleted and made
  // again under the same name back without a leader after every node
  // crashed.
  std::string stream_;
  std::string subjects_;  // the stream's subject prefix
  int64_t park_after_ = 1000;
  int max_reconnects_ = -1;
  testing::TestDatabase orders_;
  testing::TestDatabase billing_;
  Database orders_db_;
  Database billing_db_;
  Writer writer_;
  producer::OrderStore store_;
  Metrics relay_metrics_;
  Metrics consumer_metrics_;
  inbox::Engine engine_;
  std::unique_ptr<jetstream::Connection> conn_;
};

TEST_F(ConsumerJetStreamTest,
       EveryEventOnceInOrderThroughLeaderLossAndRestart) {
  MakeOrders(120);
  relay::Relay relay(RelayOptions(Sink()), &relay_metrics_);
  relay.Start();
  auto source = Source();
  source->Start();
  ASSERT_TRUE(WaitFor([&] { return Applied() >= 60; }, absl::Seconds(60)))
      << Applied();
  // The consumer stops mid-drain and comes back on the same durable.
  source.reset();
  MakeOrders(40, 120);
  source = Source();
  source->Start();
  ASSERT_TRUE(WaitFor([&] { return Applied() >= Events() / 2 + 40; },
                      absl::Seconds(60)));
  // The stream's leader dies: relay and consumer both ride the election.
  auto info = conn_->GetStreamInfo(stream_);
  ASSERT_TRUE(info.ok()) << info.status();
  const int leader = NatsCluster::NodeOf(info->leader);
  ASSERT_GT(leader, 0) << info->leader;
  ASSERT_TRUE(cluster()->Kill(leader).ok());
  MakeOrders(40, 160);
  ASSERT_TRUE(
      WaitFor([&] { return Applied() == Events(); }, absl::Seconds(120)))
      << Applied() << " of " << Events() << "\n"
      << cluster()->Logs();
  ASSERT_TRUE(cluster()->Restart(leader).ok());
  ExpectExactlyOnceInOrder();
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(source->acknowledged() > 0, true);
}

TEST_F(ConsumerJetStreamTest, APoisonEventComesBackWithoutHoldingUpOthers) {
  std::vector<std::string> ids = MakeOrders(12);
  // Order 0 has three events; its first can never apply here.
  orders_.Exec(absl::StrCat(
      "UPDATE outbox SET schema_version = 2 WHERE seq = (SELECT min(seq) "
      "FROM outbox WHERE aggregate_id = '",
      ids[0], "')"));
  relay::Relay relay(RelayOptions(Sink()), &relay_metrics_);
  relay.Start();
  auto source = Source();
  source->Start();
  ASSERT_TRUE(
      WaitFor([&] { return Applied() == Events() - 3; }, absl::Seconds(60)))
      << Applied() << " of " << Events();
  // Its two successors wait, parked; the poison event is redelivered again
  // and again, never dropped nor applied.
  ASSERT_TRUE(WaitFor([&] {
    return billing_.Scalar("SELECT count(*) FROM held_events") == 2;
  }));
  auto redeliveries = [&] {
    return consumer_metrics_
        .AddCounter("outbox_consumer_jetstream_redeliveries_total", "")
        ->value();
  };
  const int64_t before = redeliveries();
  ASSERT_TRUE(WaitFor([&] { return redeliveries() > before + 2; }));
  EXPECT_EQ(Applied(), Events() - 3);
  ExpectExactlyOnceInOrder(ids[0]);
}

TEST_F(ConsumerJetStreamTest,
       AnEventRefusedOnEveryDeliveryIsParkedForAnOperator) {
  park_after_ = 3;
  std::vector<std::string> ids = MakeOrders(12);
  orders_.Exec(absl::StrCat(
      "UPDATE outbox SET schema_version = 2 WHERE seq = (SELECT min(seq) "
      "FROM outbox WHERE aggregate_id = '",
      ids[0], "')"));
  const std::string poison =
      orders_
          .Query(absl::StrCat(
              "SELECT event_id::text FROM outbox WHERE aggregate_id = '",
              ids[0], "' ORDER BY seq LIMIT 1"))[0][0]
          .as<std::string>();
  relay::Relay relay(RelayOptions(Sink()), &relay_metrics_);
  relay.Start();
  auto source = Source();
  source->Start();
  // Refused three times, then parked (failed, with its reason) and
  // acknowledged; its two successors wait behind it.
  ASSERT_TRUE(WaitFor(
      [&] {
        return billing_.Scalar(
                   "SELECT count(*) FROM held_events WHERE failed_at IS NOT "
                   "NULL "
                   "AND attempts = 3 AND last_error LIKE '%schema_version%' "
                   "AND "
                   "event_id = '" +
                   poison + "'") == 1 &&
               billing_.Scalar("SELECT count(*) FROM held_events") == 3;
      },
      absl::Seconds(60)));
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() - 3; }));
  auto parked = [&] {
    return consumer_metrics_
        .AddCounter("outbox_consumer_jetstream_parked_total", "")
        ->value();
  };
  EXPECT_EQ(parked(), 1);
  // Nothing comes back any more: every message is acknowledged.
  ASSERT_TRUE(WaitFor([&] {
    auto info = conn_->GetStreamInfo(stream_);
    return info.ok() && static_cast<int64_t>(source->acknowledged()) ==
                            static_cast<int64_t>(info->messages);
  })) << source->acknowledged();
  // The operator gives up on it: the chain drains behind it.
  absl::StatusOr<inbox::HeldActionResult> skipped =
      engine_.SkipHeld(poison, "test", "schema 2 is unknown here");
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_EQ(skipped->drained, 2);
  EXPECT_EQ(Applied(), Events());
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM held_events"), 0);
  ExpectExactlyOnceInOrder();
}

// Every node down until the source's client gives its connection up: it
// connects anew once the cluster is back, and the pipeline catches up.
TEST_F(ConsumerJetStreamTest, TheSourceConnectsAnewAfterTheClientGaveUp) {
  max_reconnects_ = 2;
  MakeOrders(20);
  relay::Relay relay(RelayOptions(Sink()), &relay_metrics_);
  relay.Start();
  auto source = Source();
  source->Start();
  ASSERT_TRUE(
      WaitFor([&] { return Applied() == Events(); }, absl::Seconds(60)));
  for (int n = 1; n <= 3; ++n) ASSERT_TRUE(cluster()->Kill(n).ok());
  MakeOrders(20, 20);
  absl::SleepFor(absl::Seconds(3));  // well past 2 rounds of 3 servers
  for (int n = 1; n <= 3; ++n) ASSERT_TRUE(cluster()->Restart(n).ok());
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events(); }, absl::Seconds(90)))
      << Applied() << " of " << Events() << "\n"
      << cluster()->Logs();
  ExpectExactlyOnceInOrder();
}

}  // namespace
}  // namespace outbox
