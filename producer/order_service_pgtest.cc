// OrderService over real gRPC on loopback against a real PostgreSQL: status
// codes as the contract gives them, reflection, health and trace context.

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/schema.h"
#include "common/server.h"
#include "producer/order_schema.h"
#include "producer/order_service.h"
#include "tests/testing/grpc.h"
#include "tests/testing/pg.h"

namespace outbox::producer {
namespace {

// A producer served on a free loopback port against `db_url`.
class Producer {
 public:
  explicit Producer(const std::string& db_url)
      : db_(db_url, 4, "order-service-test"),
        store_(&db_, &writer_),
        workers_(3, 64),
        service_(&store_, &metrics_, &workers_) {
    auto server =
        GrpcServer::Start({"127.0.0.1:0", absl::Seconds(2)},
                          {{&service_, v1::OrderService::service_full_name()}});
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = testing::Loopback(server_->port());
    stub_ = v1::OrderService::NewStub(channel_);
  }
  v1::OrderService::Stub* stub() { return stub_.get(); }
  grpc::Channel* channel() { return channel_.get(); }
  GrpcServer* server() { return server_.get(); }

 private:
  Database db_;
  Writer writer_;
  OrderStore store_;
  Metrics metrics_;
  WorkerPool workers_;
  OrderServiceImpl service_;
  std::unique_ptr<GrpcServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::OrderService::Stub> stub_;
};

v1::CreateOrderRequest Request() {
  v1::CreateOrderRequest r;
  r.set_customer_id("c-9");
  r.set_currency("USD");
  auto* i = r.add_items();
  i->set_sku("mug");
  i->set_quantity(1);
  i->set_unit_price_cents(800);
  return r;
}

class OrderServiceTest : public ::testing::Test {
 protected:
  OrderServiceTest() : tdb_("svc", OrdersSchemas()), producer_(tdb_.url()) {}

  grpc::Status Create(const v1::CreateOrderRequest& req, v1::Order* out,
                      const std::string& traceparent = "") {
    grpc::ClientContext ctx;
    if (!traceparent.empty()) ctx.AddMetadata("traceparent", traceparent);
    v1::CreateOrderResponse resp;
    grpc::Status s = producer_.stub()->CreateOrder(&ctx, req, &resp);
    if (out != nullptr) *out = resp.order();
    return s;
  }

  int64_t Rows() {
    return tdb_.Scalar(
        "SELECT (SELECT count(*) FROM orders) + (SELECT count(*) FROM outbox)");
  }

  testing::TestDatabase tdb_;
  Producer producer_;
};

TEST_F(OrderServiceTest,
       BadInputIsInvalidArgumentNamingTheFieldAndWritesNothing) {
  struct Case {
    const char* field;
    void (*mutate)(v1::CreateOrderRequest&);
  };
  const Case cases[] = {
      {"customer_id", [](auto& r) { r.clear_customer_id(); }},
      {"customer_id", [](auto& r) { r.set_customer_id("bad\ttab"); }},
      {"items", [](auto& r) { r.clear_items(); }},
      {"items[0].sku", [](auto& r) { r.mutable_items(0)->clear_sku(); }},
      {"items[0].quantity",
       [](auto& r) { r.mutable_items(0)->set_quantity(-3); }},
      {"items[0].unit_price_cents",
       [](auto& r) { r.mutable_items(0)->set_unit_price_cents(2000000000); }},
      {"currency", [](auto& r) { r.set_currency("usd"); }},
      {"idempotency_key",
       [](auto& r) { r.set_idempotency_key(std::string(200, 'k')); }},
  };
  for (const Case& c : cases) {
    v1::CreateOrderRequest req = Request();
    c.mutate(req);
    grpc::Status s = Create(req, nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_TRUE(absl::StartsWith(s.error_message(), absl::StrCat(c.field, ":")))
        << s.error_message();
  }
  grpc::ClientContext ctx;
  v1::GetOrderRequest get;
  get.set_order_id("not-a-uuid");
  v1::GetOrderResponse resp;
  EXPECT_EQ(producer_.stub()->GetOrder(&ctx, get, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Rows(), 0);
}

TEST_F(OrderServiceTest, LifecycleAndContractStatusCodes) {
  v1::Order order;
  ASSERT_TRUE(Create(Request(), &order).ok());
  EXPECT_EQ(order.total_cents(), 800);

  auto pay = [&](int64_t version, int64_t amount) {
    grpc::ClientContext ctx;
    v1::PayOrderRequest req;
    req.set_order_id(order.order_id());
    req.set_expected_version(version);
    req.set_amount_cents(amount);
    v1::PayOrderResponse resp;
    grpc::Status s = producer_.stub()->PayOrder(&ctx, req, &resp);
    if (s.ok()) order = resp.order();
    return s.error_code();
  };
  EXPECT_EQ(pay(1, 799), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(pay(7, 800), grpc::StatusCode::ABORTED);
  EXPECT_EQ(pay(1, 800), grpc::StatusCode::OK);
  EXPECT_EQ(order.status(), v1::ORDER_STATUS_PAID);
  EXPECT_EQ(pay(2, 800), grpc::StatusCode::FAILED_PRECONDITION);

  grpc::ClientContext ctx;
  v1::CancelOrderRequest cancel;
  cancel.set_order_id(NewUuid());
  v1::CancelOrderResponse cancelled;
  EXPECT_EQ(
      producer_.stub()->CancelOrder(&ctx, cancel, &cancelled).error_code(),
      grpc::StatusCode::NOT_FOUND);

  grpc::ClientContext get_ctx;
  v1::GetOrderRequest get;
  get.set_order_id(order.order_id());
  v1::GetOrderResponse got;
  ASSERT_TRUE(producer_.stub()->GetOrder(&get_ctx, get, &got).ok());
  EXPECT_EQ(got.order().version(), 2);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM outbox"), 2);
}

TEST_F(OrderServiceTest, StoresTheCallersTraceParent) {
  const std::string trace =
      "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
  ASSERT_TRUE(Create(Request(), nullptr, trace).ok());
  ASSERT_TRUE(Create(Request(), nullptr, "not a traceparent").ok());
  // Upper-case hex is not W3C: stored as sent, the logs would drop it.
  const std::string upper =
      "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01";
  ASSERT_TRUE(Create(Request(), nullptr, upper).ok());
  pqxx::result rows =
      tdb_.Query("SELECT trace_parent FROM outbox ORDER BY seq");
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0][0].as<std::string>(), trace);
  // An invalid one is replaced by a fresh trace, never stored as sent.
  EXPECT_TRUE(IsTraceParent(rows[1][0].as<std::string>()));
  EXPECT_NE(rows[2][0].as<std::string>(), upper);
  // Every stored trace is one the relay's and consumer's log lines carry.
  for (const auto& row : rows) {
    EXPECT_EQ(TraceIdOf(row[0].as<std::string>()),
              row[0].as<std::string>().substr(3, 32))
        << row[0].as<std::string>();
  }
}

TEST_F(OrderServiceTest, ReflectionAndHealth) {
  auto services = testing::ReflectedServices(producer_.channel());
  EXPECT_TRUE(services.count("outbox.v1.OrderService")) << services.size();
  EXPECT_TRUE(services.count("grpc.health.v1.Health"));
  EXPECT_TRUE(testing::ReflectionDescribes(producer_.channel(),
                                           "grpc.health.v1.Health"));
  EXPECT_TRUE(testing::ReflectionDescribes(producer_.channel(),
                                           "outbox.v1.OrderService"));
  EXPECT_EQ(testing::HealthStatus(producer_.channel()), "SERVING");
  EXPECT_EQ(
      testing::HealthStatus(producer_.channel(), "outbox.v1.OrderService"),
      "SERVING");
  producer_.server()->SetServing(false);
  EXPECT_EQ(testing::HealthStatus(producer_.channel()), "NOT_SERVING");
}

TEST(OrderServiceUnavailable, DatabaseDownIsUnavailable) {
  Producer producer("postgresql://127.0.0.1:1/outbox_orders");
  grpc::ClientContext ctx;
  v1::CreateOrderResponse resp;
  grpc::Status s = producer.stub()->CreateOrder(&ctx, Request(), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  // Still alive and answering.
  EXPECT_EQ(testing::HealthStatus(producer.channel()), "SERVING");
}

}  // namespace
}  // namespace outbox::producer
