// OrderStore against a real PostgreSQL: group writes, the prev_seq chain,
// concurrency and recovery.

#include <gtest/gtest.h>

#include <functional>
#include <future>
#include <memory>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/ids.h"
#include "common/schema.h"
#include "outbox/v1/event.pb.h"
#include "producer/order_logic.h"
#include "producer/order_schema.h"
#include "producer/order_store.h"
#include "tests/testing/pg.h"
#include "tests/testing/wait.h"

namespace outbox::producer {
namespace {

using testing::TestDatabase;

using ::outbox::testing::WaitFor;

// Two books at 12.50 EUR.
v1::CreateOrderRequest Request(const std::string& key = "") {
  v1::CreateOrderRequest r;
  r.set_customer_id("c-1");
  r.set_currency("EUR");
  auto* i = r.add_items();
  i->set_sku("book");
  i->set_quantity(2);
  i->set_unit_price_cents(1250);
  r.set_idempotency_key(key);
  return r;
}

class OrderStoreTest : public ::testing::Test {
 protected:
  OrderStoreTest()
      : tdb_("orders", OrdersSchemas()),
        db_(tdb_.url(), 12, "order-store-test"),
        store_(&db_, &writer_) {
    tdb_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  }

  v1::Order Create(const std::string& key = "") {
    auto req = Request(key);
    auto order = store_.Create(req, *ValidateCreate(req), NewTraceParent());
    EXPECT_TRUE(order.ok()) << order.status();
    return order.value_or(v1::Order());
  }

  absl::StatusOr<v1::Order> Pay(const v1::Order& o, int64_t version,
                                int64_t amount) {
    v1::PayOrderRequest req;
    req.set_order_id(o.order_id());
    req.set_expected_version(version);
    req.set_amount_cents(amount);
    return store_.Pay(req, NewTraceParent());
  }

  absl::StatusOr<v1::Order> Cancel(const v1::Order& o, int64_t version) {
    v1::CancelOrderRequest req;
    req.set_order_id(o.order_id());
    req.set_expected_version(version);
    req.set_reason("changed my mind");
    return store_.Cancel(req, NewTraceParent());
  }

  int64_t Events() { return tdb_.Scalar("SELECT count(*) FROM outbox"); }

  // The seq of `order_id`'s newest event, as its chain head says.
  int64_t Head(const std::string& order_id) {
    return tdb_.Scalar(absl::StrCat(
        "SELECT last_seq FROM outbox_heads WHERE aggregate_type = 'order' "
        "AND aggregate_id = '",
        order_id, "'"));
  }

  TestDatabase tdb_;
  Database db_;
  Writer writer_;
  OrderStore store_;
};

TEST_F(OrderStoreTest, CreateWritesOrderAndEventTogether) {
  const std::string trace =
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  auto req = Request();
  auto order = store_.Create(req, 2500, trace);
  ASSERT_TRUE(order.ok()) << order.status();
  EXPECT_TRUE(IsUuid(order->order_id()));
  EXPECT_EQ(order->status(), v1::ORDER_STATUS_CREATED);
  EXPECT_EQ(order->version(), 1);
  EXPECT_EQ(order->total_cents(), 2500);
  ASSERT_EQ(order->items_size(), 1);
  EXPECT_EQ(order->items(0).unit_price_cents(), 1250);

  pqxx::result rows = tdb_.Query(
      "SELECT o.seq, o.prev_seq, o.aggregate_id, o.event_type, o.partition, "
      "o.trace_parent, d.status, h.last_seq, o.payload "
      "FROM outbox o JOIN outbox_heads h ON h.aggregate_type = 'order' AND "
      "h.aggregate_id = o.aggregate_id "
      "JOIN outbox_delivery d ON d.seq = o.seq AND d.subscription = 'billing'");
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0][1].as<int64_t>(), 0);
  EXPECT_EQ(rows[0][2].as<std::string>(), order->order_id());
  EXPECT_EQ(rows[0][3].as<std::string>(), "OrderCreated");
  EXPECT_EQ(rows[0][4].as<int>(), PartitionOf(order->order_id()));
  EXPECT_EQ(rows[0][5].as<std::string>(), trace);
  EXPECT_EQ(rows[0][6].as<std::string>(), "pending");
  EXPECT_EQ(rows[0][7].as<int64_t>(), rows[0][0].as<int64_t>());
  v1::Event event;
  ASSERT_TRUE(event.ParseFromString(pqxx::binarystring(rows[0][8]).str()));
  v1::OrderCreated created;
  ASSERT_TRUE(event.payload().UnpackTo(&created));
  EXPECT_EQ(created.total_cents(), 2500);
  EXPECT_EQ(created.customer_id(), "c-1");
  EXPECT_EQ(event.aggregate_type(), "order");
  EXPECT_EQ(event.event_type(), "OrderCreated");
  EXPECT_EQ(event.trace_parent(), trace);
}

TEST_F(OrderStoreTest, EventsOfAnOrderFormAPrevSeqChain) {
  v1::Order o = Create();
  Create();  // another aggregate's event in between
  auto paid = Pay(o, 1, 2500);
  ASSERT_TRUE(paid.ok()) << paid.status();
  EXPECT_EQ(paid->status(), v1::ORDER_STATUS_PAID);
  EXPECT_EQ(paid->version(), 2);
  auto cancelled = Cancel(*paid, 2);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->version(), 3);

  pqxx::result rows = tdb_.Query(
      absl::StrCat("SELECT seq, prev_seq, event_type, payload FROM outbox "
                   "WHERE aggregate_id = '",
                   o.order_id(), "' ORDER BY seq"));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0][1].as<int64_t>(), 0);
  EXPECT_EQ(rows[1][1].as<int64_t>(), rows[0][0].as<int64_t>());
  EXPECT_EQ(rows[2][1].as<int64_t>(), rows[1][0].as<int64_t>());
  EXPECT_EQ(rows[1][2].as<std::string>(), "OrderPaid");
  EXPECT_EQ(rows[2][2].as<std::string>(), "OrderCancelled");
  v1::Event cancel_event;
  ASSERT_TRUE(
      cancel_event.ParseFromString(pqxx::binarystring(rows[2][3]).str()));
  v1::OrderCancelled cancelled_payload;
  ASSERT_TRUE(cancel_event.payload().UnpackTo(&cancelled_payload));
  EXPECT_EQ(cancelled_payload.refund_cents(), 2500);
  EXPECT_EQ(Head(o.order_id()), rows[2][0].as<int64_t>());
}

// An order id is a UUID, whatever its letters' case: GetOrder finds one
// written in capitals, and so must PayOrder and CancelOrder, and their
// events must name the aggregate as every other event of it does.
TEST_F(OrderStoreTest, ChangesFindAnOrderWhoseIdComesInCapitals) {
  v1::Order o = Create();
  v1::Order upper = o;
  upper.set_order_id(absl::AsciiStrToUpper(o.order_id()));
  ASSERT_NE(upper.order_id(), o.order_id());
  auto paid = Pay(upper, 1, o.total_cents());
  ASSERT_TRUE(paid.ok()) << paid.status();
  EXPECT_EQ(paid->order_id(), o.order_id());
  auto cancelled = Cancel(upper, 2);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(tdb_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox WHERE aggregate_id = '",
                o.order_id(), "'")),
            3);
  EXPECT_EQ(Head(o.order_id()), tdb_.Scalar("SELECT max(seq) FROM outbox"));
}

TEST_F(OrderStoreTest, RefusedChangesWriteNothing) {
  v1::Order o = Create();
  EXPECT_EQ(Pay(o, 2, 2500).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(Pay(o, 1, 2499).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::Order missing = o;
  missing.set_order_id(NewUuid());
  EXPECT_EQ(Pay(missing, 0, 2500).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Cancel(missing, 0).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Cancel(o, 1).ok());
  EXPECT_EQ(Pay(o, 2, 2500).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Cancel(o, 2).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Events(), 2);  // created + cancelled
  EXPECT_EQ(tdb_.Scalar("SELECT version FROM orders"), 2);
}

// Calls whose callers stopped waiting before their group was written (a
// deadline passed, a cancelled call) are answered so and write nothing.
TEST_F(OrderStoreTest, CallsNobodyWaitsForWriteNothing) {
  v1::Order o = Create();
  auto await = [](const std::function<void(OrderStore::Done)>& start) {
    auto done = std::make_shared<std::promise<absl::StatusOr<v1::Order>>>();
    start([done](absl::StatusOr<v1::Order> r) { done->set_value(r); });
    return done->get_future().get();
  };
  const Waiter expired{.deadline = absl::Now() - absl::Milliseconds(1)};
  const Waiter gone{.cancelled = [] { return true; }};
  auto req = Request();
  const int64_t total = *ValidateCreate(req);
  EXPECT_EQ(await([&](OrderStore::Done d) {
              store_.CreateAsync(req, total, NewTraceParent(), d, expired);
            })
                .status()
                .code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(await([&](OrderStore::Done d) {
              store_.CreateAsync(req, total, NewTraceParent(), d, gone);
            })
                .status()
                .code(),
            absl::StatusCode::kCancelled);
  v1::PayOrderRequest pay;
  pay.set_order_id(o.order_id());
  pay.set_expected_version(1);
  pay.set_amount_cents(2500);
  EXPECT_EQ(await([&](OrderStore::Done d) {
              store_.PayAsync(pay, NewTraceParent(), d, expired);
            })
                .status()
                .code(),
            absl::StatusCode::kDeadlineExceeded);
  v1::CancelOrderRequest cancel;
  cancel.set_order_id(o.order_id());
  cancel.set_expected_version(1);
  EXPECT_EQ(await([&](OrderStore::Done d) {
              store_.CancelAsync(cancel, NewTraceParent(), d, gone);
            })
                .status()
                .code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM orders"), 1);
  EXPECT_EQ(tdb_.Scalar("SELECT version FROM orders"), 1);
  EXPECT_EQ(Events(), 1);
  // A caller who still waits is written as before.
  const Waiter waiting{.deadline = absl::Now() + absl::Minutes(1),
                       .cancelled = [] { return false; }};
  EXPECT_TRUE(await([&](OrderStore::Done d) {
                store_.PayAsync(pay, NewTraceParent(), d, waiting);
              }).ok());
  EXPECT_EQ(Events(), 2);
}

TEST_F(OrderStoreTest, FailureAfterTheOrderWriteLeavesNeither) {
  // The outbox insert fails after the order row was written in the same
  // transaction: both must roll back.
  tdb_.Exec(
      "CREATE FUNCTION fail() RETURNS trigger AS $$ BEGIN "
      "RAISE EXCEPTION 'injected failure'; END $$ LANGUAGE plpgsql; "
      "CREATE TRIGGER fail BEFORE INSERT ON outbox "
      "FOR EACH ROW EXECUTE FUNCTION fail()");
  auto req = Request("key-1");
  auto created = store_.Create(req, 2500, NewTraceParent());
  EXPECT_FALSE(created.ok());
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM orders"), 0);
  EXPECT_EQ(Events(), 0);

  tdb_.Exec("DROP TRIGGER fail ON outbox");
  v1::Order o = Create("key-1");  // the key is free again
  tdb_.Exec(
      "CREATE TRIGGER fail BEFORE INSERT ON outbox "
      "FOR EACH ROW EXECUTE FUNCTION fail()");
  EXPECT_FALSE(Pay(o, 1, 2500).ok());
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM orders WHERE status = 'CREATED' "
                        "AND version = 1"),
            1);
  EXPECT_EQ(Events(), 1);
}

TEST_F(OrderStoreTest, GroupCommitFailsOnlyTheRequestTheDatabaseRefuses) {
  // Concurrent creates share statements; one carries a value a constraint
  // refuses (a data error): its group is retried order by order, so it
  // alone fails and every other order and event is written exactly once.
  tdb_.Exec(
      "ALTER TABLE orders ADD CONSTRAINT no_blocked CHECK "
      "(customer_id <> 'blocked')");
  constexpr int kThreads = 24;
  std::vector<absl::Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      auto req = Request(absl::StrCat("group-", i));
      if (i == 7) req.set_customer_id("blocked");
      results[i] = store_.Create(req, 2500, NewTraceParent()).status();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    if (i == 7) {
      EXPECT_EQ(results[i].code(), absl::StatusCode::kFailedPrecondition)
          << results[i];
    } else {
      EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
    }
  }
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM orders"), kThreads - 1);
  EXPECT_EQ(Events(), kThreads - 1);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM orders o JOIN outbox_heads h ON "
                        "h.aggregate_id = o.order_id::text JOIN outbox e ON "
                        "e.seq = h.last_seq AND e.aggregate_id = "
                        "o.order_id::text"),
            kThreads - 1);
}

TEST_F(OrderStoreTest, ChangeGroupsFailOnlyTheRefusedRequests) {
  // Concurrent pays share transactions. Among them: a wrong amount, a stale
  // version, a missing order, and one the database refuses (a data
  // error, which retries its group change by change). Each of those fails
  // alone, with its own status; every other order is paid once, with its
  // event chained after its OrderCreated.
  tdb_.Exec(
      "ALTER TABLE orders ADD CONSTRAINT no_paid_blocked CHECK "
      "(NOT (status = 'PAID' AND customer_id = 'blocked'))");
  constexpr int kOrders = 32;
  std::vector<v1::Order> orders;
  for (int i = 0; i < kOrders; ++i) {
    auto req = Request(absl::StrCat("change-", i));
    if (i == 11) req.set_customer_id("blocked");
    auto o = store_.Create(req, 2500, NewTraceParent());
    ASSERT_TRUE(o.ok()) << o.status();
    orders.push_back(*o);
  }
  const int64_t created = Events();
  std::vector<absl::StatusOr<v1::Order>> results(kOrders);
  for (int round = 0; round < 3; ++round) {
    std::vector<std::thread> threads;
    for (int i = round; i < kOrders; i += 3) {
      threads.emplace_back([&, i] {
        v1::Order o = orders[i];
        int64_t version = 1, amount = 2500;
        if (i == 3) amount = 2499;
        if (i == 7) version = 2;
        if (i == 19) o.set_order_id(NewUuid());
        results[i] = Pay(o, version, amount);
      });
    }
    for (auto& t : threads) t.join();
  }
  for (int i = 0; i < kOrders; ++i) {
    const absl::StatusCode want = i == 3    ? absl::StatusCode::kInvalidArgument
                                  : i == 7  ? absl::StatusCode::kAborted
                                  : i == 19 ? absl::StatusCode::kNotFound
                                  : i == 11
                                      ? absl::StatusCode::kFailedPrecondition
                                      : absl::StatusCode::kOk;
    EXPECT_EQ(results[i].status().code(), want)
        << i << ": " << results[i].status();
    if (want != absl::StatusCode::kOk) continue;
    EXPECT_EQ(results[i]->status(), v1::ORDER_STATUS_PAID);
    EXPECT_EQ(results[i]->version(), 2);
    EXPECT_EQ(results[i]->order_id(), orders[i].order_id());
  }
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM orders WHERE status = 'PAID' "
                        "AND version = 2"),
            kOrders - 4);
  EXPECT_EQ(
      tdb_.Scalar("SELECT count(*) FROM orders WHERE status = "
                  "'CREATED' AND version = 1"),
      4);  // 3, 7, 11, and 19 (its pay named an order that does not exist)
  EXPECT_EQ(Events(), created + kOrders - 4);
  // Each paid order's head is its OrderPaid, chained to its OrderCreated.
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM orders o JOIN outbox_heads h ON "
                        "h.aggregate_id = o.order_id::text JOIN outbox e ON "
                        "e.seq = h.last_seq AND e.event_type = 'OrderPaid' "
                        "JOIN outbox c ON c.seq = e.prev_seq AND c.event_type "
                        "= 'OrderCreated' AND c.aggregate_id = e.aggregate_id "
                        "WHERE o.status = 'PAID'"),
            kOrders - 4);
}

TEST_F(OrderStoreTest, ChangesOfOneOrderInOneGroupApplyInTurn) {
  // Many changes of one order at once land in few groups: each is decided
  // against the order as the ones before it left it, so exactly one pay
  // and one cancel win, versions count up, and the events form one chain.
  v1::Order o = Create();
  std::vector<absl::StatusOr<v1::Order>> results(16);
  std::vector<std::thread> threads;
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back(
        [&, i] { results[i] = i % 2 ? Pay(o, 0, 2500) : Cancel(o, 0); });
  }
  for (auto& t : threads) t.join();
  std::set<int64_t> versions;
  for (const auto& r : results) {
    if (r.ok()) {
      versions.insert(r->version());
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition)
          << r.status();
    }
  }
  EXPECT_GE(versions.size(), 1u);
  EXPECT_LE(versions.size(), 2u);
  EXPECT_EQ(*versions.begin(), 2);
  EXPECT_EQ(tdb_.Scalar("SELECT version FROM orders"),
            1 + static_cast<int64_t>(versions.size()));
  pqxx::result rows =
      tdb_.Query("SELECT seq, prev_seq FROM outbox ORDER BY seq");
  ASSERT_EQ(rows.size(), 1 + versions.size());
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i][1].as<int64_t>(), rows[i - 1][0].as<int64_t>());
  }
  EXPECT_EQ(tdb_.Scalar(absl::StrCat("SELECT count(*) FROM outbox WHERE seq = ",
                                     Head(o.order_id()))),
            1);
}

TEST_F(OrderStoreTest, AChangeWhoseOrderMovedAfterItsReadIsDecidedAgain) {
  // Another producer pays each order between this store's read and its
  // write: the write misses (the version moved) and writes nothing; the
  // change is decided again against the order as it now is.
  Database other_db(tdb_.url(), 2, "other-producer");
  Writer other_writer;
  OrderStore other(&other_db, &other_writer);
  const v1::Order any_version = Create();
  const v1::Order stale_version = Create();
  std::string paying;  // the order the other producer pays next
  int rounds = 0;
  OrderStoreOptions options;
  options.between_read_and_write = [&] {
    ++rounds;
    if (paying.empty()) return;
    v1::PayOrderRequest req;
    req.set_order_id(paying);
    req.set_amount_cents(2500);
    EXPECT_TRUE(other.Pay(req, NewTraceParent()).ok());
    paying.clear();
  };
  OrderStore racing(&db_, &writer_, options);
  v1::CancelOrderRequest req;
  req.set_reason("changed my mind");

  // Any version: cancelled after the pay, refunding it.
  paying = any_version.order_id();
  req.set_order_id(any_version.order_id());
  auto cancelled = racing.Cancel(req, NewTraceParent());
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(rounds, 2);
  EXPECT_EQ(cancelled->version(), 3);
  EXPECT_EQ(cancelled->status(), v1::ORDER_STATUS_CANCELLED);
  pqxx::result rows = tdb_.Query(absl::StrCat(
      "SELECT event_type, seq, prev_seq, payload FROM outbox WHERE "
      "aggregate_id = '",
      any_version.order_id(), "' ORDER BY seq"));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[1][0].as<std::string>(), "OrderPaid");
  EXPECT_EQ(rows[2][0].as<std::string>(), "OrderCancelled");
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i][2].as<int64_t>(), rows[i - 1][1].as<int64_t>());
  }
  v1::Event event;
  v1::OrderCancelled payload;
  ASSERT_TRUE(event.ParseFromString(pqxx::binarystring(rows[2][3]).str()));
  ASSERT_TRUE(event.payload().UnpackTo(&payload));
  EXPECT_EQ(payload.refund_cents(), 2500);

  // Version 1 expected: by the time of the write it is 2, so it fails, and
  // only the pay is written.
  rounds = 0;
  paying = stale_version.order_id();
  req.set_order_id(stale_version.order_id());
  req.set_expected_version(1);
  auto stale = racing.Cancel(req, NewTraceParent());
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kAborted)
      << stale.status();
  EXPECT_EQ(rounds, 1);  // the second round refuses before any write
  EXPECT_EQ(tdb_.Scalar(absl::StrCat(
                "SELECT version * 10 + (SELECT count(*) FROM outbox WHERE "
                "aggregate_id = o.order_id::text) FROM orders o WHERE "
                "order_id = '",
                stale_version.order_id(), "'")),
            22);  // version 2; its OrderCreated and OrderPaid
}

// Counts the notifications of the relays' channel on its connection.
class Heard : public pqxx::notification_receiver {
 public:
  explicit Heard(pqxx::connection_base& c)
      : pqxx::notification_receiver(c, kNotifyChannel) {}
  void operator()(const std::string&, int) override { ++count; }
  int count = 0;
};

TEST_F(OrderStoreTest, StatementsThatWriteEventsNotifyAtTheirCommit) {
  OrderStoreOptions options;
  options.notify_channel = kNotifyChannel;
  OrderStore notifying(&db_, &writer_, options);
  pqxx::connection listener(tdb_.url());
  Heard heard(listener);
  // Waits up to `seconds` for a notification, then a little for more.
  auto heard_after = [&](int seconds) {
    heard.count = 0;
    listener.await_notification(seconds, 0);
    listener.await_notification(0, 100000);
    return heard.count;
  };

  // Without a channel (store_): nothing.
  Create();
  EXPECT_EQ(heard_after(0), 0);

  auto req = Request("notify-key");
  auto created = notifying.Create(req, *ValidateCreate(req), "");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(heard_after(5), 1);

  v1::PayOrderRequest pay;
  pay.set_order_id(created->order_id());
  pay.set_amount_cents(1);  // refused: writes nothing, says nothing
  EXPECT_EQ(notifying.Pay(pay, "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(heard_after(0), 0);
  pay.set_amount_cents(2500);
  ASSERT_TRUE(notifying.Pay(pay, "").ok());
  EXPECT_EQ(heard_after(5), 1);

  // An idempotent repeat writes no order and no event: no notification.
  auto again = notifying.Create(req, *ValidateCreate(req), "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(heard_after(0), 0);
}

TEST_F(OrderStoreTest, ConcurrentRetriesWithOneKeyMakeOneOrder) {
  constexpr int kThreads = 10;
  std::vector<std::string> ids(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      auto req = Request("retry-key");
      auto order = store_.Create(req, 2500, NewTraceParent());
      ids[i] = order.ok() ? order->order_id() : order.status().ToString();
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& id : ids) EXPECT_EQ(id, ids[0]);
  EXPECT_TRUE(IsUuid(ids[0])) << ids[0];
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM orders"), 1);
  EXPECT_EQ(Events(), 1);

  auto other = Request("retry-key");
  other.mutable_items(0)->set_quantity(3);
  auto reused = store_.Create(other, 3750, NewTraceParent());
  EXPECT_EQ(reused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Events(), 1);
}

TEST_F(OrderStoreTest, RacingChangesKeepTheChain) {
  // Pays and cancels race on one order; whatever wins, the events chain.
  v1::Order o = Create();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      bool done = i % 2 ? Pay(o, 0, 2500).ok() : Cancel(o, 0).ok();
      if (done) ++ok;
    });
  }
  for (auto& t : threads) t.join();
  pqxx::result rows =
      tdb_.Query("SELECT seq, prev_seq FROM outbox ORDER BY seq");
  ASSERT_EQ(static_cast<int>(rows.size()), 1 + ok.load());
  EXPECT_GE(ok.load(), 1);
  EXPECT_LE(ok.load(), 2);  // CREATED -> PAID -> CANCELLED at most
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i][1].as<int64_t>(), rows[i - 1][0].as<int64_t>());
  }
}

TEST_F(OrderStoreTest, RecoversWhenConnectionsAreKilled) {
  v1::Order o = Create();
  // What a database restart does to every open connection: the pool's,
  // idle now, are ended (and there are some to end).
  const int64_t killed = tdb_.Scalar(absl::StrCat(
      "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM "
      "pg_stat_activity WHERE datname = '",
      tdb_.name(), "' AND application_name = 'order-store-test'"));
  ASSERT_GE(killed, 1);
  ASSERT_TRUE(WaitFor([&] {
    return tdb_.Scalar(absl::StrCat(
               "SELECT count(*) FROM pg_stat_activity WHERE datname = '",
               tdb_.name(), "' AND application_name = 'order-store-test'")) ==
           0;
  }));
  // Each call on a dead connection fails as Unavailable and drops it; then
  // a new one succeeds. Exactly one failure per connection killed: none is
  // handed out twice, none is missed.
  absl::StatusOr<v1::Order> got;
  int unavailable = 0;
  for (int i = 0; i < 20; ++i) {
    got = store_.Get(o.order_id());
    if (got.ok()) break;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable)
        << got.status();
    ++unavailable;
  }
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->order_id(), o.order_id());
  EXPECT_EQ(unavailable, killed);
}

TEST(OrderStorePlans, KeyLookupsStayIndexProbesInGenericPlans) {
  // A prepared statement's generic plan is made once, often while orders
  // is still empty, and kept as it grows: a change planned as a join over
  // a scan of orders would read every order in every write. Forced
  // generic plans on a new table must still find each order by its key.
  TestDatabase tdb("order_plans", OrdersSchemas());
  tdb.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  Database db(tdb.url(), 1, "order-plans", DbSession{},
              [](pqxx::connection& c) {
                pqxx::nontransaction(c).exec(
                    "SET plan_cache_mode = force_generic_plan");
              });
  Writer writer;
  OrderStore store(&db, &writer);
  // Every statement runs, each under its generic plan, and still works.
  const v1::CreateOrderRequest create = Request();
  auto order = store.Create(create, *ValidateCreate(create), NewTraceParent());
  ASSERT_TRUE(order.ok()) << order.status();
  v1::PayOrderRequest pay;
  pay.set_order_id(order->order_id());
  pay.set_expected_version(1);
  pay.set_amount_cents(order->total_cents());
  auto paid = store.Pay(pay, NewTraceParent());
  ASSERT_TRUE(paid.ok()) << paid.status();
  EXPECT_EQ(paid->version(), 2);
  v1::CancelOrderRequest stale;  // the version the pay moved past
  stale.set_order_id(order->order_id());
  stale.set_expected_version(1);
  EXPECT_EQ(store.Cancel(stale, NewTraceParent()).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM outbox"), 2);
  absl::Status s = db.Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::nontransaction tx(c);
    const std::string arrays = "'{}', '{}', '{}', ";
    const std::vector<std::string> calls = {
        "read_orders('{}')",
        "change_orders(" + arrays + arrays + arrays + "'{}', '{}', '')"};
    for (const std::string& call : calls) {
      std::string plan;
      for (const auto& row : tx.exec("EXPLAIN EXECUTE " + call)) {
        plan += row[0].as<std::string>() + "\n";
      }
      EXPECT_EQ(plan.find("Seq Scan on orders"), std::string::npos)
          << call << ":\n"
          << plan;
      EXPECT_NE(plan.find("Index Scan using orders_pkey"), std::string::npos)
          << call << ":\n"
          << plan;
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace outbox::producer

namespace outbox {
namespace {

TEST(Migrations, ConcurrentStartupsApplyEachMigrationOnce) {
  // Eight replicas starting at once against an empty database, as a
  // rollout does: the advisory lock lets one migrate while the others wait.
  testing::TestDatabase tdb("migrate", {});
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      for (const Schema& schema : producer::OrdersSchemas()) {
        results[i] = Migrate(tdb.url(), schema.name, *schema.migrations);
        if (!results[i].ok()) return;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  size_t versions = 0;
  for (const Schema& schema : producer::OrdersSchemas()) {
    versions += schema.migrations->size();
  }
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM schema_migrations"),
            static_cast<int64_t>(versions));
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM pg_tables WHERE tablename IN "
                       "('orders', 'outbox')"),
            2);
}

}  // namespace
}  // namespace outbox
