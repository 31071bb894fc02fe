// The relay's JetStream sink against a real 3-node JetStream cluster of its
// own (tests/testing/nats_cluster.sh), first stream by stream (chains,
// repeats, forks, missing predecessors, two relays racing on one
// aggregate), then the whole relay against a real PostgreSQL outbox while
// the stream's leader is killed and the relay restarted: every event is in
// the stream exactly once, each aggregate's as one chain in seq order.

#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/jetstream_subject.h"
#include "producer/order_logic.h"
#include "producer/order_schema.h"
#include "producer/order_store.h"
#include "relay/jetstream_sink.h"
#include "relay/relay.h"
#include "tests/testing/nats_cluster.h"
#include "tests/testing/orders.h"
#include "tests/testing/pg.h"
#include "tests/testing/wait.h"

namespace outbox::relay {
namespace {

using ::outbox::testing::NatsCluster;
using ::outbox::testing::WaitFor;

class JetStreamSinkTest : public ::outbox::testing::NatsClusterTest {
 protected:
  void SetUp() override {
    NatsClusterTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    auto conn = jetstream::Connection::Connect(
        {.servers = cluster()->urls(), .request_timeout = absl::Seconds(2)});
    ASSERT_TRUE(conn.ok()) << conn.status();
    conn_ = std::move(*conn);
    stream_ = absl::StrCat(
        "T", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    prefix_ = absl::StrCat("t", ++streams_);
  }
  void TearDown() override {
    if (conn_ != nullptr) (void)conn_->DeleteStream(stream_);
  }

  // The stream as an operator makes it (the sink with ensure_stream
  // false), binding `subjects`; made again with them if it is there.
  void OperatorsStream(std::vector<std::string> subjects) {
    ASSERT_TRUE(conn_
                    ->EnsureStream({.name = stream_,
                                    .subjects = std::move(subjects),
                                    .replicas = 3})
                    .ok());
  }

  JetStreamSinkOptions SinkOptions() {
    return {.connect = {.servers = cluster()->urls(),
                        .request_timeout = absl::Seconds(2)},
            .stream = stream_,
            .subject_prefix = prefix_,
            .replicas = 3,
            .subscription = "billing",
            .unready_after = absl::Seconds(10)};
  }

  // A started sink whose stream has a leader and two current replicas.
  std::shared_ptr<JetStreamSink> ReadySink() {
    return ReadySink(SinkOptions());
  }
  std::shared_ptr<JetStreamSink> ReadySink(const JetStreamSinkOptions& o) {
    auto sink = JetStreamSink::Create(o);
    EXPECT_TRUE(sink.ok()) << sink.status();
    if (!sink.ok()) return nullptr;
    std::shared_ptr<JetStreamSink> s = std::move(*sink);
    s->Start();
    EXPECT_TRUE(WaitFor(
        [&] {
          auto info = conn_->GetStreamInfo(stream_);
          return s->readiness() == Sink::Readiness::kReady && info.ok() &&
                 !info->leader.empty() && info->current_replicas.size() == 2;
        },
        absl::Seconds(30)))
        << "the sink's stream is not ready";
    return s;
  }

  // Sends one batch on a new stream of `sink` and waits for its answer.
  // Sends one batch on a new stream of `sink`: its answer, or why the
  // stream broke instead.
  absl::StatusOr<v1::DeliverResponse> TryDeliver(
      Sink& sink, const std::vector<v1::Event>& events, uint64_t batch_id) {
    std::unique_ptr<BatchStream> stream = sink.Open([] {});
    v1::DeliverRequest req;
    req.set_batch_id(batch_id);
    for (const v1::Event& e : events) *req.add_events() = e;
    stream->Send(req);
    std::vector<v1::DeliverResponse> got;
    if (!WaitFor([&] {
          for (auto& r : stream->TakeResponses()) got.push_back(std::move(r));
          return !got.empty() || stream->broken();
        })) {
      return absl::DeadlineExceededError("no answer");
    }
    if (got.empty()) return absl::UnavailableError(stream->error());
    return got[0];
  }
  v1::DeliverResponse Deliver(Sink& sink, const std::vector<v1::Event>& events,
                              uint64_t batch_id = 1) {
    absl::StatusOr<v1::DeliverResponse> r = TryDeliver(sink, events, batch_id);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.value_or(v1::DeliverResponse());
  }

  static v1::Event Event(const std::string& agg, int64_t seq, int64_t prev,
                         const std::string& id = "") {
    v1::Event e;
    e.set_event_id(id.empty() ? absl::StrCat(agg, "-", seq) : id);
    e.set_aggregate_type("order");
    e.set_aggregate_id(agg);
    e.set_seq(seq);
    e.set_prev_seq(prev);
    e.set_event_type("OrderCreated");
    return e;
  }

  static std::vector<v1::DeliveryOutcome> Outcomes(
      const v1::DeliverResponse& r) {
    std::vector<v1::DeliveryOutcome> out;
    for (const auto& e : r.results()) out.push_back(e.outcome());
    return out;
  }

  // Every message of the stream, in stream order: per aggregate subject,
  // (outbox seq, event id, prev seq).
  struct Stored {
    int64_t seq = 0, prev = 0;
    std::string event_id;
  };
  std::map<std::string, std::vector<Stored>> StreamContents() {
    std::map<std::string, std::vector<Stored>> out;
    auto info = conn_->GetStreamInfo(stream_);
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return out;
    for (uint64_t s = info->first_seq; s <= info->last_seq && s > 0; ++s) {
      auto m = conn_->GetMessage(stream_, s);
      if (m.status().code() == absl::StatusCode::kNotFound) continue;
      EXPECT_TRUE(m.ok()) << m.status();
      if (!m.ok()) break;
      Stored st;
      st.event_id = m->Header("Nats-Msg-Id");
      EXPECT_TRUE(absl::SimpleAtoi(m->Header("Outbox-Seq"), &st.seq));
      EXPECT_TRUE(absl::SimpleAtoi(m->Header("Outbox-Prev-Seq"), &st.prev));
      v1::Event e;
      EXPECT_TRUE(e.ParseFromString(m->data)) << "message " << s;
      EXPECT_EQ(e.event_id(), st.event_id);
      out[m->subject].push_back(st);
    }
    return out;
  }

  static int streams_;
  std::unique_ptr<jetstream::Connection> conn_;
  std::string stream_, prefix_;
};

int JetStreamSinkTest::streams_ = 0;

TEST_F(JetStreamSinkTest, PublishesAChainAndAnswersItsRepeatAsDuplicates) {
  auto sink = ReadySink();
  ASSERT_NE(sink, nullptr);
  const std::vector<v1::Event> chain = {Event("a", 3, 0), Event("a", 7, 3),
                                        Event("b", 8, 0), Event("a", 9, 7)};
  EXPECT_EQ(Outcomes(Deliver(*sink, chain)),
            (std::vector<v1::DeliveryOutcome>{v1::APPLIED, v1::APPLIED,
                                              v1::APPLIED, v1::APPLIED}));
  // Again on a new stream (no remembered tips), and the oldest alone: the
  // chain is walked back to find it.
  EXPECT_EQ(Outcomes(Deliver(*sink, chain, 2)),
            (std::vector<v1::DeliveryOutcome>{v1::DUPLICATE, v1::DUPLICATE,
                                              v1::DUPLICATE, v1::DUPLICATE}));
  EXPECT_EQ(Outcomes(Deliver(*sink, {Event("a", 3, 0)}, 3)),
            (std::vector<v1::DeliveryOutcome>{v1::DUPLICATE}));
  auto contents = StreamContents();
  ASSERT_EQ(contents.size(), 2u);
  const auto& a = contents[*jetstream::EventSubject(prefix_, "order", "a")];
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[0].seq, 3);
  EXPECT_EQ(a[1].seq, 7);
  EXPECT_EQ(a[1].prev, 3);
  EXPECT_EQ(a[2].seq, 9);
}

TEST_F(JetStreamSinkTest,
       AnotherHistoryIsDivergedAndAMissingPredecessorRejected) {
  auto sink = ReadySink();
  ASSERT_NE(sink, nullptr);
  ASSERT_EQ(Outcomes(Deliver(*sink, {Event("a", 3, 0), Event("a", 7, 3)})),
            (std::vector<v1::DeliveryOutcome>{v1::APPLIED, v1::APPLIED}));
  // After a failover that lost seq 7: the new primary's next event follows
  // seq 3. Another event at seq 7 is a fork too.
  v1::DeliverResponse r = Deliver(
      *sink,
      {Event("a", 40, 3), Event("a", 7, 3, "other-7"), Event("a", 41, 40)}, 2);
  EXPECT_EQ(Outcomes(r), (std::vector<v1::DeliveryOutcome>{
                             v1::DIVERGED, v1::DEFERRED, v1::DEFERRED}));
  EXPECT_EQ(r.results(0).applied_seq(), 7);
  EXPECT_EQ(Outcomes(Deliver(*sink, {Event("a", 7, 3, "other-7")}, 3)),
            (std::vector<v1::DeliveryOutcome>{v1::DIVERGED}));
  // Its predecessor was never published (dead-lettered): REJECTED, and the
  // aggregate's later event in the batch waits; other aggregates go on.
  r = Deliver(*sink,
              {Event("c", 20, 12), Event("c", 22, 20), Event("d", 23, 0)}, 4);
  EXPECT_EQ(Outcomes(r), (std::vector<v1::DeliveryOutcome>{
                             v1::REJECTED, v1::DEFERRED, v1::APPLIED}));
  EXPECT_NE(r.results(0).reason().find("seq 12"), std::string::npos)
      << r.results(0).reason();
  auto contents = StreamContents();
  EXPECT_EQ(contents[*jetstream::EventSubject(prefix_, "order", "a")].size(),
            2u);
  EXPECT_EQ(contents.count(*jetstream::EventSubject(prefix_, "order", "c")),
            0u);
}

TEST_F(JetStreamSinkTest, KeepingTwoPerAggregateStillChainsOnTheNewest) {
  JetStreamSinkOptions o = SinkOptions();
  o.max_per_aggregate = 2;
  std::shared_ptr<JetStreamSink> sink = ReadySink(o);
  ASSERT_NE(sink, nullptr);
  std::vector<v1::Event> chain;
  for (int i = 1; i <= 5; ++i) chain.push_back(Event("k", i, i - 1));
  EXPECT_EQ(Outcomes(Deliver(*sink, chain)),
            std::vector<v1::DeliveryOutcome>(5, v1::APPLIED));
  // On a new stream of the sink (the tip read again): the next one chains.
  EXPECT_EQ(Outcomes(Deliver(*sink, {Event("k", 6, 5)}, 2)),
            (std::vector<v1::DeliveryOutcome>{v1::APPLIED}));
  auto contents = StreamContents();
  const auto& k = contents[*jetstream::EventSubject(prefix_, "order", "k")];
  ASSERT_EQ(k.size(), 2u);
  EXPECT_EQ(k[0].seq, 5);
  EXPECT_EQ(k[1].seq, 6);
  // What went is older than the stream keeps: not taken for a duplicate.
  EXPECT_EQ(Outcomes(Deliver(*sink, {Event("k", 2, 1)}, 3)),
            (std::vector<v1::DeliveryOutcome>{v1::DIVERGED}));
}

TEST_F(JetStreamSinkTest, TwoRelaysRacingOnOneAggregateStoreOneChain) {
  auto one = ReadySink();
  ASSERT_NE(one, nullptr);
  auto two = JetStreamSink::Create(SinkOptions());
  ASSERT_TRUE(two.ok());
  (*two)->Start();
  ASSERT_TRUE(
      WaitFor([&] { return (*two)->readiness() == Sink::Readiness::kReady; }));
  // Both deliver the same 60-event chain, in batches of 6, at once: as two
  // replicas would around a lost lease.
  std::vector<v1::Event> chain;
  for (int i = 1; i <= 60; ++i) chain.push_back(Event("z", i, i - 1));
  auto run = [&](Sink& sink, std::atomic<int>* applied) {
    std::unique_ptr<BatchStream> stream = sink.Open([] {});
    for (int b = 0; b < 10; ++b) {
      v1::DeliverRequest req;
      req.set_batch_id(b + 1);
      for (int i = 0; i < 6; ++i) *req.add_events() = chain[b * 6 + i];
      stream->Send(req);
    }
    int answered = 0;
    EXPECT_TRUE(WaitFor([&] {
      for (const auto& r : stream->TakeResponses()) {
        ++answered;
        for (const auto& e : r.results()) {
          if (e.outcome() == v1::APPLIED) ++*applied;
          EXPECT_TRUE(e.outcome() == v1::APPLIED ||
                      e.outcome() == v1::DUPLICATE)
              << e.seq() << ": " << e.reason();
        }
      }
      return answered == 10 || stream->broken();
    }));
    EXPECT_EQ(answered, 10) << stream->error();
  };
  std::atomic<int> applied_one{0}, applied_two{0};
  std::thread t([&] { run(**two, &applied_two); });
  run(*one, &applied_one);
  t.join();
  EXPECT_EQ(applied_one + applied_two, 60);
  auto contents = StreamContents();
  const auto& z = contents[*jetstream::EventSubject(prefix_, "order", "z")];
  ASSERT_EQ(z.size(), 60u);
  for (int i = 0; i < 60; ++i) EXPECT_EQ(z[i].seq, i + 1);
  (*two)->Stop();
}

// Every node down long enough for the client to give the connection up
// (a short reconnect budget stands for a long outage): the sink connects
// anew once the cluster is back, and delivers again.
TEST_F(JetStreamSinkTest, ConnectsAnewAfterTheClientGaveUp) {
  JetStreamSinkOptions o = SinkOptions();
  o.connect.max_reconnects = 2;
  o.connect.reconnect_wait = absl::Milliseconds(100);
  o.connect.connect_timeout = absl::Milliseconds(500);
  std::shared_ptr<JetStreamSink> sink = ReadySink(o);
  ASSERT_NE(sink, nullptr);
  ASSERT_EQ(Outcomes(Deliver(*sink, {Event("r", 1, 0)})),
            (std::vector<v1::DeliveryOutcome>{v1::APPLIED}));
  for (int n = 1; n <= 3; ++n) ASSERT_TRUE(cluster()->Kill(n).ok());
  ASSERT_TRUE(
      WaitFor([&] { return sink->readiness() != Sink::Readiness::kReady; },
              absl::Seconds(30)));
  absl::SleepFor(absl::Seconds(3));  // well past 2 rounds of 3 servers
  for (int n = 1; n <= 3; ++n) ASSERT_TRUE(cluster()->Restart(n).ok());
  ASSERT_TRUE(
      WaitFor([&] { return sink->readiness() == Sink::Readiness::kReady; },
              absl::Seconds(60)))
      << cluster()->Logs();
  // The stream's leader may still be settling: a broken stream answers
  // nothing, and the relay would send again.
  absl::StatusOr<v1::DeliverResponse> r;
  ASSERT_TRUE(WaitFor(
      [&] {
        r = TryDeliver(*sink, {Event("r", 2, 1)}, 2);
        return r.ok();
      },
      absl::Seconds(60)))
      << r.status() << "\n"
      << cluster()->Logs();
  ASSERT_EQ(r->results_size(), 1);
  EXPECT_EQ(r->results(0).outcome(), v1::APPLIED) << r->results(0).reason();
  // conn_ (the test's own, reconnecting for ever) is back too.
  ASSERT_TRUE(WaitFor([&] { return conn_->GetStreamInfo(stream_).ok(); },
                      absl::Seconds(30)));
}

// Every publish finds no responder while the stream's info answers with a
// leader: what a server that missed the leader's interest in the stream's
// subjects answers (nats-server 2.9, after a whole cluster restarted), made
// here by a stream whose subjects do not cover the sink's. The sink gives
// that connection up and connects anew, to any server of the cluster.
TEST_F(JetStreamSinkTest, ConnectsAnewWhenNoServerTakesItsPublishes) {
  ASSERT_NO_FATAL_FAILURE(
      OperatorsStream({jetstream::AllEventsUnder(prefix_)}));
  JetStreamSinkOptions o = SinkOptions();
  o.ensure_stream = false;
  std::shared_ptr<JetStreamSink> sink = ReadySink(o);
  ASSERT_NE(sink, nullptr);
  ASSERT_EQ(sink->connections(), 1);
  // The stream stops binding the relay's subjects under the ready sink:
  // publishes find no responder, as through a server that has not learnt
  // the leader's subjects.
  ASSERT_NO_FATAL_FAILURE(OperatorsStream({"elsewhere.>"}));
  // The first failure, through the first connection (a later stream may
  // open while the sink is between connections: "not connected").
  absl::Status first;
  ASSERT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::DeliverResponse> r =
            TryDeliver(*sink, {Event("n", 1, 0)}, 1);
        EXPECT_FALSE(r.ok()) << "no stream binds " << prefix_ << ".>";
        if (!r.ok() && first.ok()) first = r.status();
        return sink->connections() >= 2;
      },
      absl::Seconds(30)))
      << first;
  EXPECT_TRUE(jetstream::IsNoResponders(first)) << first;
  sink->Stop();
}

// An operator's stream that does not bind every subject under the prefix
// (one aggregate type of it, here) is named for what it binds, and nothing
// is sent to it; once it binds them all, the sink is ready and delivers.
TEST_F(JetStreamSinkTest, AnOperatorsStreamBindingTooLittleIsNamed) {
  ASSERT_NO_FATAL_FAILURE(
      OperatorsStream({"elsewhere.>", prefix_ + ".order.>"}));
  JetStreamSinkOptions o = SinkOptions();
  o.ensure_stream = false;
  absl::StatusOr<std::unique_ptr<JetStreamSink>> sink =
      JetStreamSink::Create(o);
  ASSERT_TRUE(sink.ok()) << sink.status();
  (*sink)->Start();
  std::optional<std::string> why;
  EXPECT_TRUE(WaitFor(
      [&] {
        why = (*sink)->Unreachable();
        return (*sink)->readiness() == Sink::Readiness::kFailing &&
               why.has_value() &&
               absl::StrContains(*why, "not every event subject under");
      },
      absl::Seconds(30)))
      << why.value_or("(reachable)");
  EXPECT_TRUE(absl::StrContains(
      why.value_or(""),
      absl::StrCat("binds elsewhere.>, ", prefix_, ".order.>")))
      << why.value_or("");
  ASSERT_NO_FATAL_FAILURE(
      OperatorsStream({jetstream::AllEventsUnder(prefix_)}));
  EXPECT_TRUE(
      WaitFor([&] { return (*sink)->readiness() == Sink::Readiness::kReady; },
              absl::Seconds(30)));
  EXPECT_EQ(Outcomes(Deliver(**sink, {Event("n", 1, 0)})),
            (std::vector<v1::DeliveryOutcome>{v1::APPLIED}));
  (*sink)->Stop();
}

// The relay, delivering a PostgreSQL outbox to JetStream.
class RelayToJetStreamTest : public JetStreamSinkTest {
 protected:
  RelayToJetStreamTest()
      : orders_("relay_js_orders", producer::OrdersSchemas()),
        orders_db_(orders_.url(), 4, "relay-js-test-producer"),
        writer_({.notify_url = orders_.url()}),
        store_(&orders_db_, &writer_) {
    orders_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  }

  RelayOptions Options(std::shared_ptr<Sink> sink) {
    RelayOptions o;
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
    o.max_attempts = 3;
    return o;
  }

  // `n` orders; every second one paid, every third cancelled: one to three
  // events per aggregate.
  void MakeOrders(int n) { testing::MakeOrders(store_, n); }
  int64_t Pending() {
    return orders_.Scalar(
        "SELECT count(*) FROM outbox_delivery WHERE status = 'pending'");
  }
  int64_t Events() { return orders_.Scalar("SELECT count(*) FROM outbox"); }
  uint64_t InStream() {
    auto info = conn_->GetStreamInfo(stream_);
    return info.ok() ? info->messages : 0;
  }

  // The stream holds every outbox event once, each aggregate's in seq
  // order, each linked to its predecessor.
  void ExpectEveryEventOnceAsChains() {
    std::map<std::string, std::vector<std::pair<int64_t, std::string>>> want;
    for (const auto& r : orders_.Query(
             "SELECT aggregate_id, seq, event_id::text FROM outbox ORDER BY "
             "seq")) {
      want[*jetstream::EventSubject(prefix_, "order",
                                    r["aggregate_id"].as<std::string>())]
          .push_back({r["seq"].as<int64_t>(), r["event_id"].as<std::string>()});
    }
    auto got = StreamContents();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [subject, events] : want) {
      const auto& stored = got[subject];
      ASSERT_EQ(stored.size(), events.size()) << subject;
      int64_t prev = 0;
      for (size_t i = 0; i < events.size(); ++i) {
        EXPECT_EQ(stored[i].seq, events[i].first) << subject;
        EXPECT_EQ(stored[i].event_id, events[i].second) << subject;
        EXPECT_EQ(stored[i].prev, prev) << subject;
        prev = stored[i].seq;
      }
    }
  }

  testing::TestDatabase orders_;
  Database orders_db_;
  Writer writer_;
  producer::OrderStore store_;
  Metrics metrics_;
};

TEST_F(RelayToJetStreamTest,
       EveryEventOnceInOrderThroughLeaderLossAndRestarts) {
  MakeOrders(150);
  auto sink = ReadySink();
  ASSERT_NE(sink, nullptr);
  const int64_t events = Events();
  {
    Relay relay(Options(sink), &metrics_);
    relay.Start();
    ASSERT_TRUE(WaitFor([&] { return InStream() >= 40; }));
    // The stream's leader dies mid-drain: publishes fail until another is
    // elected; nothing answered is marked, and what goes again is found.
    auto info = conn_->GetStreamInfo(stream_);
    ASSERT_TRUE(info.ok()) << info.status();
    const int leader = NatsCluster::NodeOf(info->leader);
    ASSERT_GT(leader, 0) << info->leader;
    ASSERT_TRUE(cluster()->Kill(leader).ok());
    MakeOrders(50);
    ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }, absl::Seconds(90)))
        << Pending() << " pending, " << InStream() << " in the stream\n"
        << cluster()->Logs();
    ASSERT_TRUE(cluster()->Restart(leader).ok());
  }  // stopped
  // Marks lost: every row owed again, delivered by a fresh relay (and a
  // fresh sink, with no remembered tips): all duplicates.
  orders_.Exec(
      "INSERT INTO outbox_delivery (subscription, seq, aggregate_id, "
      "partition) SELECT 'billing', seq, aggregate_id, partition FROM outbox "
      "ORDER BY seq LIMIT 60");
  ASSERT_EQ(Pending(), 60);
  sink->Stop();
  auto again = ReadySink();
  ASSERT_NE(again, nullptr);
  {
    Relay relay(Options(again), &metrics_);
    relay.Start();
    ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }, absl::Seconds(60)));
  }
  EXPECT_EQ(static_cast<int64_t>(InStream()), Events());
  EXPECT_GT(Events(), events);
  ExpectEveryEventOnceAsChains();
}

}  // namespace
}  // namespace outbox::relay
