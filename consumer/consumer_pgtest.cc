// The billing consumer against a real PostgreSQL: its handler's effects on
// the inbox engine, its query service over real gRPC on loopback (held
// events listed and released, the order view), its validation of events,
// its statements' plans, and the audit handler. The engine's own behaviour
// (dedup, order, holding, identity, retention, gray failures) is tested
// with a handler of its own in inbox/engine_pgtest.cc.

#include <gtest/gtest.h>


#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/schema.h"
#include "common/server.h"
#include "consumer/audit.h"
#include "consumer/billing.h"
#include "consumer/query_service.h"
#include "inbox/engine.h"
#include "inbox/sink_service.h"
#include "tests/testing/grpc.h"
#include "tests/testing/inbox.h"
#include "tests/testing/pg.h"

namespace outbox::consumer {
namespace {

using inbox::Engine;
using inbox::EventSinkImpl;

BillingHandler* Billing() {
  static BillingHandler handler;
  return &handler;
}

// The billing consumer's database: the engine's tables, then billing's.
std::vector<Schema> BillingSchemas() {
  return {InboxSchema(), {"billing", &Billing()->migrations()}};
}

// The three events of one order: created, paid, cancelled (refund).
std::vector<v1::Event> OrderChain(int64_t first_seq, int64_t step = 1) {
  const std::string id = NewUuid();
  std::vector<v1::Event> chain(3);
  const char* types[] = {"OrderCreated", "OrderPaid", "OrderCancelled"};
  for (int i = 0; i < 3; ++i) {
    v1::Event& e = chain[i];
    e.set_event_id(NewUuid());
    e.set_aggregate_type("order");
    e.set_aggregate_id(id);
    e.set_seq(first_seq + i * step);
    e.set_prev_seq(i == 0 ? 0 : first_seq + (i - 1) * step);
    e.set_event_type(types[i]);
    e.set_schema_version(1);
    ToTimestamp(absl::Now(), e.mutable_occurred_at());
  }
  v1::OrderCreated created;
  created.set_order_id(id);
  created.set_customer_id("c");
  created.set_currency("EUR");
  created.set_total_cents(700);
  chain[0].mutable_payload()->PackFrom(created);
  v1::OrderPaid paid;
  paid.set_order_id(id);
  paid.set_amount_cents(700);
  paid.set_currency("EUR");
  chain[1].mutable_payload()->PackFrom(paid);
  v1::OrderCancelled cancelled;
  cancelled.set_order_id(id);
  cancelled.set_refund_cents(700);
  chain[2].mutable_payload()->PackFrom(cancelled);
  return chain;
}

std::vector<v1::DeliveryOutcome> Outcomes(
    const std::vector<v1::EventResult>& results) {
  std::vector<v1::DeliveryOutcome> out;
  for (const auto& r : results) out.push_back(r.outcome());
  return out;
}

class ConsumerTest : public ::testing::Test {
 protected:
  ConsumerTest()
      : tdb_("consumer", BillingSchemas()),
        db_(tdb_.url(), 4, "consumer-test"),
        applier_(&db_, Billing(), &metrics_),
        sink_(&applier_),
        query_(&db_, &metrics_, "billing", nullptr, &applier_) {
    auto server = GrpcServer::Start(
        {"127.0.0.1:0", absl::Seconds(2), nullptr, kMaxDeliverMessageBytes},
        {{&sink_, v1::EventSink::service_full_name()},
         {&query_, v1::BillingQuery::service_full_name()}});
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = testing::Loopback(server_->port());
  }

  // Sends `batches` over one Deliver stream; returns the outcomes in order.
  std::vector<v1::EventResult> Deliver(
      const std::vector<std::vector<v1::Event>>& batches,
      grpc::Status* status = nullptr) {
    return testing::DeliverBatches(channel_, batches, status);
  }

  // Every aggregate's inbox rows are in seq order by apply_id, and each
  // applied seq is the chain's next.
  void ExpectAppliedInOrder() { EXPECT_EQ(testing::InboxOutOfOrder(tdb_), 0); }

  testing::TestDatabase tdb_;
  Database db_;
  Metrics metrics_;
  Engine applier_;
  EventSinkImpl sink_;
  BillingQueryImpl query_;
  std::unique_ptr<GrpcServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

using V = std::vector<v1::DeliveryOutcome>;

TEST_F(ConsumerTest, AppliesAChainWithItsEffects) {
  auto chain = OrderChain(1);
  auto results = Deliver({chain});
  EXPECT_EQ(Outcomes(results), (V{v1::APPLIED, v1::APPLIED, v1::APPLIED}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 3);
  EXPECT_EQ(tdb_.Scalar("SELECT last_seq FROM aggregate_cursors"), 3);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM charges WHERE kind = 'charge' "
                        "AND amount_cents = 700"),
            1);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM charges WHERE kind = 'refund' "
                        "AND amount_cents = 700"),
            1);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM order_view WHERE status = "
                        "'CANCELLED' AND last_seq = 3"),
            1);
}

TEST_F(ConsumerTest, EarlyEventIsHeldThenDrainedWhenTheGapCloses) {
  auto chain = OrderChain(100, 7);  // seqs 100, 107, 114: not dense
  EXPECT_EQ(Outcomes(Deliver({{chain[2]}, {chain[1]}})),
            (V{v1::HELD, v1::HELD}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 2);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 0);

  auto query = v1::BillingQuery::NewStub(channel_);
  {
    grpc::ClientContext ctx;
    v1::ListHeldEventsResponse held;
    ASSERT_TRUE(query->ListHeldEvents(&ctx, {}, &held).ok());
    ASSERT_EQ(held.events_size(), 2);
    EXPECT_EQ(held.events(0).cursor(), 0);
  }
  // Held again on redelivery: still one copy.
  EXPECT_EQ(Outcomes(Deliver({{chain[2]}})), (V{v1::HELD}));

  EXPECT_EQ(Outcomes(Deliver({{chain[0]}})), (V{v1::APPLIED}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 3);
  EXPECT_EQ(tdb_.Scalar("SELECT last_seq FROM aggregate_cursors"), 114);
  ExpectAppliedInOrder();

  grpc::ClientContext ctx;
  v1::GetOrderViewRequest req;
  req.set_order_id(chain[0].aggregate_id());
  v1::GetOrderViewResponse view;
  ASSERT_TRUE(query->GetOrderView(&ctx, req, &view).ok());
  EXPECT_EQ(view.order().status(), v1::ORDER_STATUS_CANCELLED);
  EXPECT_EQ(view.order().charges_size(), 2);
}

TEST_F(ConsumerTest, BadEventsAreRejectedWithAReasonAndOthersApply) {
  auto chain = OrderChain(1);
  v1::Event unknown = chain[0];
  unknown.set_event_id(NewUuid());
  unknown.set_event_type("OrderTeleported");
  v1::Event no_payload = chain[0];
  no_payload.set_event_id(NewUuid());
  no_payload.clear_payload();
  v1::Event future = chain[0];
  future.set_event_id(NewUuid());
  future.set_schema_version(9);
  v1::Event anonymous = chain[0];
  anonymous.clear_event_id();
  auto results = Deliver({{unknown, no_payload, chain[0], future, anonymous}});
  ASSERT_EQ(results.size(), 5u);
  EXPECT_EQ(Outcomes(results), (V{v1::REJECTED, v1::REJECTED, v1::APPLIED,
                                  v1::REJECTED, v1::REJECTED}));
  EXPECT_NE(results[0].reason().find("OrderTeleported"), std::string::npos);
  EXPECT_NE(results[3].reason().find("schema_version"), std::string::npos);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 1);
  // A broken chain: prev_seq behind the cursor, seq ahead of it.
  v1::Event broken = chain[2];
  broken.set_prev_seq(0);
  broken.set_seq(50);
  EXPECT_EQ(Outcomes(Deliver({{chain[1], broken}})),
            (V{v1::APPLIED, v1::REJECTED}));
}

TEST(ConsumerPlans, KeyLookupsStayIndexProbesInGenericPlans) {
  // A prepared statement's generic plan is made once, often while the
  // tables are still empty, and kept as they grow: a lookup by key planned
  // as a join over a table scan would read every cursor, view or inbox row
  // in every batch. Forced generic plans on near-empty tables must still
  // probe the index.
  testing::TestDatabase tdb("consumer_plans", BillingSchemas());
  Database db(tdb.url(), 1, "consumer-plans", DbSession{},
              [](pqxx::connection& c) {
                pqxx::nontransaction(c).exec(
                    "SET plan_cache_mode = force_generic_plan");
              });
  Metrics metrics;
  Engine engine(&db, Billing(), &metrics);
  std::vector<v1::Event> chain = OrderChain(1);
  // The first event, then the rest with the first again (a duplicate, which
  // asks the inbox): every lookup statement runs.
  ASSERT_TRUE(engine.ApplyBatch({&chain[0]}).ok());
  auto again = engine.ApplyBatch({&chain[0], &chain[1], &chain[2]});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Outcomes(*again), (std::vector<v1::DeliveryOutcome>{
                                  v1::DUPLICATE, v1::APPLIED, v1::APPLIED}));
  const std::string id = "'{" + NewUuid() + "}'";
  absl::Status s = db.Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::nontransaction tx(c);
    // The cursors are read inside outbox_inbox_lock_chains, whose cached
    // plans follow the same rules: its query, prepared on its own. The
    // function forces generic plans itself (library users' sessions may
    // not).
    for (const char* f :
         {"outbox_inbox_lock_chains", "outbox_inbox_apply_chains"}) {
      EXPECT_EQ(tx.exec(absl::StrCat("SELECT array_to_string(proconfig, ',') "
                                     "FROM pg_proc WHERE proname = '",
                                     f, "'"))[0][0]
                    .as<std::string>(""),
                "plan_cache_mode=force_generic_plan")
          << f;
    }
    std::string src = tx.exec(
                            "SELECT prosrc FROM pg_proc WHERE proname = "
                            "'outbox_inbox_lock_chains'")[0][0]
                          .as<std::string>();
    const size_t from = src.find("RETURN QUERY");
    const size_t to = src.find(';', from);
    if (from == std::string::npos || to == std::string::npos) {
      return absl::InternalError("no RETURN QUERY in: " + src);
    }
    std::string query = src.substr(from + 12, to - from - 12);
    const std::string args = "unnest(sources, types, ids)";
    const size_t arg = query.find(args);
    if (arg == std::string::npos) {
      return absl::InternalError("no " + args + " in: " + query);
    }
    query.replace(arg, args.size(),
                  "unnest($1::text[], $2::text[], $3::text[])");
    tx.exec("PREPARE read_cursors(text[], text[], text[]) AS " + query);
    const std::vector<std::string> calls = {
        "read_cursors('{s}', '{order}', '{x}')", "read_views('{x}')",
        "in_inbox(" + id + ")"};
    for (const std::string& call : calls) {
      std::string plan;
      for (const auto& row : tx.exec("EXPLAIN EXECUTE " + call)) {
        plan += row[0].as<std::string>() + "\n";
      }
      EXPECT_EQ(plan.find("Seq Scan on"), std::string::npos) << call << ":\n"
                                                             << plan;
      EXPECT_NE(plan.find("Index"), std::string::npos) << call << ":\n" << plan;
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST_F(ConsumerTest, AFailedHeldEventIsListedAndReleasedOverGrpc) {
  tdb_.Exec(
      "ALTER TABLE charges ADD CONSTRAINT sane CHECK (amount_cents < 500)");
  auto chain = OrderChain(1);
  EXPECT_EQ(Outcomes(Deliver({{chain[1]}, {chain[0]}})),
            (V{v1::HELD, v1::APPLIED}));
  auto stub = v1::BillingQuery::NewStub(channel_);
  v1::ListHeldEventsRequest list;
  list.set_failed_only(true);
  v1::ListHeldEventsResponse held;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->ListHeldEvents(&ctx, list, &held).ok());
  }
  ASSERT_EQ(held.events_size(), 1);
  EXPECT_EQ(held.events(0).event_id(), chain[1].event_id());
  EXPECT_EQ(held.events(0).attempts(), 1);
  EXPECT_EQ(held.events(0).cursor(), 1);
  EXPECT_NE(held.events(0).last_error().find("23514"), std::string::npos)
      << held.events(0).last_error();
  EXPECT_TRUE(held.events(0).has_failed_at());

  v1::HeldEventActionRequest req;
  req.set_event_id(chain[1].event_id());
  v1::HeldEventActionResponse resp;
  {
    grpc::ClientContext ctx;  // no reason: refused, nothing changes
    grpc::Status s = stub->ReleaseHeldEvent(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("reason"), std::string::npos);
  }
  tdb_.Exec("ALTER TABLE charges DROP CONSTRAINT sane");
  req.set_reason("constraint dropped");
  {
    grpc::ClientContext ctx;
    grpc::Status s = stub->ReleaseHeldEvent(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_TRUE(resp.applied());
  EXPECT_EQ(resp.cursor(), 2);
  {
    grpc::ClientContext ctx;  // gone now
    grpc::Status s = stub->SkipHeldEvent(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  }
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM charges"), 1);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_actions WHERE reason = "
                        "'constraint dropped' AND outcome LIKE 'cursor 1 -> 2%'"),
            1);
  ExpectAppliedInOrder();
}

// The audit handler records every event once, whatever its domain, in
// chain order, with the payload as delivered.
TEST(AuditHandlerTest, RecordsEveryEventOnceInChainOrder) {
  AuditHandler audit;
  testing::TestDatabase tdb("audit",
                            {InboxSchema(), {"audit", &audit.migrations()}});
  Database db(tdb.url(), 2, "audit-test");
  Metrics metrics;
  Engine engine(&db, &audit, &metrics);
  auto chain = OrderChain(1);
  v1::Event other = chain[0];  // another domain's event
  other.set_event_id(NewUuid());
  other.set_aggregate_type("invoice");
  other.set_aggregate_id("inv-1");
  other.set_event_type("InvoiceIssued");
  other.clear_payload();
  // Out of order, then again (duplicates).
  auto r = engine.ApplyBatch({&chain[2], &other, &chain[1]});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].outcome(), v1::HELD);
  EXPECT_EQ((*r)[1].outcome(), v1::APPLIED);
  r = engine.ApplyBatch({&chain[0], &chain[1], &other});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[2].outcome(), v1::DUPLICATE);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM audit_log"), 4);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM (SELECT seq, lag(seq) OVER "
                       "(PARTITION BY aggregate_id ORDER BY recorded_at, "
                       "seq) AS b FROM audit_log) x WHERE b >= seq"),
            0);
  pqxx::result row = tdb.Query(
      "SELECT payload_type, payload FROM audit_log WHERE event_id = '" +
      chain[1].event_id() + "'");
  EXPECT_EQ(row[0][0].as<std::string>(),
            "type.googleapis.com/outbox.v1.OrderPaid");
  v1::OrderPaid paid;
  ASSERT_TRUE(paid.ParseFromString(pqxx::binarystring(row[0][1]).str()));
  EXPECT_EQ(paid.amount_cents(), 700);
}

}  // namespace
}  // namespace outbox::consumer
