// The relay against real PostgreSQL databases and a real consumer served
// over loopback gRPC: delivery in order, NOTIFY wake-up, poison events and
// requeue, restarts, two replicas sharing partitions, and a consumer outage.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/ids.h"
#include "common/schema.h"
#include "common/server.h"
#include "common/watchdog.h"
#include "consumer/audit.h"
#include "consumer/billing.h"
#include "inbox/engine.h"
#include "inbox/retention.h"
#include "inbox/sink_service.h"
#include "producer/order_logic.h"
#include "producer/order_schema.h"
#include "producer/order_store.h"
#include "relay/admin_service.h"
#include "relay/delivery_store.h"
#include "relay/heal.h"
#include "relay/lane_testing.h"
#include "relay/relay.h"
#include "relay/retention.h"
#include "tests/testing/grpc.h"
#include "tests/testing/metrics.h"
#include "tests/testing/orders.h"
#include "tests/testing/pg.h"
#include "tests/testing/wait.h"
#include "tools/checker.h"
#include "tools/reconcile.h"

namespace outbox::relay {
namespace {

using ::outbox::testing::WaitFor;

consumer::BillingHandler* Billing() {
  static consumer::BillingHandler handler;
  return &handler;
}
consumer::AuditHandler* Audit() {
  static consumer::AuditHandler handler;
  return &handler;
}

std::vector<Schema> ConsumerSchemas(inbox::Handler* handler) {
  return {InboxSchema(), {handler->name(), &handler->migrations()}};
}

// A consumer served in-process on `port` (0 = any), billing unless told.
class Consumer {
 public:
  Consumer(const std::string& url, int port,
           inbox::Handler* handler = Billing())
      : db_(url, 4, "relay-test-consumer"),
        applier_(&db_, handler, &metrics_),
        repair_(&db_, handler),
        sink_(&applier_, nullptr, &repair_) {
    auto server =
        GrpcServer::Start({absl::StrCat("127.0.0.1:", port), absl::Seconds(1),
                           nullptr, kMaxDeliverMessageBytes},
                          {{&sink_, v1::EventSink::service_full_name()}});
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  int port() const { return server_->port(); }

 private:
  Database db_;
  Metrics metrics_;
  inbox::Engine applier_;
  inbox::InboxRepair repair_;
  inbox::EventSinkImpl sink_;
  std::unique_ptr<GrpcServer> server_;
};

// `relay`'s admin service served in-process on a free port, as outboxctl
// reaches it; stub() is null (and the test failed) if it cannot serve.
class AdminOnLoopback {
 public:
  AdminOnLoopback(const std::string& url, const Relay* relay)
      : db_(url, 2, "relay-test-admin"), admin_(&db_, relay) {
    auto server =
        GrpcServer::Start({"127.0.0.1:0", absl::Seconds(1)},
                          {{&admin_, v1::RelayAdmin::service_full_name()}});
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return;
    server_ = std::move(*server);
    stub_ = v1::RelayAdmin::NewStub(testing::Loopback(server_->port()));
  }
  v1::RelayAdmin::Stub* stub() const { return stub_.get(); }

 private:
  Database db_;
  RelayAdminImpl admin_;
  std::unique_ptr<GrpcServer> server_;
  std::unique_ptr<v1::RelayAdmin::Stub> stub_;
};

// An EventSink that answers each batch (every event APPLIED) only once the
// test releases it, and records the batches as they arrive, whether
// answered or not, with the stream each came on.
class GatedSink final : public v1::EventSink::Service {
 public:
  grpc::Status Deliver(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DeliverResponse, v1::DeliverRequest>* stream)
      override {
    int me;
    {
      std::lock_guard<std::mutex> lock(mu_);
      me = streams_++;
    }
    bool read_done = false;
    std::thread reader([&] {
      v1::DeliverRequest req;
      while (stream->Read(&req)) {
        std::lock_guard<std::mutex> lock(mu_);
        received_.push_back({me, req});
        cv_.notify_all();
      }
      std::lock_guard<std::mutex> lock(mu_);
      read_done = true;
      cv_.notify_all();
    });
    for (size_t next = 0;;) {  // received_[next..] holds this stream's next
      v1::DeliverRequest req;
      {
        std::unique_lock<std::mutex> lock(mu_);
        auto mine = [&] {
          while (next < received_.size() && received_[next].stream != me) {
            ++next;
          }
          return next < received_.size();
        };
        if (!cv_.wait_for(lock, std::chrono::milliseconds(20), [&] {
              return read_done || (answered_ < released_ && mine());
            })) {
          if (ctx->IsCancelled()) break;
          continue;
        }
        if (read_done) break;
        req = received_[next++].request;
        ++answered_;
      }
      if (!stream->Write(AllApplied(req))) break;
    }
    ctx->TryCancel();  // ends the reader's Read
    reader.join();
    return grpc::Status::OK;
  }

  // Lets `n` more batches be answered, each stream's in the order they came.
  void Release(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    released_ += n;
    cv_.notify_all();
  }
  // Events per batch received so far.
  std::vector<int> Batches() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int> sizes;
    for (const auto& r : received_) sizes.push_back(r.request.events_size());
    return sizes;
  }
  std::vector<v1::DeliverRequest> Requests() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<v1::DeliverRequest> out;
    for (const auto& r : received_) out.push_back(r.request);
    return out;
  }
  // The streams batches [from, to) came on (numbered as they opened).
  std::set<int> Streams(size_t from, size_t to) {
    std::lock_guard<std::mutex> lock(mu_);
    std::set<int> out;
    for (size_t i = from; i < std::min(to, received_.size()); ++i) {
      out.insert(received_[i].stream);
    }
    return out;
  }
  int Events() {
    int n = 0;
    for (int size : Batches()) n += size;
    return n;
  }

 private:
  struct Received {
    int stream;
    v1::DeliverRequest request;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Received> received_;
  int streams_ = 0;
  size_t answered_ = 0;
  size_t released_ = 0;
};

class RelayTest : public ::testing::Test {
 protected:
  RelayTest()
      : orders_("relay_orders", producer::OrdersSchemas()),
        billing_("relay_billing", ConsumerSchemas(Billing())),
        orders_db_(orders_.url(), 4, "relay-test-producer"),
        writer_({.notify_url = orders_.url()}),
        store_(&orders_db_, &writer_) {
    // As a deployment's first relay would make it; events written from now
    // on are owed to it.
    orders_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  }

  // Serves `sink` on a free port; null (and a failure) if it cannot.
  std::unique_ptr<GrpcServer> Serve(GatedSink* sink) {
    auto server = GrpcServer::Start(
        {"127.0.0.1:0", absl::Seconds(1), nullptr, kMaxDeliverMessageBytes},
        {{sink, v1::EventSink::service_full_name()}});
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }

  RelayOptions Options(int consumer_port) {
    RelayOptions o;
    o.db_url = orders_.url();
    o.consumer = absl::StrCat("127.0.0.1:", consumer_port);
    o.log_delivery = false;  // these tests are of delivery rows
    o.batch_size = 16;
    o.window = 64;
    o.poll_interval = absl::Milliseconds(100);
    o.rebalance_interval = absl::Milliseconds(100);
    o.retry_initial = absl::Milliseconds(20);
    o.retry_max = absl::Milliseconds(200);
    o.reject_backoff = absl::Milliseconds(20);
    o.reject_backoff_max = absl::Milliseconds(100);
    o.max_attempts = 3;
    return o;
  }

  // Asks for a heal as an operator would, and waits until it ran.
  void HealNow() {
    orders_.Exec(
        "UPDATE subscriptions SET heal_requested_at = now(), heal_reason = "
        "'test'");
    ASSERT_TRUE(WaitFor([&] {
      return orders_.Scalar(
                 "SELECT count(*) FROM subscriptions WHERE "
                 "healed_at >= heal_requested_at") == 1;
    }));
  }
  // Gives `order`'s first event a schema this consumer cannot read.
  void Poison(const std::string& order) {
    orders_.Exec(absl::StrCat(
        "UPDATE outbox SET schema_version = 2 WHERE seq = (SELECT min(seq) "
        "FROM outbox WHERE aggregate_id = '",
        order, "')"));
  }
  // Waits until it is the one dead letter, after its 3 attempts (Options),
  // and every event not of `order` (3 events) is applied.
  void ExpectPoisonDead(const std::string& order) {
    ASSERT_TRUE(WaitFor([&] {
      return orders_.Scalar(
                 "SELECT count(*) FROM outbox_delivery WHERE "
                 "status = 'dead'") == 1;
    }));
    ASSERT_TRUE(WaitFor([&] { return Applied() == Events() - 3; }));
    pqxx::result dead = orders_.Query(
        "SELECT aggregate_id, attempts, last_error FROM outbox_delivery WHERE "
        "status = 'dead'");
    EXPECT_EQ(dead[0][0].as<std::string>(), order);
    EXPECT_EQ(dead[0][1].as<int>(), 3);
    EXPECT_NE(dead[0][2].as<std::string>().find("schema_version"),
              std::string::npos);
  }

  // Creates an order (one event); its id, empty if it failed.
  std::string CreateOrder() {
    v1::CreateOrderRequest req;
    req.set_customer_id("c");
    req.set_currency("EUR");
    auto* item = req.add_items();
    item->set_sku("sku");
    item->set_quantity(1);
    item->set_unit_price_cents(100);
    auto order = store_.Create(req, *producer::ValidateCreate(req), "");
    EXPECT_TRUE(order.ok()) << order.status();
    return order.ok() ? order->order_id() : "";
  }
  // Creates `n` orders (one event each).
  void CreateOrders(int n) {
    for (int i = 0; i < n; ++i) ASSERT_FALSE(CreateOrder().empty());
  }
  void Pay(const std::string& order_id) {
    v1::PayOrderRequest pay;
    pay.set_order_id(order_id);
    pay.set_amount_cents(100);
    EXPECT_TRUE(store_.Pay(pay, "").ok());
  }

  // What a failover after retention leaves of `order`, created and paid,
  // both applied: retention had deleted its OrderCreated (and every event
  // before it), and the new primary lacks its OrderPaid, so the order is
  // CREATED there, with its OrderCreated its newest event.
  struct LostPayment {
    int64_t created = 0, paid = 0;  // seqs
    std::string paid_event;
  };
  LostPayment LosePaymentAfterRetention(const std::string& order) {
    const std::string where = absl::StrCat("aggregate_id = '", order, "'");
    LostPayment lost;
    lost.created = orders_.Scalar(
        absl::StrCat("SELECT min(seq) FROM outbox WHERE ", where));
    const pqxx::result paid = orders_.Query(
        absl::StrCat("SELECT seq, event_id::text FROM outbox WHERE ", where,
                     " ORDER BY seq DESC LIMIT 1"));
    lost.paid = paid[0][0].as<int64_t>();
    lost.paid_event = paid[0][1].as<std::string>();
    orders_.Exec(absl::StrCat("DELETE FROM outbox WHERE seq <= ", lost.created,
                              " OR seq = ", lost.paid));
    orders_.Exec(absl::StrCat(
        "UPDATE outbox_retention_state SET deleted_through = ", lost.created));
    orders_.Exec(absl::StrCat("UPDATE outbox_heads SET last_seq = ",
                              lost.created, ", prev_seq = 0 WHERE ", where));
    orders_.Exec(absl::StrCat(
        "UPDATE orders SET status = 'CREATED', version = 1 WHERE order_id = '",
        order, "'"));
    return lost;
  }

  // Creates `n` orders; pays every second one and cancels every third, so
  // aggregates carry one to three events.
  std::vector<std::string> MakeOrders(int n) {
    return testing::MakeOrders(store_, n);
  }

  // `n` NOTIFYs on the relays' channel, 10 ms apart, each heard alone.
  void Notify(int n) {
    for (int i = 0; i < n; ++i) {
      orders_.Exec(absl::StrCat("NOTIFY ", kNotifyChannel));
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  int64_t Pending(const std::string& subscription = "billing") {
    return orders_.Scalar(
        "SELECT count(*) FROM outbox_delivery WHERE status = 'pending' AND "
        "subscription = '" +
        subscription + "'");
  }
  int64_t Events() { return orders_.Scalar("SELECT count(*) FROM outbox"); }

  // Waits until `relay`'s worker has begun `statements` more statements on
  // its session. Each loop pass runs at least its rebalance statement
  // (every rebalance_interval), then weighs every lane's claims; a relay
  // that waits for answers runs nothing else. A check that something was
  // not sent, made after three statements that began after it was
  // committed, shows that the relay had its chance and chose not to.
  void WaitForRelayPasses(const Relay& relay, int statements = 3) {
    const std::string sql = absl::StrCat(
        "SELECT coalesce((SELECT (extract(epoch FROM query_start) * 1e6)::"
        "bigint FROM pg_stat_activity WHERE application_name = '",
        relay.session_name(), "'), 0)");
    int64_t last = orders_.Scalar(sql);
    for (int seen = 0; seen < statements;) {
      ASSERT_TRUE(WaitFor([&] { return orders_.Scalar(sql) != last; }))
          << "the relay's worker made no pass";
      last = orders_.Scalar(sql);
      ++seen;
    }
  }
  int64_t StreamFailures() {
    return metrics_.AddCounter("outbox_relay_stream_failures_total", "")
        ->value();
  }

  // Ten orders, delivered to the consumer at `port`, then made two days
  // old: for retention to delete.
  void DeliverOldOrders(int port) {
    MakeOrders(10);
    {
      Relay relay(Options(port), &metrics_);
      relay.Start();
      ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
    }
    orders_.Exec("UPDATE outbox SET created_at = now() - interval '2 days'");
  }
  int64_t Applied() { return billing_.Scalar("SELECT count(*) FROM inbox"); }

  // Every outbox event is in the inbox exactly once, nothing else is, and
  // each aggregate's events were applied in seq order.
  void ExpectExactlyOnceInOrder() {
    std::set<std::string> sent, applied;
    for (const auto& r : orders_.Query("SELECT event_id::text FROM outbox")) {
      sent.insert(r[0].as<std::string>());
    }
    for (const auto& r : billing_.Query("SELECT event_id::text FROM inbox")) {
      applied.insert(r[0].as<std::string>());
    }
    EXPECT_EQ(sent, applied);
    EXPECT_EQ(billing_.Scalar(
                  "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION "
                  "BY aggregate_id ORDER BY apply_id) AS before FROM inbox) x "
                  "WHERE before >= seq"),
              0);
    EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM held_events"), 0);
  }

  testing::TestDatabase orders_;
  testing::TestDatabase billing_;
  Database orders_db_;
  Writer writer_;
  producer::OrderStore store_;
  Metrics metrics_;
};

TEST_F(RelayTest, DeliversEveryEventOnceInOrder) {
  MakeOrders(60);
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events(); }))
      << Applied() << " of " << Events();
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  ExpectExactlyOnceInOrder();
  EXPECT_EQ(relay.State().partitions_owned.size(),
            static_cast<size_t>(kPartitionCount));
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM charges WHERE kind = "
                            "'charge'"),
            30);
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM charges WHERE kind = "
                            "'refund'"),
            10);  // paid and cancelled: i % 6 == 0
}

// One id under two aggregate types is two chains, each with its own
// prev_seq links, also when the writer appends both: every event applies
// once, in its own chain's order, stamped with the outbox's source. The
// source is recorded once; a relay naming another refuses to deliver.
TEST_F(RelayTest, OneIdUnderTwoTypesIsTwoChainsStampedWithTheSource) {
  testing::TestDatabase audit("relay_chains", ConsumerSchemas(Audit()));
  Consumer consumer(audit.url(), 0, Audit());
  for (int i = 0; i < 3; ++i) {
    for (const char* type : {"order", "parcel"}) {
      pqxx::connection c(orders_.url());
      pqxx::work tx(c);
      v1::OrderCreated body;
      body.set_order_id("X");
      ASSERT_TRUE(writer_.Append(tx, NewEvent::Of(type, "X", body)).ok());
      tx.commit();
    }
  }
  RelayOptions options = Options(consumer.port());
  options.source = "shard-a";
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] {
    return audit.Scalar("SELECT count(*) FROM inbox") == 6;
  })) << audit.Scalar("SELECT count(*) FROM inbox");
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  EXPECT_EQ(relay.source(), "shard-a");
  EXPECT_EQ(audit.Scalar("SELECT count(*) FROM inbox WHERE source = "
                         "'shard-a'"),
            6);
  EXPECT_EQ(audit.Scalar("SELECT count(*) FROM aggregate_cursors WHERE "
                         "source = 'shard-a' AND aggregate_id = 'X'"),
            2);
  // Each chain's cursor is its own last event.
  EXPECT_EQ(audit.Scalar("SELECT count(*) FROM aggregate_cursors c JOIN "
                         "inbox i USING (source, aggregate_type, aggregate_id) "
                         "WHERE i.seq > c.last_seq"),
            0);
  relay.Stop(absl::Seconds(1));
  // Another name for the same outbox: refused, nothing delivered.
  RelayOptions renamed = Options(consumer.port());
  renamed.source = "shard-b";
  Relay other(renamed, &metrics_);
  other.Start();
  {
    pqxx::connection c(orders_.url());
    pqxx::work tx(c);
    v1::OrderCreated body;
    body.set_order_id("Y");
    ASSERT_TRUE(writer_.Append(tx, NewEvent::Of("order", "Y", body)).ok());
    tx.commit();
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));
  EXPECT_EQ(audit.Scalar("SELECT count(*) FROM inbox"), 6);
  EXPECT_EQ(other.source(), "");
  other.Stop(absl::Seconds(1));
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_source WHERE name = "
                           "'shard-a'"),
            1);
}

TEST_F(RelayTest, NotifyWakesTheRelayWithoutWaitingForThePoll) {
  Consumer consumer(billing_.url(), 0);
  RelayOptions options = Options(consumer.port());
  options.poll_interval = absl::Minutes(10);
  options.rebalance_interval = absl::Minutes(10);
  std::atomic<int> empty_claims{0};
  options.after_claim = [&](size_t rows) { empty_claims += rows == 0; };
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return relay.State().stream_connected; }));
  // Idle, waiting on the poll: its claims found nothing.
  ASSERT_TRUE(WaitFor([&] { return empty_claims > 0; }));
  MakeOrders(1);  // three events: each is claimed when NOTIFY or an answer
                  // wakes the relay
  // Without NOTIFY this would wait ten minutes for the poll.
  EXPECT_TRUE(WaitFor([&] { return Applied() == 3; }, absl::Seconds(10)));
}

// While every stream awaits an answer a NOTIFY does not wake the worker
// (the answer will). One heard while the claims after that answer run,
// before wakes are back on, must still wake it: a row committed then would
// otherwise wait for the poll.
TEST_F(RelayTest, ANotifyHeardWhileTheClaimsRunIsNotLost) {
  GatedSink sink;
  std::unique_ptr<GrpcServer> server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  RelayOptions options = Options(server->port());
  options.poll_interval = absl::Minutes(10);
  std::atomic<int> stage{0};
  options.after_claim = [&](size_t rows) {
    if (stage == 1 && rows == 0) {
      stage = 2;  // the claims after the answer found nothing new
      CreateOrders(1);
      absl::SleepFor(absl::Milliseconds(300));  // its NOTIFY is heard
    }
  };
  CreateOrders(1);
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 1; }));  // unanswered
  // A NOTIFY with nothing new: the worker wakes, finds every stream
  // waiting for an answer and stops listening for NOTIFYs until it comes.
  orders_.Exec(absl::StrCat("NOTIFY ", kNotifyChannel));
  absl::SleepFor(absl::Milliseconds(300));
  stage = 1;
  sink.Release(1 << 20);
  ASSERT_TRUE(WaitFor([&] { return stage == 2; }));
  // Without the wake this would wait ten minutes for the poll.
  EXPECT_TRUE(WaitFor([&] { return sink.Events() == 2; }, absl::Seconds(5)));
  relay.Stop(absl::Seconds(5));
}

// Under steady NOTIFYs while every stream awaits an answer, the listener
// stops listening (the server would signal it for each, for nothing); once
// the worker wants wakes again it listens again, and wakes the worker for
// the rows committed meanwhile.
TEST_F(RelayTest, TheListenerRestsUnderSteadyNotifiesAndListensAgainWhenIdle) {
  GatedSink sink;
  std::unique_ptr<GrpcServer> server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  RelayOptions options = Options(server->port());
  options.poll_interval = absl::Minutes(10);
  std::atomic<int> listens{0};
  std::atomic<int> rests{0};
  options.on_listening = [&](bool on) { ++(on ? listens : rests); };
  CreateOrders(1);
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 1; }));  // unanswered
  ASSERT_EQ(rests, 0);
  // NOTIFYs go on until the listener rests: the first few may still wake
  // a worker that has not yet seen that its one stream waits for an
  // answer (on a loaded machine, for a while); the ones after that are
  // ignored, and enough of them stop the listening.
  ASSERT_TRUE(WaitFor([&] {
    Notify(1);
    return rests == 1;
  }));
  const int listened = listens;
  CreateOrders(1);  // its NOTIFY is not heard; the answer's claims find it
  sink.Release(1 << 20);
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 2; }, absl::Seconds(5)));
  // Both answered, nothing to claim: the worker wants wakes again.
  EXPECT_TRUE(WaitFor([&] { return listens == listened + 1; }));
  absl::SleepFor(absl::Milliseconds(300));
  CreateOrders(1);
  // Without listening again this would wait ten minutes for the poll.
  EXPECT_TRUE(WaitFor([&] { return sink.Events() == 3; }, absl::Seconds(5)));
  EXPECT_EQ(rests, 1);
  relay.Stop(absl::Seconds(5));
}

// A moderate load waits for answers in short stretches, with wakes on in
// between: NOTIFYs ignored in many of them, but fewer than the limit in
// any one (the next order's NOTIFY, wanted, starts the count again), never
// stop the listening (each stop and resume costs two statements and a
// claim).
TEST_F(RelayTest, NotifiesIgnoredInManyShortWaitsKeepTheListenerListening) {
  GatedSink sink;
  std::unique_ptr<GrpcServer> server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  RelayOptions options = Options(server->port());
  options.poll_interval = absl::Minutes(10);
  std::atomic<int> rests{0};
  options.on_listening = [&](bool on) { rests += on ? 0 : 1; };
  std::atomic<int> empty_claims{0};
  options.after_claim = [&](size_t rows) { empty_claims += rows == 0; };
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return relay.State().stream_connected; }));
  for (int wait = 1; wait <= 5; ++wait) {
    CreateOrders(1);  // its NOTIFY wakes the relay: sent, then unanswered
    ASSERT_TRUE(WaitFor([&] { return sink.Events() == wait; }));
    Notify(10);  // ignored while the answer is awaited
    const int empty_before = empty_claims;
    sink.Release(1);
    ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
    // The claims after the answer found nothing more: the worker wants
    // wakes again.
    ASSERT_TRUE(WaitFor([&] { return empty_claims > empty_before; }));
  }
  EXPECT_EQ(rests, 0);  // 50 ignored, at most 10 in one wait
  relay.Stop(absl::Seconds(5));
}

// The claim after an answer writes its marks in the same statement: one
// round trip per cycle, and an answered event's successor goes in the
// batch that follows. The statement is atomic: while the marks cannot be
// written (a lock on a delivered row here), nothing is claimed or sent, and
// nothing is sent twice once they can.
TEST_F(RelayTest, TheClaimAfterAnAnswerWritesItsMarksInOneStatement) {
  GatedSink sink;
  std::unique_ptr<GrpcServer> server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  RelayOptions options = Options(server->port());
  options.lanes = 1;
  options.poll_interval = absl::Minutes(10);
  options.rebalance_interval = absl::Minutes(10);  // marks ride every claim
  options.session.lock_timeout = absl::Milliseconds(200);
  auto marks = [&] {  // mark statements of their own
    for (absl::string_view line : absl::StrSplit(metrics_.Render(), '\n')) {
      if (absl::ConsumePrefix(&line, "outbox_relay_mark_seconds_count")) {
        return std::string(line.substr(line.find(' ') + 1));
      }
    }
    return std::string("missing");
  };
  auto last_batch = [&] {
    std::vector<std::string> events;
    const std::vector<v1::DeliverRequest> all = sink.Requests();
    for (const v1::Event& e : all.back().events()) {
      events.push_back(absl::StrCat(e.aggregate_id(), "/", e.event_type()));
    }
    return events;
  };
  const std::string x = CreateOrder();
  // Hears each failed statement (stalled at once: only its reason counts).
  Watchdog watchdog("relay claim/mark loop", absl::Milliseconds(1));
  Relay relay(options, &metrics_, &watchdog);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 1; }));  // unanswered
  Pay(x);
  const std::string y = CreateOrder();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(sink.Batches(), std::vector<int>({1}));
  sink.Release(1);
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 3; }, absl::Seconds(5)));
  EXPECT_EQ(last_batch(),
            std::vector<std::string>({x + "/OrderPaid", y + "/OrderCreated"}));
  sink.Release(1);
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }, absl::Seconds(5)));
  EXPECT_EQ(marks(), "0");

  const std::string z = CreateOrder();
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 4; }));  // unanswered
  Pay(z);
  const std::string w = CreateOrder();
  pqxx::connection rogue(orders_.url());
  auto lock = std::make_unique<pqxx::work>(rogue);
  lock->exec_params(
      "SELECT 1 FROM outbox_delivery WHERE aggregate_id = $1 AND seq = "
      "(SELECT min(seq) FROM outbox WHERE aggregate_id = $1) FOR UPDATE",
      z);
  sink.Release(1);
  // The statement that would mark the answer and claim the next rows times
  // out on the lock.
  ASSERT_TRUE(WaitFor([&] {
    auto why = watchdog.Stalled();
    return why.has_value() && why->find("55P03") != std::string::npos;
  })) << watchdog.Stalled().value_or("not stalled");
  EXPECT_EQ(sink.Batches(), std::vector<int>({1, 2, 1}));
  EXPECT_EQ(Pending(), 3);
  lock.reset();
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 6; }, absl::Seconds(5)));
  EXPECT_EQ(last_batch(),
            std::vector<std::string>({z + "/OrderPaid", w + "/OrderCreated"}));
  sink.Release(1);
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }, absl::Seconds(5)));
  EXPECT_EQ(sink.Batches(), std::vector<int>({1, 2, 1, 2}));
  relay.Stop(absl::Seconds(5));
}

// Rows the relay cannot read are rejected by the relay itself, in the
// claim round that found them; a further claim of that round must not
// take those rejections for deliveries (and delete the rows): each still
// counts its attempts and becomes a dead letter, and the readable rows
// behind them are delivered.
TEST_F(RelayTest, UnreadableRowsDeadLetterThoughTheirClaimRoundGoesOn) {
  orders_.Exec(
      "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, prev_seq, "
      "event_type, schema_version, payload, partition) SELECT "
      "gen_random_uuid(), 'order', 'unreadable-' || g, 0, 'OrderCreated', 1, "
      "'\\x00', g % 32 FROM generate_series(1, 40) g");
  MakeOrders(10);
  Consumer consumer(billing_.url(), 0);
  RelayOptions options = Options(consumer.port());
  options.lanes = 1;
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }))
      << Pending() << " pending";
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_delivery WHERE "
                           "status = 'dead' AND attempts = 3 AND last_error "
                           "LIKE 'payload: not a valid%'"),
            40);
  EXPECT_EQ(Applied(), Events() - 40);
  relay.Stop(absl::Seconds(5));
}

TEST_F(RelayTest,
       OnlyABacklogPipelinesBatchesOtherwiseNewRowsWaitAndGoTogether) {
  GatedSink sink;
  std::unique_ptr<GrpcServer> server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  RelayOptions options = Options(server->port());
  options.lanes = 1;
  options.pipeline_depth = 2;
  Relay relay(options, &metrics_);
  CreateOrders(1);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 1; }));
  // A small batch is unanswered: new rows wait for its answer (through
  // NOTIFYs and polls), then go in one batch.
  CreateOrders(5);
  WaitForRelayPasses(relay);
  EXPECT_EQ(sink.Batches(), std::vector<int>({1}));
  sink.Release(1);
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 6; }));
  EXPECT_EQ(sink.Batches(), std::vector<int>({1, 5}));
  // A backlog (more than a batch) while that one is unanswered: once it is
  // answered, a full batch goes and, behind it, a second one unanswered.
  CreateOrders(3 * options.batch_size);
  WaitForRelayPasses(relay);
  EXPECT_EQ(sink.Batches().size(), 2u);
  sink.Release(1);
  ASSERT_TRUE(WaitFor([&] { return sink.Batches().size() == 4; }));
  WaitForRelayPasses(relay);
  EXPECT_EQ(sink.Batches(),
            std::vector<int>({1, 5, options.batch_size, options.batch_size}));
  // Answered, the rest drains, two batches at a time.
  sink.Release(100);
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  EXPECT_EQ(sink.Events(), 6 + 3 * options.batch_size);
  relay.Stop(absl::Seconds(5));
}

TEST_F(RelayTest, OneStreamCarriesALightLoadAndABacklogSpreadsOverAll) {
  GatedSink sink;
  std::unique_ptr<GrpcServer> server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  RelayOptions options = Options(server->port());
  options.lanes = 2;
  options.pipeline_depth = 2;
  Relay relay(options, &metrics_);
  // Fewer rows than a batch, of aggregates in both lanes' partitions: one
  // batch, and the next rows wait for its answer (a lane of their own
  // would send them at once), then go together on the same stream.
  const int few = options.batch_size - 4;
  CreateOrders(few);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == few; }));
  CreateOrders(few);
  WaitForRelayPasses(relay);
  EXPECT_EQ(sink.Batches(), std::vector<int>({few}));
  sink.Release(1);
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 2 * few; }));
  EXPECT_EQ(sink.Batches(), std::vector<int>({few, few}));
  EXPECT_EQ(sink.Streams(0, 2).size(), 1u);
  // A backlog: once a claim fills a batch, every stream carries its share.
  CreateOrders(6 * options.batch_size);
  sink.Release(1000);
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  const size_t backlog_end = sink.Batches().size();
  EXPECT_EQ(sink.Streams(2, backlog_end).size(), 2u);
  // Worked off: one stream again.
  for (int i = 0; i < 3; ++i) {
    CreateOrders(few);
    ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  }
  EXPECT_EQ(sink.Streams(backlog_end, sink.Batches().size()).size(), 1u);
  EXPECT_EQ(sink.Events(), 2 * few + 6 * options.batch_size + 3 * few);
  relay.Stop(absl::Seconds(5));
}

TEST_F(RelayTest, VacuumsTheDeliveryTableAfterTenThousandDeletes) {
  GatedSink sink;
  sink.Release(1 << 20);
  std::unique_ptr<GrpcServer> server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  RelayOptions options = Options(server->port());
  options.batch_size = 1000;
  options.window = 4000;
  // One event per aggregate, written straight into the outbox.
  constexpr int kEvents = 10050;
  orders_.Exec(absl::StrCat(
      "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, prev_seq, "
      "event_type, schema_version, payload, partition) SELECT "
      "gen_random_uuid(), 'order', 'v-' || g, 0, 'OrderPaid', 1, '', g % 32 "
      "FROM generate_series(1, ",
      kEvents, ") g"));
  auto vacuums = [&] {
    return orders_.Scalar(
        "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = "
        "'outbox_delivery'");
  };
  const int64_t before = vacuums();
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }, absl::Seconds(60)));
  // On a thread of its own, at most once a second.
  EXPECT_TRUE(WaitFor([&] { return vacuums() > before; }));
  EXPECT_EQ(sink.Events(), kEvents);
  relay.Stop(absl::Seconds(5));
}

TEST_F(RelayTest, ARejectedEventBacksOffByTheOneRetryDelay) {
  MakeOrders(1);  // three events of one order; the first unreadable
  orders_.Exec(
      "UPDATE outbox SET schema_version = 2 WHERE seq = (SELECT min(seq) "
      "FROM outbox)");
  Consumer consumer(billing_.url(), 0);
  RelayOptions o = Options(consumer.port());
  o.reject_backoff = absl::Seconds(1);
  o.reject_backoff_max = absl::Milliseconds(1500);
  o.max_attempts = 3;
  Relay relay(o, &metrics_);
  relay.Start();
  // After the n-th rejection the row waits RetryDelay(1 s, 1.5 s, n, [0.5,
  // 1)) from then: [0.5, 1) s, then [0.75, 1.5) s (capped). Read as soon
  // as the attempt shows (polled every 20 ms; slack for the poll).
  const std::string wait_sql =
      "SELECT extract(epoch FROM available_at - now()) FROM outbox_delivery "
      "WHERE attempts = ";
  struct Wait {
    int attempt;
    double lo, hi;  // seconds
  };
  for (const Wait& w : {Wait{1, 0.5, 1.0}, Wait{2, 0.75, 1.5}}) {
    const int attempt = w.attempt;
    const double lo = w.lo, hi = w.hi;
    ASSERT_TRUE(WaitFor(
        [&] {
          return orders_.Scalar(absl::StrCat(
                     "SELECT count(*) FROM outbox_delivery WHERE attempts = ",
                     attempt)) == 1;
        },
        absl::Seconds(10)))
        << "attempt " << attempt;
    pqxx::result r = orders_.Query(absl::StrCat(wait_sql, attempt));
    ASSERT_EQ(r.size(), 1u) << "attempt " << attempt;
    const double left = r[0][0].as<double>();
    EXPECT_GT(left, lo - 0.3) << "attempt " << attempt;
    EXPECT_LE(left, hi) << "attempt " << attempt;
  }
  ASSERT_TRUE(WaitFor([&] {
    return orders_.Scalar(
               "SELECT count(*) FROM outbox_delivery WHERE status = 'dead' "
               "AND attempts = 3") == 1;
  }));
}

TEST_F(RelayTest, PoisonEventDeadLettersWhileOthersFlowAndRequeueDeliversIt) {
  std::vector<std::string> ids = MakeOrders(6);  // order 0: three events
  const std::string poison = ids[0];
  Poison(poison);
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  ASSERT_NO_FATAL_FAILURE(ExpectPoisonDead(poison));
  // Its successors wait at the relay, not at the consumer.
  EXPECT_EQ(
      orders_.Scalar(absl::StrCat(
          "SELECT count(*) FROM outbox_delivery WHERE status = 'pending' AND "
          "aggregate_id = '",
          poison, "'")),
      2);
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM held_events"), 0);

  // The operator fixes the cause and requeues through the admin API.
  orders_.Exec("UPDATE outbox SET schema_version = 1");
  AdminOnLoopback admin(orders_.url(), &relay);
  v1::RelayAdmin::Stub* stub = admin.stub();
  ASSERT_NE(stub, nullptr);
  {
    grpc::ClientContext ctx;
    v1::RelayStats stats;
    ASSERT_TRUE(stub->GetStats(&ctx, {}, &stats).ok());
    EXPECT_EQ(stats.dead_letters(), 1);
    EXPECT_EQ(stats.pending(), 2);  // behind the dead letter
    EXPECT_EQ(stats.rejected_by_process(), 3);
    EXPECT_EQ(stats.delivered_by_process(), Events() - 3);
    EXPECT_EQ(stats.partitions_owned_size(), kPartitionCount);
  }
  std::string dead_id;
  {
    grpc::ClientContext ctx;
    v1::ListDeadLettersResponse list;
    ASSERT_TRUE(stub->ListDeadLetters(&ctx, {}, &list).ok());
    ASSERT_EQ(list.rows_size(), 1);
    EXPECT_EQ(list.rows(0).event().aggregate_id(), poison);
    EXPECT_EQ(list.rows(0).status(), "dead");
    dead_id = list.rows(0).event().event_id();
  }
  // GetEvent: one row, decoded, with its state for the subscription.
  const auto get = [&](const std::string& id, v1::OutboxRow* row,
                       const std::string& subscription = "") {
    grpc::ClientContext ctx;
    v1::GetEventRequest req;
    req.set_event_id(id);
    req.set_subscription(subscription);
    return stub->GetEvent(&ctx, req, row);
  };
  {
    v1::OutboxRow row;
    ASSERT_TRUE(get(dead_id, &row).ok());
    EXPECT_EQ(row.event().event_id(), dead_id);
    EXPECT_EQ(row.event().aggregate_id(), poison);
    EXPECT_EQ(row.event().event_type(), "OrderCreated");
    EXPECT_EQ(row.event().schema_version(), 1);  // fixed by the operator
    EXPECT_EQ(row.status(), "dead");
    EXPECT_EQ(row.attempts(), 3);
    EXPECT_NE(row.last_error().find("schema_version"), std::string::npos)
        << row.last_error();
    EXPECT_TRUE(row.has_dead_at());
    v1::OrderCreated created;
    ASSERT_TRUE(row.event().payload().UnpackTo(&created));
    EXPECT_EQ(created.order_id(), poison);
    const std::string delivered_id =
        orders_
            .Query(absl::StrCat("SELECT event_id::text FROM outbox WHERE "
                                "aggregate_id = '",
                                ids[1], "' ORDER BY seq LIMIT 1"))[0][0]
            .as<std::string>();
    ASSERT_TRUE(get(delivered_id, &row).ok());
    EXPECT_EQ(row.event().event_id(), delivered_id);
    EXPECT_EQ(row.event().aggregate_id(), ids[1]);
    EXPECT_EQ(row.status(), "delivered");
    EXPECT_EQ(row.attempts(), 0);
    EXPECT_EQ(get(NewUuid(), &row).error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(get("not-a-uuid", &row).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(get(dead_id, &row, "nobody").error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  grpc::ClientContext ctx;
  v1::RequeueRequest req;
  req.set_aggregate_id(poison);
  v1::RequeueResponse resp;
  ASSERT_TRUE(stub->Requeue(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.requeued(), 1);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events(); }));
  ExpectExactlyOnceInOrder();
  grpc::ClientContext again;
  EXPECT_EQ(stub->Requeue(&again, req, &resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(RelayTest, ManyAggregatesBehindABackoffDelayNoOtherAndKeepOrder) {
  // The first event of every order with more than one event backs off for
  // an hour: its successors are pending and ready but must wait. Claims
  // page past them (many batches' worth) instead of excluding each
  // aggregate by id, and deliver every other order's event.
  MakeOrders(240);
  orders_.Exec(
      "UPDATE outbox_delivery d SET available_at = now() + interval '1 "
      "hour', attempts = 1 FROM outbox o WHERE o.seq = d.seq AND "
      "o.prev_seq = 0 AND o.aggregate_id IN (SELECT aggregate_id FROM "
      "outbox GROUP BY aggregate_id HAVING count(*) > 1)");
  const int64_t single = orders_.Scalar(
      "SELECT count(*) FROM (SELECT aggregate_id FROM outbox GROUP BY "
      "aggregate_id HAVING count(*) = 1) x");
  ASSERT_EQ(single, 80);  // orders neither paid nor cancelled
  Consumer consumer(billing_.url(), 0);
  RelayOptions options = Options(consumer.port());
  std::atomic<int> claims{0};
  options.after_claim = [&](size_t) { ++claims; };
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Applied() == single; }));
  // Several full claims later, still none of the waiting ones.
  const int claims_before = claims;
  ASSERT_TRUE(WaitFor([&] { return claims >= claims_before + 5; }));
  EXPECT_EQ(Applied(), single);
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(billing_.Scalar("SELECT count(DISTINCT aggregate_id) FROM inbox"),
            single);
  // The backoff ends: everything arrives once, in chain order.
  orders_.Exec("UPDATE outbox_delivery SET available_at = now()");
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events(); }));
  ExpectExactlyOnceInOrder();
}

TEST_F(RelayTest, RestartLosesNothing) {
  MakeOrders(40);
  Consumer consumer(billing_.url(), 0);
  {
    Relay first(Options(consumer.port()), &metrics_);
    first.Start();
    ASSERT_TRUE(WaitFor([&] { return Applied() > 0; }));
    first.Stop(absl::ZeroDuration());  // whatever is in flight stays pending
  }
  MakeOrders(20);
  Relay second(Options(consumer.port()), &metrics_);
  second.Start();
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }))
      << Applied() << " of " << Events();
  ExpectExactlyOnceInOrder();
}

TEST_F(RelayTest, TwoRelaysSplitPartitionsAndOneTakesOverWhenTheOtherStops) {
  Consumer consumer(billing_.url(), 0);
  Metrics m2;
  Relay a(Options(consumer.port()), &metrics_);
  a.Start();
  ASSERT_TRUE(WaitFor(
      [&] { return a.State().partitions_owned.size() == kPartitionCount; }));
  auto b = std::make_unique<Relay>(Options(consumer.port()), &m2);
  b->Start();
  auto split = [&] {
    RelayState sa = a.State(), sb = b->State();
    std::set<int> both(sa.partitions_owned.begin(), sa.partitions_owned.end());
    for (int p : sb.partitions_owned) {
      if (!both.insert(p).second) return false;  // owned twice
    }
    return sa.partitions_owned.size() == kPartitionCount / 2 &&
           sb.partitions_owned.size() == kPartitionCount / 2;
  };
  ASSERT_TRUE(WaitFor(split)) << a.State().partitions_owned.size() << " + "
                              << b->State().partitions_owned.size();
  MakeOrders(30);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events(); }));
  b.reset();  // stops: its session and its locks end
  ASSERT_TRUE(WaitFor(
      [&] { return a.State().partitions_owned.size() == kPartitionCount; }));
  MakeOrders(30);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  ExpectExactlyOnceInOrder();
}

TEST_F(RelayTest, RetentionDeletesOnlyOldDeliveredRows) {
  Consumer consumer(billing_.url(), 0);
  ASSERT_NO_FATAL_FAILURE(DeliverOldOrders(consumer.port()));
  const int64_t delivered = Events();
  MakeOrders(5);  // pending, and young
  RelayOptions options = Options(consumer.port());
  options.retention = absl::Hours(24);
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Events() < delivered; }));
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  // The old delivered rows are gone; the new ones were delivered and kept.
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox WHERE created_at < "
                           "now() - interval '1 day'"),
            0);
  EXPECT_EQ(Events(), Applied() - delivered);

  // The invariant checker counts what retention deleted, on both sides,
  // as pruned, never as lost or phantom.
  auto report = tools::Check(orders_.url(), billing_.url(), absl::Seconds(10));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->ok()) << report->Summary();
  EXPECT_EQ(report->pruned_from_outbox, delivered);
  billing_.Exec("UPDATE inbox SET applied_at = now() - interval '2 days'");
  Database billing_db(billing_.url(), 1, "test-retention");
  ASSERT_TRUE(billing_db
                  .Run([&](pqxx::connection& c) {
                    while (inbox::PruneInboxOnce(c, absl::Hours(24), 7) > 0) {
                    }
                    return absl::OkStatus();
                  })
                  .ok());
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM inbox"), 0);
  report = tools::Check(orders_.url(), billing_.url(), absl::Seconds(10));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->ok()) << report->Summary();
  EXPECT_EQ(report->pruned_from_outbox, 0);
  EXPECT_EQ(report->pruned_from_inbox, Events());
  EXPECT_EQ(report->phantoms, 0);
}

// Retention deletes only what no subscription still needs: below the
// oldest row any subscription has not passed (pending, or a dead letter,
// for billing or for a second subscription that is behind), and only what
// is older than --retention. Each start of a relay prunes at once; the
// test moves the delivery state between starts by hand (no consumer
// answers, so the relay changes none of it) and checks exactly which rows
// are gone.
TEST_F(RelayTest, RetentionNeverDeletesWhatAnySubscriptionStillNeeds) {
  orders_.Exec("INSERT INTO subscriptions (name) VALUES ('audit')");
  MakeOrders(10);
  std::vector<int64_t> seqs;
  for (const auto& row : orders_.Query("SELECT seq FROM outbox ORDER BY seq")) {
    seqs.push_back(row[0].as<int64_t>());
  }
  ASSERT_EQ(seqs.size(), 19u);
  orders_.Exec("UPDATE outbox SET created_at = now() - interval '2 days'");
  MakeOrders(1);  // three young events, delivered everywhere
  const int64_t young = Events() - 19;
  // Every subscription has passed every row but these: audit is behind at
  // seqs[5]; billing's seqs[11] is a dead letter, seqs[15] pending.
  const auto at = [&](int i) { return absl::StrCat(seqs[i]); };
  orders_.Exec(
      "DELETE FROM outbox_delivery WHERE NOT ((subscription = 'audit' "
      "AND seq = " +
      at(5) +
      ") OR (subscription = 'billing' AND seq "
      "IN (" +
      at(11) + ", " + at(15) + ")))");
  orders_.Exec(
      "UPDATE outbox_delivery SET status = 'dead', attempts = 5, "
      "dead_at = now() WHERE seq = " +
      at(11));
  int port;
  { port = Consumer(billing_.url(), 0).port(); }  // nobody answers there
  RelayOptions options = Options(port);
  options.retention = absl::Hours(24);
  const auto pruned = [&] {
    return metrics_.AddCounter("outbox_relay_pruned_total", "")->value();
  };
  // Starts a relay, waits until its first retention pass deleted `n` more
  // rows (one statement: all of them at once), and stops it.
  const auto prune_pass = [&](int64_t n) {
    const int64_t before = pruned();
    Relay relay(options, &metrics_);
    relay.Start();
    EXPECT_TRUE(WaitFor([&] { return pruned() >= before + n; }))
        << "pruned " << pruned() - before << " of " << n;
    relay.Stop(absl::ZeroDuration());
    return pruned() - before;
  };
  const auto first_retained = [&] {
    return orders_.Scalar("SELECT min(seq) FROM outbox");
  };
  const auto old_left = [&] {
    return orders_.Scalar(
        "SELECT count(*) FROM outbox WHERE created_at < now() - interval '1 "
        "day'");
  };

  // Audit still needs seqs[5]: only what lies below it goes.
  EXPECT_EQ(prune_pass(5), 5);
  EXPECT_EQ(first_retained(), seqs[5]);
  EXPECT_EQ(old_left(), 14);

  // Audit catches up; billing's dead letter at seqs[11] holds the rest.
  orders_.Exec("DELETE FROM outbox_delivery WHERE subscription = 'audit'");
  EXPECT_EQ(prune_pass(6), 6);
  EXPECT_EQ(first_retained(), seqs[11]);
  EXPECT_EQ(old_left(), 8);

  // The dead letter is requeued and delivered; billing's pending seqs[15]
  // holds what follows.
  orders_.Exec("DELETE FROM outbox_delivery WHERE seq = " + at(11));
  EXPECT_EQ(prune_pass(4), 4);
  EXPECT_EQ(first_retained(), seqs[15]);
  EXPECT_EQ(old_left(), 4);

  // Delivered at last: every old row goes, the young ones stay.
  orders_.Exec("DELETE FROM outbox_delivery");
  EXPECT_EQ(prune_pass(4), 4);
  EXPECT_EQ(old_left(), 0);
  EXPECT_EQ(Events(), young);
}

// Retention deletes, backlog figures and vacuum run beside delivery, never
// in its way: with retention waiting on a lock (an operator's replay holds
// it back), new events are still delivered at once, the relay stops
// without waiting for the lock, and the old rows go once the lock does.
TEST_F(RelayTest, HousekeepingWaitingOnALockDelaysNoDelivery) {
  Consumer consumer(billing_.url(), 0);
  ASSERT_NO_FATAL_FAILURE(DeliverOldOrders(consumer.port()));
  pqxx::connection holder(orders_.url());
  auto lock = std::make_unique<pqxx::work>(holder);
  // Not a row lock: that gives the holder an xid, and retention waits for
  // a writer that may still commit below without deleting.
  HoldRetentionBack(*lock);
  RelayOptions options = Options(consumer.port());
  options.retention = absl::Hours(24);
  // No lock or statement timeout: the delete waits as long as the lock is
  // held, so only Stop cancelling it can end its wait while it is.
  options.session.lock_timeout = absl::ZeroDuration();
  options.session.statement_timeout = absl::ZeroDuration();
  const auto waiting = [&] {
    return orders_.Scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
        "'Lock' AND query LIKE '%pg_advisory_xact_lock(%' AND datname = "
        "current_database()");
  };
  auto relay = std::make_unique<Relay>(options, &metrics_);
  relay->Start();
  ASSERT_TRUE(WaitFor([&] { return waiting() == 1; }));
  const int64_t old_events = Events();
  MakeOrders(5);
  const int64_t young_events = Events() - old_events;
  EXPECT_TRUE(WaitFor([&] { return Pending() == 0; }, absl::Seconds(5)));
  EXPECT_EQ(Applied(), old_events + young_events);
  EXPECT_EQ(Events(), old_events + young_events);  // nothing deleted yet
  // Stop cancels the waiting delete: the relay stops while the lock is
  // still held, and the delete no longer waits for it.
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    relay.reset();
    stopped = true;
  });
  const bool stopped_while_locked =
      WaitFor([&] { return stopped.load(); }, absl::Minutes(2));
  EXPECT_TRUE(stopped_while_locked)
      << "the relay's stop waited for the retention delete's lock";
  EXPECT_EQ(waiting(), 0);
  EXPECT_EQ(Events(), old_events + young_events);  // nothing deleted
  lock.reset();  // the holder lets go (and frees a stop that hung on it)
  stopper.join();
  relay = std::make_unique<Relay>(options, &metrics_);
  relay->Start();
  ASSERT_TRUE(WaitFor([&] { return Events() == young_events; }));
}

using ::outbox::testing::MaxOf;

// While the backlog figures cannot be read, the age of the oldest pending
// event keeps growing from the last figure instead of freezing there, so
// that an alert on it still fires; a refresh that succeeds again reports
// the database's figure. The figures' own age grows meanwhile.
TEST_F(RelayTest, PendingAgeKeepsGrowingWhileTheBacklogCannotBeRead) {
  int port;
  { port = Consumer(billing_.url(), 0).port(); }  // a port nobody serves now
  MakeOrders(2);
  RelayOptions options = Options(port);
  options.backlog_refresh = absl::Milliseconds(200);
  options.session.lock_timeout = absl::Milliseconds(200);
  Relay relay(options, &metrics_);
  relay.Start();
  const auto age = [&] {
    return MaxOf(metrics_, "outbox_relay_oldest_pending_seconds");
  };
  ASSERT_TRUE(WaitFor([&] { return age() > 0; }));
  pqxx::connection holder(orders_.url());
  auto lock = std::make_unique<pqxx::work>(holder);
  lock->exec("LOCK TABLE outbox_delivery IN ACCESS EXCLUSIVE MODE");
  // Their own age tells that the figures are old, with or without pending
  // events (a relay that reads none says so too).
  const auto figures_age = [&] {
    return MaxOf(metrics_, "outbox_relay_backlog_figures_age_seconds");
  };
  // Several refreshes (every 200 ms) failed: the figures are old.
  ASSERT_TRUE(WaitFor([&] { return figures_age() >= 1.5; }));
  const double before = age();
  const double figures_before = figures_age();
  // Both keep growing while the lock is held.
  EXPECT_TRUE(WaitFor([&] {
    return age() - before >= 1.5 && figures_age() - figures_before >= 1.5;
  })) << age() - before
      << " " << figures_age() - figures_before;
  lock.reset();
  EXPECT_TRUE(WaitFor([&] { return figures_age() < 1; }));
  // Read again: at least as old (the events are still pending) and
  // counted from their creation, not grown from a guess.
  const double created = static_cast<double>(orders_.Scalar(
      "SELECT extract(epoch FROM now() - min(created_at))::bigint FROM "
      "outbox"));
  ASSERT_TRUE(WaitFor([&] {
    const double a = age();
    return a >= created - 1 && a <= created + 3;
  }));
}

TEST_F(RelayTest,
       ClaimStaysAnIndexLookupBehindALargeHistoryWithStaleStatistics) {
  // Regression: behind 200k delivered rows analyzed before a backlog
  // arrived, an earlier claim was planned as a nested loop comparing every
  // pending row with every other (9 s a claim). The claim must read only
  // undelivered rows by index, and the outbox by its primary key.
  orders_.Exec(
      "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, prev_seq, "
      "event_type, schema_version, payload, partition) "
      "SELECT gen_random_uuid(), 'order', 'old-' || g, 0, 'OrderCreated', 1, "
      "'\\x00', g % 32 FROM generate_series(1, 200000) g");
  orders_.Exec("DELETE FROM outbox_delivery");  // delivered
  orders_.Exec("ANALYZE outbox; ANALYZE outbox_delivery");
  orders_.Exec(
      "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, prev_seq, "
      "event_type, schema_version, payload, partition) SELECT "
      "gen_random_uuid(), 'order', 'new-' || (g / 2), 0, 'OrderCreated', 1, "
      "'\\x00', (g / 2) % 32 FROM generate_series(1, 8000) g");
  std::string plan;
  pqxx::connection conn(orders_.url());
  pqxx::nontransaction tx(conn);
  for (const auto& row : tx.exec_params(
           absl::StrCat("EXPLAIN ", kClaimSql), "billing",
           "{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,"
           "24,25,26,27,28,29,30,31}",
           "{}", 128, 0, "{}", "relay-1")) {
    absl::StrAppend(&plan, row[0].as<std::string>(), "\n");
  }
  EXPECT_NE(plan.find("outbox_delivery_pkey"), std::string::npos) << plan;
  EXPECT_NE(plan.find("outbox_pkey"), std::string::npos) << plan;
  EXPECT_EQ(plan.find("Seq Scan on outbox "), std::string::npos) << plan;
  // And as the relay runs it: prepared, under a generic plan. One such
  // plan hashed every pending row to test each claimed row's predecessor,
  // once the statistics knew a backlog and the table its true size.
  tx.exec(
      "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, prev_seq, "
      "event_type, schema_version, payload, partition) SELECT "
      "gen_random_uuid(), 'order', 'more-' || g, 0, 'OrderCreated', 1, "
      "'\\x00', g % 32 FROM generate_series(1, 50000) g");
  tx.exec("VACUUM (FULL, ANALYZE) outbox_delivery");
  tx.exec("SET plan_cache_mode = force_generic_plan");
  for (const auto& [name, sql] :
       {std::pair{"claim", kClaimSql},
        std::pair{"mark_and_claim", kMarkAndClaimSql}}) {
    const bool mark = std::string(name) == "mark_and_claim";
    tx.exec(absl::StrCat("PREPARE ", name,
                         "(text, int[], text[], int, bigint, bigint[], text",
                         mark ? ", uuid[]" : "", ") AS ", sql));
    plan.clear();
    for (const auto& row : tx.exec(absl::StrCat(
             "EXPLAIN EXECUTE ", name,
             "('billing', '{0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30}', "
             "'{}', 128, 0, '{1,2,3}', 'relay-1'",
             mark ? ", '{00000000-0000-0000-0000-000000000001,"
                    "00000000-0000-0000-0000-000000000002,"
                    "00000000-0000-0000-0000-000000000003}'"
                  : "",
             ")"))) {
      absl::StrAppend(&plan, row[0].as<std::string>(), "\n");
    }
    EXPECT_EQ(plan.find("Seq Scan on outbox"), std::string::npos) << plan;
    // Hashed: the two lists ($3 busy aggregates, $6 rows being marked),
    // once per claim. Not the predecessor test: a probe by its seq.
    size_t hashed = 0;
    for (size_t at = 0;
         (at = plan.find("hashed SubPlan", at)) != std::string::npos; ++at) {
      ++hashed;
    }
    EXPECT_EQ(hashed, 2u) << plan;
    EXPECT_NE(plan.find("(seq = o.prev_seq)"), std::string::npos) << plan;
  }
}

// A consumer that is down, as the relay sees it: a port that accepts each
// connection and closes it at once, counting them.
class ClosingListener {
 public:
  ClosingListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0);
    EXPECT_EQ(listen(fd_, 16), 0);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] {
      for (;;) {
        const int c = accept(fd_, nullptr, nullptr);
        if (c < 0) return;  // shut down
        // A reset, not a close: no TIME_WAIT keeps the port from the
        // consumer that takes it later.
        linger reset{1, 0};
        setsockopt(c, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
        close(c);
        ++accepted_;
      }
    });
  }
  ~ClosingListener() { Close(); }
  // Stops listening: the port is free for a real consumer.
  void Close() {
    if (fd_ < 0) return;
    shutdown(fd_, SHUT_RDWR);
    thread_.join();
    close(fd_);
    fd_ = -1;
  }
  int port() const { return port_; }
  int accepted() const { return accepted_; }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::atomic<int> accepted_{0};
  std::thread thread_;
};

TEST_F(RelayTest, ConsumerOutageIsRetriedWithoutCountingAttempts) {
  ClosingListener down;
  const int port = down.port();
  MakeOrders(10);
  Relay relay(Options(port), &metrics_);
  relay.Start();
  // Retried: the relay tried to reach the consumer again and again.
  ASSERT_TRUE(WaitFor([&] { return down.accepted() >= 3; }))
      << down.accepted() << " connection attempts";
  down.Close();
  EXPECT_EQ(Pending(), Events());
  EXPECT_EQ(
      orders_.Scalar("SELECT coalesce(max(attempts), 0) FROM outbox_delivery"),
      0);
  Consumer consumer(billing_.url(), port);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  ExpectExactlyOnceInOrder();
  EXPECT_EQ(orders_.Scalar(
                "SELECT count(*) FROM outbox_delivery WHERE status = 'dead'"),
            0);
}

// Fan-out: two subscriptions, each with its relay and consumer. One
// consumer is down: the other subscription is delivered regardless, and
// the first catches up, complete and in order, when its consumer returns.
TEST_F(RelayTest, EachSubscriptionGetsEveryEventAndADownOneDelaysNoOther) {
  testing::TestDatabase audit_db("relay_audit", ConsumerSchemas(Audit()));
  int audit_port;
  { audit_port = Consumer(audit_db.url(), 0, Audit()).port(); }  // down
  Consumer billing(billing_.url(), 0);
  RelayOptions audit_options = Options(audit_port);
  audit_options.subscription = "audit";
  Metrics audit_metrics(Labels{{"subscription", "audit"}});
  Relay audit_relay(audit_options, &audit_metrics);
  audit_relay.Start();
  Relay billing_relay(Options(billing.port()), &metrics_);
  billing_relay.Start();
  ASSERT_TRUE(WaitFor([&] {
    return orders_.Scalar("SELECT count(*) FROM subscriptions") == 2;
  }));
  MakeOrders(30);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  ExpectExactlyOnceInOrder();
  EXPECT_EQ(Pending("audit"), Events());
  EXPECT_EQ(orders_.Scalar("SELECT coalesce(max(attempts), 0) FROM "
                           "outbox_delivery WHERE subscription = 'audit'"),
            0);
  Consumer audit(audit_db.url(), audit_port, Audit());
  ASSERT_TRUE(WaitFor([&] { return Pending("audit") == 0; }));
  EXPECT_EQ(audit_db.Scalar("SELECT count(*) FROM audit_log"), Events());
  EXPECT_EQ(audit_db.Scalar("SELECT count(DISTINCT event_id) FROM audit_log"),
            Events());
  EXPECT_EQ(audit_db.Scalar(
                "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION "
                "BY aggregate_id ORDER BY apply_id) AS before FROM inbox) x "
                "WHERE before >= seq"),
            0);
  // The subscriptions' metrics and partitions are their own.
  EXPECT_NE(
      audit_metrics.Render().find(absl::StrCat(
          "outbox_relay_delivered_total{subscription=\"audit\"} ", Events())),
      std::string::npos)
      << audit_metrics.Render();
  EXPECT_EQ(audit_relay.State().partitions_owned.size(),
            size_t{kPartitionCount});
}

// A subscription created with StartFrom::kNow is owed only what is written
// after it; one created with kOldest every retained event.
TEST_F(RelayTest, NewSubscriptionStartsFromOldestOrNow) {
  MakeOrders(6);
  const int64_t before = Events();
  testing::TestDatabase late_db("relay_late", ConsumerSchemas(Audit()));
  testing::TestDatabase all_db("relay_all", ConsumerSchemas(Audit()));
  Consumer late(late_db.url(), 0, Audit());
  Consumer all(all_db.url(), 0, Audit());
  RelayOptions late_options = Options(late.port());
  late_options.subscription = "late";
  late_options.start_from = StartFrom::kNow;
  RelayOptions all_options = Options(all.port());
  all_options.subscription = "all";
  Metrics m1, m2;
  Relay late_relay(late_options, &m1), all_relay(all_options, &m2);
  late_relay.Start();
  all_relay.Start();
  ASSERT_TRUE(WaitFor([&] {
    return orders_.Scalar("SELECT count(*) FROM subscriptions") == 3;
  }));
  MakeOrders(4);
  const int64_t after = Events() - before;
  // Applied, and then marked: the marks follow the answers.
  ASSERT_TRUE(WaitFor([&] {
    return late_db.Scalar("SELECT count(*) FROM inbox") == after &&
           all_db.Scalar("SELECT count(*) FROM inbox") == Events() &&
           Pending("late") == 0 && Pending("all") == 0;
  })) << Pending("late")
      << " and " << Pending("all") << " pending";
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_deliveries WHERE "
                           "subscription = 'late' AND status = 'skipped'"),
            before);
}

TEST_F(RelayTest, ReadOnlyConsumerDatabaseCostsTimeNotAttempts) {
  // A failover of the billing database to a standby: every batch fails
  // there, and nothing may count against the events.
  MakeOrders(20);
  Consumer consumer(billing_.url(), 0);
  billing_.Exec(absl::StrCat("ALTER DATABASE ", billing_.name(),
                             " SET default_transaction_read_only = on"));
  billing_.Exec(absl::StrCat(
      "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname "
      "= '",
      billing_.name(), "' AND pid <> pg_backend_pid()"));
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  // Sent, failed at the consumer, sent again, three times over.
  ASSERT_TRUE(WaitFor([&] { return StreamFailures() >= 3; }))
      << StreamFailures() << " stream failures";
  EXPECT_EQ(Applied(), 0);
  EXPECT_EQ(Pending(), Events());
  EXPECT_EQ(
      orders_.Scalar("SELECT coalesce(max(attempts), 0) FROM outbox_delivery"),
      0);
  billing_.Exec(absl::StrCat("ALTER DATABASE ", billing_.name(),
                             " RESET default_transaction_read_only"));
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  ExpectExactlyOnceInOrder();
  EXPECT_EQ(orders_.Scalar(
                "SELECT count(*) FROM outbox_delivery WHERE status = 'dead' "
                "OR attempts > 0"),
            0);
}

TEST_F(RelayTest, BulkRequeueByTimeAndErrorReportsItsCount) {
  std::vector<std::string> ids = MakeOrders(8);
  // Four first events become poison; each dies after max_attempts.
  orders_.Exec(absl::StrCat(
      "UPDATE outbox SET schema_version = 2 WHERE prev_seq = 0 AND "
      "aggregate_id IN ('",
      ids[0], "','", ids[1], "','", ids[2], "','", ids[3], "')"));
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  auto dead = [&] {
    return orders_.Scalar(
        "SELECT count(*) FROM outbox_delivery WHERE status = 'dead'");
  };
  ASSERT_TRUE(WaitFor([&] { return dead() == 4; }));
  // One died long ago, one of another cause.
  orders_.Exec(
      absl::StrCat("UPDATE outbox_delivery SET dead_at = now() - "
                   "interval '3 hours' WHERE status = 'dead' AND "
                   "aggregate_id = '",
                   ids[0], "'"));
  orders_.Exec(
      absl::StrCat("UPDATE outbox_delivery SET last_error = 'payload: "
                   "unreadable' WHERE status = 'dead' AND "
                   "aggregate_id = '",
                   ids[1], "'"));
  orders_.Exec("UPDATE outbox SET schema_version = 1");

  AdminOnLoopback admin(orders_.url(), &relay);
  v1::RelayAdmin::Stub* stub = admin.stub();
  ASSERT_NE(stub, nullptr);
  auto requeue = [&](const v1::RequeueRequest& req, v1::RequeueResponse* resp) {
    grpc::ClientContext ctx;
    return stub->Requeue(&ctx, req, resp);
  };
  // Those that died more than an hour ago: ids[0] alone.
  v1::RequeueRequest old;
  old.set_all_dead(true);
  ToTimestamp(absl::Now() - absl::Hours(1), old.mutable_died_before());
  v1::RequeueResponse resp;
  ASSERT_TRUE(requeue(old, &resp).ok());
  EXPECT_EQ(resp.requeued(), 1);
  ASSERT_TRUE(WaitFor([&] { return dead() == 3; }));
  EXPECT_EQ(orders_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox_delivery WHERE status = 'dead' "
                "AND aggregate_id = '",
                ids[0], "'")),
            0);
  // Within the last hour and of this cause: ids[2] and ids[3].
  v1::RequeueRequest req;
  req.set_all_dead(true);
  req.set_error_contains("schema_version");
  ToTimestamp(absl::Now() - absl::Hours(1), req.mutable_died_after());
  ASSERT_TRUE(requeue(req, &resp).ok());
  EXPECT_EQ(resp.requeued(), 2);  // ids[2] and ids[3]
  ASSERT_TRUE(WaitFor([&] { return dead() == 1; }));

  v1::RequeueRequest all;
  all.set_all_dead(true);
  ASSERT_TRUE(requeue(all, &resp).ok());
  EXPECT_EQ(resp.requeued(), 1);  // ids[1]
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  ExpectExactlyOnceInOrder();
  ASSERT_TRUE(requeue(all, &resp).ok());  // nothing left: zero, not an error
  EXPECT_EQ(resp.requeued(), 0);

  v1::RequeueRequest both;
  both.set_all_dead(true);
  both.set_aggregate_id(ids[0]);
  EXPECT_EQ(requeue(both, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::RequeueRequest filtered_id;
  filtered_id.set_event_id(NewUuid());
  filtered_id.set_error_contains("x");
  EXPECT_EQ(requeue(filtered_id, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// Ownership lives in lease rows, not in a session: a replica that froze
// (or whose session the network cut) holds its partitions only until its
// leases expire, then another takes them over.
TEST_F(RelayTest, PartitionsOfAReplicaThatStoppedRenewingAreTakenOver) {
  orders_.Exec(
      "INSERT INTO outbox_partition_leases (subscription, partition, owner, "
      "token, expires_at) SELECT 'billing', p, 'frozen', 7, now() + "
      "interval '2 seconds' FROM generate_series(0, 31) p");
  orders_.Exec(
      "INSERT INTO outbox_relay_members VALUES ('billing', 'frozen', now() + "
      "interval '2 seconds')");
  MakeOrders(20);
  Consumer consumer(billing_.url(), 0);
  RelayOptions options = Options(consumer.port());
  options.lease_ttl = absl::Seconds(3);
  Relay relay(options, &metrics_);
  relay.Start();
  // While the frozen replica's leases last, its partitions are its own.
  ASSERT_TRUE(WaitFor([&] {
    return orders_.Scalar(absl::StrCat(
               "SELECT count(*) FROM outbox_relay_members WHERE member = '",
               relay.member(), "'")) == 1;
  }));
  EXPECT_TRUE(relay.State().partitions_owned.empty());
  EXPECT_EQ(Pending(), Events());
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; },
                      absl::Seconds(20)));
  EXPECT_EQ(relay.State().partitions_owned.size(),
            static_cast<size_t>(kPartitionCount));
  // Each partition changed hands once more: a new fencing token.
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_partition_leases "
                           "WHERE token = 8"),
            kPartitionCount);
  ExpectExactlyOnceInOrder();
}

// The claim checks the lease itself: a replica that has not noticed that
// another took its partitions (it froze between two renewals) claims
// nothing of them.
TEST_F(RelayTest, AClaimReadsOnlyPartitionsWhoseLeaseTheReplicaHolds) {
  Consumer consumer(billing_.url(), 0);
  RelayOptions options = Options(consumer.port());
  options.lease_ttl = absl::Minutes(5);
  options.rebalance_interval = absl::Minutes(5);  // it will not notice
  std::atomic<int> claims{0};
  options.after_claim = [&](size_t) { ++claims; };
  Relay relay(options, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] {
    return relay.State().partitions_owned.size() == kPartitionCount;
  }));
  orders_.Exec(
      "UPDATE outbox_partition_leases SET owner = 'thief', token = token + 1 "
      "WHERE subscription = 'billing'");
  MakeOrders(10);
  const int before = claims.load();
  ASSERT_TRUE(WaitFor([&] { return claims.load() >= before + 5; }));
  EXPECT_EQ(Applied(), 0);
  EXPECT_EQ(Pending(), Events());
  orders_.Exec(absl::StrCat("UPDATE outbox_partition_leases SET owner = '",
                            relay.member(),
                            "' WHERE subscription = 'billing'"));
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  ExpectExactlyOnceInOrder();
}

TEST_F(RelayTest, RogueLockOnTheOutboxStallsTheWatchdogUntilReleased) {
  MakeOrders(5);
  Consumer consumer(billing_.url(), 0);
  RelayOptions options = Options(consumer.port());
  options.session.lock_timeout = absl::Milliseconds(200);
  Watchdog watchdog("relay claim/mark loop", absl::Milliseconds(800));
  pqxx::connection rogue(orders_.url());
  auto lock = std::make_unique<pqxx::work>(rogue);
  lock->exec("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE");
  Relay relay(options, &metrics_, &watchdog);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return watchdog.Stalled().has_value(); },
                      absl::Seconds(10)));
  EXPECT_NE(watchdog.Stalled()->find("lock"), std::string::npos)
      << *watchdog.Stalled();
  lock.reset();  // the rogue session lets go
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  EXPECT_FALSE(watchdog.Stalled().has_value());
}

// An answer names its event: when the seq it was sent under belongs to
// another event by the time it is recorded (a failover handed the seq out
// again), that event's delivery row stays, and it is delivered.
TEST_F(RelayTest, AnAnswerNeverMarksAnotherEventAtTheSameSeq) {
  GatedSink sink;
  auto server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  const std::string order = CreateOrder();
  ASSERT_FALSE(order.empty());
  Relay relay(Options(server->port()), &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return sink.Events() == 1; }));
  // The sent event vanishes and another takes its seq (what a promoted
  // standby that lacked it does); then the consumer's answer arrives.
  const int64_t seq = orders_.Scalar("SELECT seq FROM outbox");
  const std::string other = NewUuid();
  orders_.Exec("DELETE FROM outbox_delivery");
  orders_.Exec(absl::StrCat(
      "WITH gone AS (DELETE FROM outbox RETURNING payload) INSERT INTO outbox "
      "(seq, event_id, aggregate_type, aggregate_id, prev_seq, event_type, "
      "schema_version, payload, partition) SELECT ",
      seq, ", '", other, "', 'order', 'other', 0, 'OrderCreated', 1, payload, ",
      PartitionOf("other"), " FROM gone"));
  ASSERT_EQ(Pending(), 1);
  sink.Release(1);
  // The new event is delivered (it would not be, had the answer deleted its
  // row); its own answer then marks it.
  ASSERT_TRUE(WaitFor([&] {
    for (const auto& r : sink.Requests()) {
      for (const auto& e : r.events()) {
        if (e.event_id() == other) return true;
      }
    }
    return false;
  }));
  sink.Release(1);
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
}

// The consumer's database lost commits (restored from an earlier copy: a
// new database oid): the relay sees it in the answers and heals, owing the
// lost events again, so that nothing stays lost or held.
TEST_F(RelayTest, AConsumerDatabaseRestoredFromAnEarlierCopyIsHealed) {
  auto inbox_rows = [](const std::string& url) {
    pqxx::connection c(url);
    pqxx::nontransaction tx(c);
    return tx.exec("SELECT count(*) FROM inbox")[0][0].as<int64_t>();
  };
  MakeOrders(20);
  int port = 0;
  auto consumer = std::make_unique<Consumer>(billing_.url(), 0);
  port = consumer->port();
  Relay relay(Options(port), &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] {
    return inbox_rows(billing_.url()) == Events() && Pending() == 0;
  }));
  // The backup: a copy of the billing database as it is now.
  consumer.reset();
  const std::string copy = absl::StrCat(billing_.name(), "_copy");
  pqxx::connection admin(testing::TestServerUrl() + "/postgres");
  {
    pqxx::nontransaction tx(admin);
    tx.exec(absl::StrCat(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
        "datname = ",
        tx.quote(billing_.name())));
    tx.exec(
        absl::StrCat("CREATE DATABASE ", copy, " TEMPLATE ", billing_.name()));
  }
  // Then more orders, applied in the database that will be lost.
  consumer = std::make_unique<Consumer>(billing_.url(), port);
  MakeOrders(15);
  ASSERT_TRUE(WaitFor([&] {
    return inbox_rows(billing_.url()) == Events() && Pending() == 0;
  }));
  consumer.reset();
  // Restored from the backup, on the consumer's address; more orders come.
  const std::string copy_url =
      absl::StrCat(testing::TestServerUrl(), "/", copy);
  ASSERT_LT(inbox_rows(copy_url), Events());
  consumer = std::make_unique<Consumer>(copy_url, port);
  MakeOrders(5);
  ASSERT_TRUE(WaitFor(
      [&] { return inbox_rows(copy_url) == Events() && Pending() == 0; },
      absl::Seconds(30)))
      << inbox_rows(copy_url) << " of " << Events();
  auto report = tools::Check(orders_.url(), copy_url, absl::Seconds(10));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->ok()) << report->Summary();
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM subscriptions WHERE "
                           "healed_at IS NOT NULL AND healed_at >= "
                           "heal_requested_at"),
            1);
  EXPECT_NE(metrics_.Render().find(
                "outbox_relay_consumer_database_changes_total{kind="
                "\"recreated\"} 1"),
            std::string::npos);
  consumer.reset();
  relay.Stop(absl::ZeroDuration());
  pqxx::nontransaction tx(admin);
  tx.exec(absl::StrCat("DROP DATABASE IF EXISTS ", copy, " WITH (FORCE)"));
}

// Without any sign in the identity (the same database lost an aggregate's
// last applied event): the next event of that aggregate is answered HELD,
// though the relay had been answered for its predecessor; the relay owes
// the missing event again at once.
TEST_F(RelayTest, AHeldAnswerBehindAnAnsweredPredecessorOwesItAgain) {
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  const std::string order = CreateOrder();
  Pay(order);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  // The consumer forgets OrderPaid and its charge.
  const int64_t created = orders_.Scalar(absl::StrCat(
      "SELECT min(seq) FROM outbox WHERE aggregate_id = '", order, "'"));
  billing_.Exec(
      absl::StrCat("DELETE FROM charges WHERE order_id = '", order, "'"));
  billing_.Exec(absl::StrCat("DELETE FROM inbox WHERE aggregate_id = '", order,
                             "' AND seq > ", created));
  billing_.Exec(absl::StrCat("UPDATE aggregate_cursors SET last_seq = ",
                             created, " WHERE aggregate_id = '", order, "'"));
  v1::CancelOrderRequest cancel;
  cancel.set_order_id(order);
  ASSERT_TRUE(store_.Cancel(cancel, "").ok());
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }))
      << Applied() << " of " << Events();
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM held_events"), 0);
  // Paid, then refunded: both charges, once each.
  EXPECT_EQ(billing_.Scalar(absl::StrCat(
                "SELECT count(*) FROM charges WHERE order_id = '", order, "'")),
            2);
  EXPECT_NE(metrics_.Render().find(
                "outbox_relay_redelivered_total{reason=\"held\"} 1"),
            std::string::npos)
      << metrics_.Render();
}

// The outbox lost an event the consumer applied (a failover to a standby
// that lacked it), and the aggregate's next event takes another path: the
// consumer answers DIVERGED, the event and its aggregate wait for an
// operator without dead-lettering, verify and reconcile list it, and
// resolving adopts the producer's history, recording what is superseded.
TEST_F(RelayTest,
       ADivergedAggregateWaitsForAnOperatorAndResolvingAdoptsTheOutbox) {
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  const std::string order = CreateOrder();
  const std::string bystander = CreateOrder();
  Pay(order);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  // The new primary lacks OrderPaid: its outbox row, its head, the order's
  // new version.
  const std::string paid_event =
      orders_
          .Query(absl::StrCat(
              "SELECT event_id::text FROM outbox WHERE aggregate_id = '", order,
              "' ORDER BY seq DESC LIMIT 1"))[0][0]
          .as<std::string>();
  orders_.Exec(
      absl::StrCat("DELETE FROM outbox WHERE event_id = '", paid_event, "'"));
  orders_.Exec(absl::StrCat(
      "UPDATE outbox_heads h SET last_seq = o.seq, prev_seq = o.prev_seq "
      "FROM outbox o WHERE o.aggregate_id = h.aggregate_id AND "
      "h.aggregate_id = '",
      order, "'"));
  orders_.Exec(
      absl::StrCat("UPDATE orders SET status = 'CREATED', version = "
                   "1 WHERE order_id = '",
                   order, "'"));
  v1::CancelOrderRequest cancel;
  cancel.set_order_id(order);
  ASSERT_TRUE(store_.Cancel(cancel, "").ok());
  ASSERT_TRUE(WaitFor([&] {
    return orders_.Scalar(
               "SELECT count(*) FROM outbox_delivery WHERE status "
               "= 'diverged'") == 1;
  }));
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_divergences WHERE "
                           "resolved_at IS NULL AND kind = 'chain_broken'"),
            1);
  EXPECT_EQ(orders_.Scalar("SELECT coalesce(max(attempts), 0) FROM "
                           "outbox_delivery"),
            0);
  // Everything else flows.
  Pay(bystander);
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  auto report = tools::Check(orders_.url(), billing_.url(), absl::Seconds(5));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->ok());
  EXPECT_EQ(report->diverged, 1) << report->Summary();
  EXPECT_EQ(report->phantoms, 0) << report->Summary();
  EXPECT_EQ(report->lost, 0) << report->Summary();
  tools::ReconcileOptions ro;
  ro.grace = absl::ZeroDuration();
  auto rec = tools::Reconcile(orders_.url(), billing_.url(), ro);
  ASSERT_TRUE(rec.ok()) << rec.status();
  EXPECT_EQ(rec->open_divergences, 1) << rec->Summary();
  EXPECT_EQ(rec->orphaned, 1) << rec->Summary();  // OrderPaid, applied
  EXPECT_EQ(rec->diverged, 1) << rec->Summary();  // OrderCancelled, parked
  EXPECT_FALSE(rec->ok());

  // The operator adopts the producer's history.
  AdminOnLoopback admin(orders_.url(), &relay);
  v1::RelayAdmin::Stub* stub = admin.stub();
  ASSERT_NE(stub, nullptr);
  {
    grpc::ClientContext ctx;
    v1::ListDivergencesResponse list;
    ASSERT_TRUE(stub->ListDivergences(&ctx, {}, &list).ok());
    ASSERT_EQ(list.divergences_size(), 1);
    EXPECT_EQ(list.divergences(0).aggregate_id(), order);
  }
  {
    grpc::ClientContext ctx;
    v1::ResolveDivergenceRequest req;
    req.set_aggregate_id(order);
    v1::Divergence d;
    EXPECT_EQ(stub->ResolveDivergence(&ctx, req, &d).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);  // no reason given
  }
  grpc::ClientContext ctx;
  v1::ResolveDivergenceRequest req;
  req.set_aggregate_id(order);
  req.set_reason("the payment was lost with the old primary; refund by hand");
  v1::Divergence d;
  ASSERT_TRUE(stub->ResolveDivergence(&ctx, req, &d).ok());
  EXPECT_TRUE(d.has_resolved_at());
  EXPECT_NE(d.resolution().find(paid_event), std::string::npos)
      << d.resolution();
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  EXPECT_EQ(billing_.Scalar(absl::StrCat(
                "SELECT count(*) FROM inbox_superseded WHERE event_id = '",
                paid_event, "' AND reason LIKE 'the payment was lost%'")),
            1);
  report = tools::Check(orders_.url(), billing_.url(), absl::Seconds(10));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->ok()) << report->Summary();
  EXPECT_EQ(report->superseded, 1);
  // The consumer's view follows the producer: cancelled.
  EXPECT_EQ(billing_
                .Query(absl::StrCat(
                    "SELECT status FROM order_view WHERE order_id = '", order,
                    "'"))[0][0]
                .as<std::string>(),
            "CANCELLED");
  grpc::ClientContext again;
  EXPECT_EQ(stub->ResolveDivergence(&again, req, &d).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

// A heal also looks from the consumer back: an applied event the outbox
// no longer holds is recorded as a divergence even when no later event of
// its aggregate comes to show it.
TEST_F(RelayTest, AHealFindsAppliedEventsTheOutboxLost) {
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  const std::string order = CreateOrder();
  Pay(order);
  MakeOrders(5);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  orders_.Exec(absl::StrCat(
      "DELETE FROM outbox WHERE seq = (SELECT max(seq) FROM outbox WHERE "
      "aggregate_id = '",
      order, "')"));
  HealNow();
  EXPECT_EQ(orders_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox_divergences WHERE kind = "
                "'consumer_ahead' AND aggregate_id = '",
                order, "'")),
            1);
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_divergences"), 1);
}

// A failover or a restore loses hundreds of applied events at once: the
// heal records every aggregate, over several pages of the consumer's
// cursors, and none twice when it runs again.
TEST_F(RelayTest, AHealRecordsEveryAggregateThatLostAppliedEvents) {
  Consumer consumer(billing_.url(), 0);
  std::string source;
  {
    Relay relay(Options(consumer.port()), &metrics_);
    relay.Start();
    MakeOrders(230);
    ASSERT_TRUE(WaitFor(
        [&] { return Applied() == Events() && Pending() == 0; },
        absl::Seconds(60)));
    source = relay.source();
  }
  // The last event of about every other order goes, as with a failover's
  // lost commits.
  const int64_t before = Events();
  orders_.Exec(
      "DELETE FROM outbox o USING outbox_heads h WHERE o.seq = h.last_seq "
      "AND h.last_seq % 2 = 0");
  const int64_t lost = before - Events();
  // Pages of 30 cursors and heads: several of each, the last one not full
  // (230 aggregates).
  constexpr int kPage = 30;
  ASSERT_GT(lost, kPage);
  auto stub = v1::EventSink::NewStub(testing::Loopback(consumer.port()));
  Healer healer("billing", stub.get(), absl::Seconds(15), kPage);
  pqxx::connection conn(orders_.url());
  for (int run = 1; run <= 2; ++run) {  // the second finds what is recorded
    absl::StatusOr<HealReport> report = healer.Run(conn, source);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->consumer_aggregates, 230) << report->Summary();
    EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_divergences WHERE "
                             "kind = 'consumer_ahead' AND consumer_seq % 2 = 0"),
              lost);
    EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_divergences"), lost);
  }
}

// Until a due heal ran, what the consumer lost is not owed again and not
// every divergence is recorded: verify is not drained and reconcile not
// complete, and both say why; once a relay ran it, both are clean.
TEST_F(RelayTest, VerifyAndReconcileSayAHealIsDue) {
  Consumer consumer(billing_.url(), 0);
  {
    Relay relay(Options(consumer.port()), &metrics_);
    relay.Start();
    MakeOrders(5);
    ASSERT_TRUE(
        WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  }
  orders_.Exec(
      "UPDATE subscriptions SET heal_requested_at = now(), heal_reason = "
      "'the consumer database changed'");
  auto report =
      tools::Check(orders_.url(), billing_.url(), absl::Milliseconds(300));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->drained);
  EXPECT_FALSE(report->ok());
  EXPECT_TRUE(absl::StrContains(report->heal_due,
                                "the consumer database changed"))
      << report->Summary();
  EXPECT_TRUE(absl::StrContains(report->Summary(), "a heal is due"));
  EXPECT_TRUE(absl::StrContains(report->Json(), "\"heal_due\":\"the "));
  tools::ReconcileOptions ro;
  ro.grace = absl::ZeroDuration();
  auto rec = tools::Reconcile(orders_.url(), billing_.url(), ro);
  ASSERT_TRUE(rec.ok()) << rec.status();
  EXPECT_EQ(rec->listed(), 0) << rec->Summary();
  EXPECT_FALSE(rec->ok());
  EXPECT_TRUE(absl::StrContains(rec->Summary(), "RESULT: INCOMPLETE"))
      << rec->Summary();

  // verify --wait waits for it.
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  report = tools::Check(orders_.url(), billing_.url(), absl::Seconds(30));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->ok()) << report->Summary();
  EXPECT_EQ(report->heal_due, "");
  rec = tools::Reconcile(orders_.url(), billing_.url(), ro);
  ASSERT_TRUE(rec.ok()) << rec.status();
  EXPECT_TRUE(rec->ok()) << rec->Summary();
}

// Divergences recorded in one statement: each chain gets one open record
// (the first given), and one open already stays as it was.
TEST_F(RelayTest, DivergencesRecordedTogetherKeepOneOpenPerChain) {
  pqxx::connection conn(orders_.url());
  pqxx::work tx(conn);
  NewDivergence open = NewDivergence::Of("billing", OutboxChain("order", "c"));
  open.kind = "chain_broken";
  open.detail = "open already";
  ASSERT_TRUE(RecordDivergence(tx, open));
  std::vector<NewDivergence> ds;
  for (const char* id : {"a", "b", "a", "c"}) {
    NewDivergence d = NewDivergence::Of("billing", OutboxChain("order", id));
    d.kind = "consumer_ahead";
    d.detail = absl::StrCat("of ", id, " \"quoted\" \\ ", ds.size());
    d.consumer_seq = 7 + static_cast<int64_t>(ds.size());
    d.consumer_event_id =
        ds.empty() ? "01a24bdc-cc49-73c8-ac93-f3e9e9691cd7" : "";
    ds.push_back(std::move(d));
  }
  EXPECT_EQ(RecordDivergences(tx, ds),
            (std::vector<bool>{true, true, false, false}));
  EXPECT_EQ(RecordDivergences(tx, {}), std::vector<bool>{});
  tx.commit();
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_divergences"), 3);
  EXPECT_EQ(orders_.Scalar("SELECT consumer_seq FROM outbox_divergences "
                           "WHERE aggregate_id = 'a'"),
            7);
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_divergences WHERE "
                           "aggregate_id = 'a' AND detail = 'of a \"quoted\" "
                           "\\ 0' AND consumer_event_id = "
                           "'01a24bdc-cc49-73c8-ac93-f3e9e9691cd7' AND "
                           "outbox_seq IS NULL AND aggregate_type = 'order'"),
            1);
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_divergences WHERE "
                           "aggregate_id = 'c' AND kind = 'chain_broken'"),
            1);
}

// After a failover the new primary hands out a lost event's seq again, and
// retention may delete what lies below: the lost event's seq then lies
// below every row the outbox holds. Yet retention never deleted it, and
// the heal lists its aggregate. (Taking the lowest row left for how far
// retention went, the heal took it for deleted by retention.)
TEST_F(RelayTest, AHealFindsALostEventBelowTheRowsLeftAboveWhatRetentionDeleted) {
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  const std::string order = CreateOrder();
  Pay(order);
  MakeOrders(3);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  const LostPayment lost = LosePaymentAfterRetention(order);
  ASSERT_LT(lost.paid, orders_.Scalar("SELECT min(seq) FROM outbox"));
  HealNow();
  EXPECT_EQ(orders_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox_divergences WHERE kind = "
                "'consumer_ahead' AND consumer_seq = ",
                lost.paid, " AND aggregate_id = '", order, "'")),
            1);
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_divergences"), 1);
}

// Retention deleted an order's OrderCreated after it was delivered, then a
// failover lost its OrderPaid: resolving keeps the OrderCreated the
// consumer applied (the producer's history, though no longer retained)
// and supersedes only the payment. (The resolve kept only retained events
// and rewound the order to nothing: its view gone, CREATED in orders.)
TEST_F(RelayTest, AResolveKeepsWhatRetentionDeletedOfTheChain) {
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  const std::string order = CreateOrder();
  Pay(order);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  const LostPayment lost = LosePaymentAfterRetention(order);
  HealNow();
  ASSERT_EQ(orders_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox_divergences WHERE kind = "
                "'consumer_ahead' AND resolved_at IS NULL AND aggregate_id = '",
                order, "'")),
            1);
  AdminOnLoopback admin(orders_.url(), &relay);
  ASSERT_NE(admin.stub(), nullptr);
  grpc::ClientContext ctx;
  v1::ResolveDivergenceRequest req;
  req.set_aggregate_id(order);
  req.set_reason("the payment was lost with the old primary");
  v1::Divergence d;
  ASSERT_TRUE(admin.stub()->ResolveDivergence(&ctx, req, &d).ok());
  EXPECT_NE(
      d.resolution().find(absl::StrCat("from seq ", lost.created, ";")),
      std::string::npos)
      << d.resolution();
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM inbox_superseded"), 1);
  EXPECT_EQ(billing_.Scalar(absl::StrCat(
                "SELECT count(*) FROM inbox_superseded WHERE event_id = '",
                lost.paid_event, "'")),
            1);
  EXPECT_EQ(billing_
                .Query(absl::StrCat(
                    "SELECT status FROM order_view WHERE order_id = '", order,
                    "'"))[0][0]
                .as<std::string>(),
            "CREATED");
}

// Retention may leave the outbox empty: every applied event then lies
// below what it retains, none was lost. (The heal took the empty outbox's
// lowest retained seq for 0 and recorded every aggregate as ahead.)
TEST_F(RelayTest, AHealAfterRetentionEmptiedTheOutboxFindsNothingLost) {
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  MakeOrders(5);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  // As retention would, all delivered.
  orders_.Exec(
      "UPDATE outbox_retention_state SET deleted_through = (SELECT max(seq) "
      "FROM outbox); DELETE FROM outbox");
  HealNow();
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_divergences"), 0);
}

// A failover of the outbox database while the relay was down shows in the
// identity the database recorded: the relay reports it (the word
// "failover" and both timelines), counts it, and heals.
TEST_F(RelayTest, AnOutboxDatabaseThatChangedUnderTheRelayIsHealed) {
  MakeOrders(5);
  Consumer consumer(billing_.url(), 0);
  {
    Relay relay(Options(consumer.port()), &metrics_);
    relay.Start();
    ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  }
  const std::string recorded =
      orders_.Query("SELECT identity FROM outbox_database_identity")[0][0]
          .as<std::string>();
  const auto id = DatabaseIdentity::FromKey(recorded);
  ASSERT_TRUE(id.has_value()) << recorded;
  // As a standby would have recorded it before its promotion.
  DatabaseIdentity before = *id;
  before.timeline = id->timeline + 41;
  orders_.Exec(absl::StrCat("UPDATE outbox_database_identity SET identity = '",
                            before.Key(), "'"));
  Metrics metrics;
  Relay relay(Options(consumer.port()), &metrics);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] {
    return orders_.Scalar(
               "SELECT count(*) FROM subscriptions WHERE "
               "healed_at IS NOT NULL AND healed_at >= "
               "heal_requested_at") == 1;
  }));
  EXPECT_NE(metrics.Render().find("outbox_database_failovers_total{database="
                                  "\"outbox\",kind=\"failover\"} 1"),
            std::string::npos)
      << metrics.Render();
  EXPECT_EQ(orders_.Query("SELECT identity FROM outbox_database_identity")[0][0]
                .as<std::string>(),
            recorded);
}

// A replay owes retained events again; the consumer answers DUPLICATE, so
// no effect happens twice.
TEST_F(RelayTest, AReplayOwesEventsAgainAndNothingHappensTwice) {
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  std::vector<std::string> orders = MakeOrders(6);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Pending() == 0; }));
  const int64_t charges = billing_.Scalar("SELECT count(*) FROM charges");
  pqxx::connection conn(orders_.url());
  for (int mode = 0; mode < 3; ++mode) {
    pqxx::work tx(conn);
    ReplaySelector sel;
    if (mode == 0) sel.aggregate_id = orders[0];
    if (mode == 1) {
      sel.by_seq = true;
      sel.from_seq = 1;
    }
    if (mode == 2) {
      sel.by_time = true;
      sel.since = absl::Now() - absl::Hours(1);
    }
    Replayed r = Replay(tx, "billing", sel);
    tx.commit();
    EXPECT_GT(r.matched, 0) << mode;
    EXPECT_EQ(r.owed, r.matched) << mode;
    ASSERT_TRUE(WaitFor([&] { return Pending() == 0; })) << mode;
  }
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM charges"), charges);
  ExpectExactlyOnceInOrder();
}

// A relay that reaches its database but not its consumer reports itself
// unready, and leaves its partitions to a replica that reaches the
// consumer, which then delivers everything; once its consumer answers, it
// is ready again and takes its share back.
TEST_F(RelayTest,
       ARelayThatCannotReachItsConsumerLeavesItsPartitionsToOneThatCan) {
  ClosingListener down;  // relay a's consumer, down for now
  Consumer up(billing_.url(), 0);
  RelayOptions oa = Options(down.port()), ob = Options(up.port());
  oa.consumer_unready_after = ob.consumer_unready_after = absl::Seconds(2);
  Relay a(oa, &metrics_), b(ob, &metrics_);
  a.Start();
  b.Start();
  MakeOrders(40);
  ASSERT_TRUE(WaitFor([&] {
    return a.Unready().has_value() && a.State().partitions_owned.empty() &&
           b.State().partitions_owned.size() == kPartitionCount &&
           Pending() == 0;
  })) << "a owns "
      << a.State().partitions_owned.size() << ", b owns "
      << b.State().partitions_owned.size() << ", pending " << Pending();
  EXPECT_NE(a.Unready()->find("has not answered"), std::string::npos)
      << *a.Unready();
  EXPECT_NE(a.State().consumer_unreachable.find(oa.consumer), std::string::npos)
      << a.State().consumer_unreachable;
  EXPECT_FALSE(b.Unready().has_value()) << *b.Unready();
  // Its consumer comes up: a is ready again and takes a share.
  down.Close();
  Consumer back(billing_.url(), down.port());
  ASSERT_TRUE(WaitFor([&] {
    return !a.Unready().has_value() && !a.State().partitions_owned.empty() &&
           b.State().partitions_owned.size() < kPartitionCount;
  })) << "a owns "
      << a.State().partitions_owned.size();
  MakeOrders(40);
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  a.Stop(absl::Seconds(2));
  b.Stop(absl::Seconds(2));
}

// Appends to every stored event an unknown field of `bytes` bytes (field
// 1000, length-delimited; `length_hex` is `bytes` as a varint, in hex),
// which a consumer ignores: large events.
std::string EnlargeEventsSql(const char* length_hex, int bytes) {
  return absl::StrCat("UPDATE outbox SET payload = payload || '\\xc23e",
                      length_hex, "'::bytea || convert_to(repeat('x', ", bytes,
                      "), 'UTF8')");
}

// A claim stops at kMaxDeliveryBatchBytes of payloads, whatever the batch
// size: a backlog of large events is read a few at a time, not a batch of
// full payloads that the relay would only cut after reading them.
TEST_F(RelayTest, AClaimReadsAboutABatchOfPayloadBytesAtMost) {
  MakeOrders(12);
  orders_.Exec(EnlargeEventsSql("80c025", 614400));  // 600 KiB each
  Consumer consumer(billing_.url(), 0);
  RelayOptions o = Options(consumer.port());
  o.batch_size = 16;
  std::atomic<size_t> most{0};
  o.after_claim = [&](size_t rows) {
    if (rows > most) most = rows;
  };
  Relay relay(o, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  relay.Stop(absl::Seconds(2));
  // The first row always comes; the second (600 KiB before it) too; a
  // third would have 1.2 MiB before it.
  EXPECT_GE(most.load(), 1u);
  EXPECT_LE(most.load(), 2u);
  ExpectExactlyOnceInOrder();
}

// A listing of dead letters carries about kMaxListingPayloadBytes of
// payloads at most, whatever its limit, says when more match, and pages on
// from the last seq it returned.
TEST_F(RelayTest, ADeadLetterListingIsBoundedBySizeAndPages) {
  MakeOrders(5);
  const int64_t events = Events();
  orders_.Exec(EnlargeEventsSql("80e012", 307200));  // 300 KiB each
  orders_.Exec(
      "UPDATE outbox_delivery SET status = 'dead', dead_at = now(), "
      "attempts = 3");
  Relay relay(Options(1), &metrics_);  // not started: the admin API reads
  AdminOnLoopback admin(orders_.url(), &relay);
  v1::RelayAdmin::Stub* stub = admin.stub();
  ASSERT_NE(stub, nullptr);
  std::vector<int64_t> seen;
  int64_t after = 0;
  int pages = 0;
  for (;;) {
    grpc::ClientContext ctx;
    v1::ListDeadLettersRequest req;
    req.set_limit(1000);
    req.set_after_seq(after);
    v1::ListDeadLettersResponse list;
    grpc::Status st = stub->ListDeadLetters(&ctx, req, &list);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_LT(++pages, 100);
    // 300 KiB each: the second has 300 KiB before it, a third 600.
    EXPECT_LE(list.rows_size(), 2);
    EXPECT_GE(list.rows_size(), 1);
    for (const auto& row : list.rows()) {
      EXPECT_GT(row.event().seq(), after);
      EXPECT_EQ(row.status(), "dead");
      seen.push_back(row.event().seq());
    }
    if (!list.more()) break;
    after = seen.back();
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), events);
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), seen.size());
  // A small limit is a limit, and says that more match.
  grpc::ClientContext ctx;
  v1::ListDeadLettersRequest req;
  req.set_limit(1);
  v1::ListDeadLettersResponse list;
  ASSERT_TRUE(stub->ListDeadLetters(&ctx, req, &list).ok());
  EXPECT_EQ(list.rows_size(), 1);
  EXPECT_TRUE(list.more());
}

// Subscriptions as an operator sees and moves them: the listing names what
// pins retention; a pause stops claims until resumed; a drop is refused
// while relays deliver it, and a dropped subscription is not made again
// by a relay without --resubscribe.
TEST_F(RelayTest, SubscriptionsAreListedPausedResumedAndDropped) {
  Consumer consumer(billing_.url(), 0);
  RelayOptions options = Options(consumer.port());
  options.retention = absl::Hours(24);
  options.backlog_refresh = absl::Milliseconds(100);
  Relay relay(options, &metrics_);
  relay.Start();
  AdminOnLoopback admin(orders_.url(), &relay);
  v1::RelayAdmin::Stub* stub = admin.stub();
  ASSERT_NE(stub, nullptr);
  const auto act = [&](const char* what, const std::string& sub,
                       const std::string& reason, bool force = false) {
    grpc::ClientContext ctx;
    v1::SubscriptionActionRequest req;
    req.set_subscription(sub);
    req.set_reason(reason);
    req.set_force(force);
    v1::Subscription info;
    v1::DropSubscriptionResponse dropped;
    const std::string w = what;
    return w == "pause"    ? stub->PauseSubscription(&ctx, req, &info)
           : w == "resume" ? stub->ResumeSubscription(&ctx, req, &info)
                           : stub->DropSubscription(&ctx, req, &dropped);
  };
  const auto list = [&] {
    grpc::ClientContext ctx;
    v1::ListSubscriptionsResponse resp;
    EXPECT_TRUE(stub->ListSubscriptions(&ctx, {}, &resp).ok());
    std::map<std::string, v1::Subscription> out;
    for (const auto& s : resp.subscriptions()) out[s.name()] = s;
    return out;
  };

  // An abandoned subscription (no relay) with an old dead letter pins
  // retention, and says so.
  orders_.Exec("INSERT INTO subscriptions (name) VALUES ('audit')");
  MakeOrders(4);
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  orders_.Exec(
      "UPDATE outbox SET created_at = now() - interval '3 days'; "
      "UPDATE outbox_delivery SET status = 'dead', dead_at = now() WHERE "
      "subscription = 'audit' AND seq = (SELECT min(seq) FROM outbox)");
  auto subs = list();
  ASSERT_EQ(subs.size(), 2u);
  EXPECT_EQ(subs["billing"].pending(), 0);
  EXPECT_EQ(subs["billing"].relays_alive(), 1);
  EXPECT_EQ(subs["billing"].retention_pinned_seconds(), 0);
  EXPECT_EQ(subs["audit"].relays_alive(), 0);
  EXPECT_EQ(subs["audit"].dead_letters(), 1);
  EXPECT_EQ(subs["audit"].pinned_by(), "abandoned");
  EXPECT_GT(subs["audit"].retention_pinned_seconds(), 47 * 3600.0);
  EXPECT_NE(subs["audit"].pins().find("no relay delivers"), std::string::npos)
      << subs["audit"].pins();
  // ... and the gauges of every relay say it too.
  EXPECT_TRUE(WaitFor([&] {
    const std::string m = metrics_.Render();
    return m.find(
               "outbox_retention_pinned_seconds{kind=\"abandoned\","
               "of_subscription=\"audit\"} 1728") != std::string::npos &&
           m.find(
               "outbox_subscription_relays_alive{of_subscription="
               "\"audit\"} 0") != std::string::npos;
  })) << metrics_.Render();

  // Actions need a name and a reason, and name what they refuse.
  EXPECT_EQ(act("pause", "", "x").error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(act("pause", "billing", "").error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(act("pause", "nope", "x").error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(act("resume", "billing", "x").error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  // Paused: nothing new is delivered; resumed: it all is.
  ASSERT_TRUE(act("pause", "billing", "consumer migration").ok());
  EXPECT_EQ(act("pause", "billing", "again").error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(WaitFor([&] {
    return relay.State().paused_reason.find("consumer migration") !=
           std::string::npos;
  }));
  const int64_t applied = Applied();
  MakeOrders(3);
  WaitForRelayPasses(relay, 5);
  EXPECT_EQ(Applied(), applied);
  EXPECT_GT(Pending(), 0);
  EXPECT_TRUE(list()["billing"].paused());
  ASSERT_TRUE(act("resume", "billing", "migration done").ok());
  ASSERT_TRUE(WaitFor([&] { return Pending() == 0; }));
  EXPECT_EQ(Applied(), Events());

  // A drop while relays deliver it is refused unless forced.
  const grpc::Status busy = act("drop", "billing", "gone");
  EXPECT_EQ(busy.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(busy.error_message().find("1 relay(s)"), std::string::npos)
      << busy.error_message();
  // The abandoned one goes: its deliveries with it, so retention moves.
  ASSERT_TRUE(act("drop", "audit", "audit service retired").ok());
  EXPECT_EQ(Pending("audit"), 0);
  EXPECT_EQ(list().count("audit"), 0u);
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM subscription_actions WHERE "
                           "subscription = 'audit' AND action = 'drop' AND "
                           "reason = 'audit service retired'"),
            1);
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM subscription_actions"), 3);

  // A relay of the dropped subscription does not make it again...
  RelayOptions audit_options = options;
  audit_options.subscription = "audit";
  Metrics audit_metrics(Labels{{"subscription", "audit"}});
  {
    Relay audit_relay(audit_options, &audit_metrics);
    audit_relay.Start();
    WaitForRelayPasses(relay, 3);
    absl::SleepFor(absl::Milliseconds(300));
    EXPECT_EQ(list().count("audit"), 0u);
    audit_relay.Stop(absl::ZeroDuration());
  }
  // ... unless told to, which is recorded.
  audit_options.resubscribe = true;
  Relay audit_relay(audit_options, &audit_metrics);
  audit_relay.Start();
  EXPECT_TRUE(WaitFor([&] { return list().count("audit") == 1; }));
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM subscription_actions WHERE "
                           "subscription = 'audit' AND action = "
                           "'resubscribe'"),
            1);
}

// The same relay delivering a subscription from the outbox log: one event
// row serves it, and its exceptions (rejections, dead letters, the events
// behind them) are rows as before.
class LogRelayTest : public RelayTest {
 protected:
  LogRelayTest() { orders_.Exec("SELECT outbox_log_subscribe('billing')"); }

  RelayOptions Options(int consumer_port) {
    RelayOptions o = RelayTest::Options(consumer_port);
    o.log_delivery = true;
    return o;
  }
  // Events the subscription is still owed: from the log, or as rows.
  int64_t Owed() {
    return orders_.Scalar(
        "SELECT count(*) FROM outbox o WHERE outbox_log_owed('billing', "
        "o.seq, o.xid, o.partition) OR EXISTS (SELECT 1 FROM "
        "outbox_delivery d WHERE d.subscription = 'billing' AND d.seq = "
        "o.seq)");
  }
  int64_t Rows() {
    return orders_.Scalar(
        "SELECT count(*) FROM outbox_delivery WHERE subscription = 'billing'");
  }
};

TEST_F(LogRelayTest, DeliversEveryEventOnceInOrderWithoutARowPerEvent) {
  MakeOrders(60);
  EXPECT_EQ(Rows(), 0);  // the producer's transactions wrote none
  EXPECT_EQ(Owed(), Events());
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events(); }))
      << Applied() << " of " << Events();
  ASSERT_TRUE(WaitFor([&] { return Owed() == 0; })) << Owed();
  MakeOrders(20);  // while it runs: woken by the producer's NOTIFY
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Owed() == 0; }))
      << Applied() << " of " << Events();
  ExpectExactlyOnceInOrder();
  EXPECT_EQ(Rows(), 0);
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_log_positions"),
            kPartitionCount);
}

// A backlog of many batches over both streams drains without a poll: an
// answered event from the log is settled before the next read, so the
// streams can split its group of partitions and read on. (Settled only by
// the marks written after the reads, each batch waited for the next
// poll_interval: 5,000 events took 10 s with the default 500 ms.)
TEST_F(LogRelayTest, ABacklogOfManyBatchesDrainsWithoutWaitingForAPoll) {
  MakeOrders(40);  // 75 events: batches of 16 over 2 streams
  Consumer consumer(billing_.url(), 0);
  RelayOptions o = Options(consumer.port());
  o.poll_interval = absl::Hours(1);
  o.rebalance_interval = absl::Hours(1);
  Relay relay(o, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events(); }))
      << Applied() << " of " << Events();
  ExpectExactlyOnceInOrder();
}

TEST_F(LogRelayTest, ARelayStoppedMidFlightLosesNothing) {
  MakeOrders(40);
  Consumer consumer(billing_.url(), 0);
  for (int round = 0; round < 3; ++round) {
    Relay relay(Options(consumer.port()), &metrics_);
    relay.Start();
    const int64_t before = Applied();
    ASSERT_TRUE(WaitFor([&] { return Applied() > before; }));
    relay.Stop(absl::ZeroDuration());  // in flight: read again
    MakeOrders(20);
  }
  // What the log still owes is pending to the checker, not lost.
  auto report = tools::Check(orders_.url(), billing_.url(), absl::Seconds(1));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->drained) << report->Summary();
  EXPECT_EQ(report->lost, 0);
  EXPECT_EQ(report->pending, Events() - Applied());
  Relay last(Options(consumer.port()), &metrics_);
  last.Start();
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Owed() == 0; }))
      << Applied() << " of " << Events();
  ExpectExactlyOnceInOrder();
  report = tools::Check(orders_.url(), billing_.url(), absl::Seconds(10));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->ok() && report->drained) << report->Summary();
}

TEST_F(LogRelayTest, APoisonEventIsAnExceptionAndOnlyItsChainWaits) {
  std::vector<std::string> ids = MakeOrders(6);  // order 0: three events
  const std::string poison = ids[0];
  Poison(poison);
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  ASSERT_NO_FATAL_FAILURE(ExpectPoisonDead(poison));
  // Its successors wait at the relay, as exceptions behind it; the log's
  // positions passed every event.
  EXPECT_EQ(
      orders_.Scalar(absl::StrCat(
          "SELECT count(*) FROM outbox_delivery WHERE status = 'pending' AND "
          "aggregate_id = '",
          poison, "'")),
      2);
  EXPECT_EQ(Rows(), 3);
  EXPECT_EQ(billing_.Scalar("SELECT count(*) FROM held_events"), 0);
  // New events flow past it from the log.
  CreateOrders(3);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() - 3; }));
  EXPECT_EQ(Rows(), 3);
  orders_.Exec("UPDATE outbox SET schema_version = 1");
  orders_.Exec(
      "UPDATE outbox_delivery SET status = 'pending', available_at = now(), "
      "attempts = 0, dead_at = NULL");
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Owed() == 0; }));
  ExpectExactlyOnceInOrder();
  EXPECT_EQ(Rows(), 0);
}

TEST_F(LogRelayTest, TwoRelaysSplitTheLogAndOneTakesOverWhenTheOtherStops) {
  Consumer consumer(billing_.url(), 0);
  Metrics m2;
  Relay a(Options(consumer.port()), &metrics_);
  a.Start();
  ASSERT_TRUE(WaitFor(
      [&] { return a.State().partitions_owned.size() == kPartitionCount; }));
  auto b = std::make_unique<Relay>(Options(consumer.port()), &m2);
  b->Start();
  ASSERT_TRUE(WaitFor([&] {
    return a.State().partitions_owned.size() == kPartitionCount / 2 &&
           b->State().partitions_owned.size() == kPartitionCount / 2;
  }));
  MakeOrders(30);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Owed() == 0; }));
  MakeOrders(30);
  b.reset();  // stops, maybe mid-flight
  ASSERT_TRUE(WaitFor(
      [&] { return a.State().partitions_owned.size() == kPartitionCount; }));
  MakeOrders(30);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Owed() == 0; }))
      << Applied() << " of " << Events();
  ExpectExactlyOnceInOrder();
  EXPECT_EQ(Rows(), 0);
}

TEST_F(LogRelayTest, AConsumerOutageCostsTimeNotAttempts) {
  ClosingListener down;
  const int port = down.port();
  MakeOrders(10);
  Relay relay(Options(port), &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return down.accepted() >= 3; }))
      << down.accepted() << " connection attempts";
  down.Close();
  EXPECT_EQ(Owed(), Events());
  Consumer consumer(billing_.url(), port);
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Owed() == 0; }));
  ExpectExactlyOnceInOrder();
  EXPECT_EQ(orders_.Scalar(
                "SELECT count(*) FROM outbox_delivery WHERE attempts > 0 OR "
                "status = 'dead'"),
            0);
}

// The backlog figures count what the log owes, and how old it is.
TEST_F(LogRelayTest, TheBacklogFiguresCountWhatTheLogOwes) {
  ClosingListener down;
  MakeOrders(10);  // 19 events
  orders_.Exec("UPDATE outbox SET created_at = now() - interval '1 hour'");
  RelayOptions o = Options(down.port());
  o.backlog_refresh = absl::Milliseconds(200);
  Relay relay(o, &metrics_);
  relay.Start();
  // One gauge per owned partition.
  const auto pending = [&] {
    return static_cast<int64_t>(
        testing::SumOf(metrics_, "outbox_relay_pending_events"));
  };
  ASSERT_TRUE(WaitFor([&] { return pending() == Events(); })) << pending();
  EXPECT_GE(MaxOf(metrics_, "outbox_relay_oldest_pending_seconds"), 3500);
}

// The admin's figures count what the log owes as pending, not delivered:
// GetStats and the subscriptions' list, before and after the drain.
TEST_F(LogRelayTest, TheAdminCountsWhatTheLogOwesAsPending) {
  MakeOrders(10);  // 19 events
  orders_.Exec("UPDATE outbox SET created_at = now() - interval '1 hour'");
  // Paused until the figures are read: nothing is delivered yet.
  orders_.Exec(
      "UPDATE subscriptions SET paused_at = now(), paused_by = 'test', "
      "paused_reason = 'figures first'");
  Consumer consumer(billing_.url(), 0);
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  AdminOnLoopback admin(orders_.url(), &relay);
  v1::RelayAdmin::Stub* stub = admin.stub();
  ASSERT_NE(stub, nullptr);
  const auto stats = [&] {
    grpc::ClientContext ctx;
    v1::RelayStats out;
    EXPECT_TRUE(stub->GetStats(&ctx, {}, &out).ok());
    return out;
  };
  const auto listed = [&] {
    grpc::ClientContext ctx;
    v1::ListSubscriptionsResponse resp;
    EXPECT_TRUE(stub->ListSubscriptions(&ctx, {}, &resp).ok());
    EXPECT_EQ(resp.subscriptions_size(), 1);
    return resp.subscriptions_size() > 0 ? resp.subscriptions(0)
                                         : v1::Subscription{};
  };
  EXPECT_EQ(Rows(), 0);
  v1::RelayStats owed = stats();
  EXPECT_EQ(owed.pending(), Events());
  EXPECT_EQ(owed.delivered_total(), 0);
  EXPECT_GE(owed.oldest_pending_seconds(), 3500);
  v1::Subscription sub = listed();
  EXPECT_EQ(sub.pending(), Events());
  EXPECT_GE(sub.oldest_pending_seconds(), 3500);
  EXPECT_EQ(sub.lowest_undelivered_seq(),
            orders_.Scalar("SELECT min(seq) FROM outbox"));
  EXPECT_EQ(sub.lowest_undelivered_status(), "pending");

  orders_.Exec(
      "UPDATE subscriptions SET paused_at = NULL, paused_by = NULL, "
      "paused_reason = NULL");
  ASSERT_TRUE(WaitFor([&] { return Owed() == 0; })) << Owed();
  v1::RelayStats done = stats();
  EXPECT_EQ(done.pending(), 0);
  EXPECT_EQ(done.delivered_total(), Events());
  EXPECT_EQ(listed().pending(), 0);
  EXPECT_EQ(listed().lowest_undelivered_seq(), 0);
}

// Dropping a subscription on the log says what the log owed it and takes
// its positions along.
TEST_F(LogRelayTest, ADropTakesThePositionsAndCountsWhatTheLogOwed) {
  MakeOrders(10);  // 19 events
  {
    Consumer consumer(billing_.url(), 0);
    Relay relay(Options(consumer.port()), &metrics_);
    relay.Start();
    ASSERT_TRUE(WaitFor([&] { return Owed() == 0; })) << Owed();
  }
  MakeOrders(2);  // owed by the log
  const int64_t owed = Owed();
  ASSERT_GT(owed, 0);
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_log_positions"),
            kPartitionCount);
  pqxx::connection conn(orders_.url());
  pqxx::work tx(conn);
  ASSERT_TRUE(ActOnSubscription(tx, "billing", SubscriptionAction::kDrop,
                                "test", "moving on", true)
                  .ok());
  tx.commit();
  EXPECT_EQ(orders_.Scalar("SELECT count(*) FROM outbox_log_positions"), 0);
  EXPECT_EQ(orders_.Scalar(absl::StrCat(
                "SELECT count(*) FROM subscription_actions WHERE detail LIKE "
                "'owed then: ",
                owed, " pending,%'")),
            1);
}

// Retention deletes what the log delivered, and nothing it still owes.
// A heal of a subscription on the log (after a restore or a failover)
// owes again what the consumer lost of what the log had delivered, and
// nothing that the log still owes: that was never delivered, and owing it
// again as rows would send a whole backlog twice.
TEST_F(LogRelayTest, AHealOwesAgainOnlyWhatTheLogHadDelivered) {
  const std::vector<std::string> delivered = MakeOrders(6);
  Consumer consumer(billing_.url(), 0);
  std::string source;
  {
    Relay relay(Options(consumer.port()), &metrics_);
    relay.Start();
    ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Owed() == 0; }))
        << Applied() << " of " << Events();
    source = relay.source();
    relay.Stop(absl::Seconds(5));
  }
  const int64_t before = Events();
  MakeOrders(6);  // owed by the log; no relay runs
  ASSERT_EQ(Owed(), Events() - before);
  ASSERT_EQ(Rows(), 0);
  // The consumer's database loses one delivered order altogether.
  const std::string lost = delivered[0];
  const int64_t lost_events = orders_.Scalar(absl::StrCat(
      "SELECT count(*) FROM outbox WHERE aggregate_id = '", lost, "'"));
  ASSERT_GT(lost_events, 0);
  for (const char* table : {"inbox", "aggregate_cursors"}) {
    billing_.Exec(absl::StrCat("DELETE FROM ", table,
                               " WHERE aggregate_id = '", lost, "'"));
  }
  billing_.Exec(
      absl::StrCat("DELETE FROM charges WHERE order_id = '", lost, "'"));

  auto stub = v1::EventSink::NewStub(testing::Loopback(consumer.port()));
  Healer healer("billing", stub.get());
  pqxx::connection conn(orders_.url());
  absl::StatusOr<HealReport> report = healer.Run(conn, source);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->redelivered, lost_events) << report->Summary();
  EXPECT_EQ(report->redelivered_aggregates, 1) << report->Summary();
  EXPECT_EQ(report->diverged, 0) << report->Summary();
  EXPECT_EQ(Rows(), lost_events);
  EXPECT_EQ(Owed(), Events() - before + lost_events);

  // A relay then delivers both, each event once and in order.
  Relay relay(Options(consumer.port()), &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Applied() == Events() && Owed() == 0; }))
      << Applied() << " of " << Events();
  ExpectExactlyOnceInOrder();
  relay.Stop(absl::Seconds(5));
}

TEST_F(LogRelayTest, RetentionWaitsForTheLogsPositions) {
  MakeOrders(10);
  orders_.Exec("UPDATE outbox SET created_at = now() - interval '2 days'");
  Consumer consumer(billing_.url(), 0);
  {
    // Not delivered: retention keeps it all (the relay's consumer is down).
    ClosingListener down;
    RelayOptions o = Options(down.port());
    o.retention = absl::Hours(1);
    Relay relay(o, &metrics_);
    relay.Start();
    ASSERT_TRUE(WaitFor([&] { return down.accepted() >= 2; }));
    // Housekeeping (retention among it) runs every second: its chance.
    absl::SleepFor(absl::Milliseconds(2500));
    EXPECT_EQ(Events(), 10 + 5 + 4);
  }
  {
    Relay relay(Options(consumer.port()), &metrics_);
    relay.Start();
    ASSERT_TRUE(WaitFor([&] { return Owed() == 0; })) << Owed();
  }
  RelayOptions o = Options(consumer.port());
  o.retention = absl::Hours(1);
  Relay relay(o, &metrics_);
  relay.Start();
  ASSERT_TRUE(WaitFor([&] { return Events() == 0; })) << Events();
  EXPECT_EQ(Applied(), 10 + 5 + 4);
}

// A subscription with rows pending moves onto the log while the producer
// writes: the rows are delivered as before, then the log; nothing twice,
// nothing out of order.
TEST(RelayLogCutover, ASubscriptionMovesOntoTheLogWhileWritersWrite) {
  testing::TestDatabase orders("relay_cutover", producer::OrdersSchemas());
  testing::TestDatabase billing("relay_cutover_billing",
                                ConsumerSchemas(Billing()));
  orders.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  Database db(orders.url(), 4, "relay-test-producer");
  Writer writer({.notify_url = orders.url()});
  producer::OrderStore store(&db, &writer);
  const auto create = [&](int n) {
    for (int i = 0; i < n; ++i) {
      v1::CreateOrderRequest req;
      req.set_customer_id("c");
      req.set_currency("EUR");
      auto* item = req.add_items();
      item->set_sku("sku");
      item->set_quantity(1);
      item->set_unit_price_cents(100);
      auto order = store.Create(req, *producer::ValidateCreate(req), "");
      ASSERT_TRUE(order.ok()) << order.status();
      v1::PayOrderRequest pay;
      pay.set_order_id(order->order_id());
      pay.set_amount_cents(100);
      ASSERT_TRUE(store.Pay(pay, "").ok());
    }
  };
  create(30);
  ASSERT_EQ(orders.Scalar("SELECT count(*) FROM outbox_delivery"), 60);
  std::atomic<bool> done{false};
  std::thread producer([&] {
    create(40);
    done = true;
  });
  Metrics metrics;
  Consumer consumer(billing.url(), 0);
  RelayOptions o;
  o.db_url = orders.url();
  o.consumer = absl::StrCat("127.0.0.1:", consumer.port());
  o.batch_size = 16;
  o.poll_interval = absl::Milliseconds(100);
  o.rebalance_interval = absl::Milliseconds(100);
  o.log_delivery = true;
  Relay relay(o, &metrics);
  relay.Start();
  producer.join();
  const auto applied = [&] {
    return billing.Scalar("SELECT count(*) FROM inbox");
  };
  ASSERT_TRUE(WaitFor([&] {
    return applied() == orders.Scalar("SELECT count(*) FROM outbox");
  })) << applied();
  EXPECT_GT(orders.Scalar("SELECT start_tick FROM subscriptions"), 0);
  ASSERT_TRUE(WaitFor([&] {
    return orders.Scalar("SELECT count(*) FROM outbox_delivery") == 0;
  }));
  EXPECT_EQ(billing.Scalar(
                "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION "
                "BY aggregate_id ORDER BY apply_id) AS before FROM inbox) x "
                "WHERE before >= seq"),
            0);
  EXPECT_EQ(billing.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(billing.Scalar("SELECT count(DISTINCT event_id) FROM inbox"), 140);
}

}  // namespace
}  // namespace outbox::relay
