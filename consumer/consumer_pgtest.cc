// The consumer against a real PostgreSQL, through real gRPC on loopback where
// the stream matters: duplicates, out-of-order delivery, held events, two
// replicas racing, bad events, and the database going away.

#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/schema.h"
#include "common/server.h"
#include "consumer/applier.h"
#include "consumer/sink_service.h"
#include "tests/testing/grpc.h"
#include "tests/testing/pg.h"

namespace outbox::consumer {
namespace {

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
  auto* c = chain[0].mutable_order_created();
  c->set_order_id(id);
  c->set_customer_id("c");
  c->set_currency("EUR");
  c->set_total_cents(700);
  chain[1].mutable_order_paid()->set_order_id(id);
  chain[1].mutable_order_paid()->set_amount_cents(700);
  chain[1].mutable_order_paid()->set_currency("EUR");
  chain[2].mutable_order_cancelled()->set_order_id(id);
  chain[2].mutable_order_cancelled()->set_refund_cents(700);
  return chain;
}

class ConsumerTest : public ::testing::Test {
 protected:
  ConsumerTest()
      : tdb_("consumer", BillingMigrations()),
        db_(tdb_.url(), 4, "consumer-test"),
        applier_(&db_, &metrics_),
        sink_(&applier_),
        query_(&db_, &metrics_) {
    auto server = GrpcServer::Start(
        {"127.0.0.1:0", absl::Seconds(2)},
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
    auto stub = v1::EventSink::NewStub(channel_);
    grpc::ClientContext ctx;
    auto stream = stub->Deliver(&ctx);
    std::vector<v1::EventResult> out;
    uint64_t id = 0;
    for (const auto& batch : batches) {
      v1::DeliverRequest req;
      req.set_batch_id(++id);
      for (const auto& e : batch) *req.add_events() = e;
      if (!stream->Write(req)) break;
      v1::DeliverResponse resp;
      if (!stream->Read(&resp)) break;
      EXPECT_EQ(resp.batch_id(), id);
      for (const auto& r : resp.results()) out.push_back(r);
    }
    stream->WritesDone();
    grpc::Status s = stream->Finish();
    if (status != nullptr) *status = s;
    return out;
  }

  static std::vector<v1::DeliveryOutcome> Outcomes(
      const std::vector<v1::EventResult>& results) {
    std::vector<v1::DeliveryOutcome> out;
    for (const auto& r : results) out.push_back(r.outcome());
    return out;
  }

  // Every aggregate's inbox rows are in seq order by apply_id, and each
  // applied seq is the chain's next.
  void ExpectAppliedInOrder() {
    EXPECT_EQ(tdb_.Scalar(
                  "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION "
                  "BY aggregate_id ORDER BY apply_id) AS before FROM inbox) x "
                  "WHERE before >= seq"),
              0);
  }

  testing::TestDatabase tdb_;
  Database db_;
  Metrics metrics_;
  Applier applier_;
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

TEST_F(ConsumerTest, DuplicatesAreAnsweredAndHaveNoSecondEffect) {
  auto chain = OrderChain(1);
  Deliver({chain});
  auto again = Deliver({chain, {chain[1]}});
  EXPECT_EQ(Outcomes(again), (V{v1::DUPLICATE, v1::DUPLICATE, v1::DUPLICATE,
                                v1::DUPLICATE}));
  // Also inside one batch.
  auto other = OrderChain(10);
  auto twice = Deliver({{other[0], other[0], other[1], other[1]}});
  EXPECT_EQ(Outcomes(twice),
            (V{v1::APPLIED, v1::DUPLICATE, v1::APPLIED, v1::DUPLICATE}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 5);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM charges"), 3);
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

TEST_F(ConsumerTest, ShuffledDeliveryEndsInOrder) {
  std::vector<v1::Event> all;
  for (int i = 0; i < 40; ++i) {
    for (auto& e : OrderChain(1 + i * 3)) all.push_back(e);
  }
  std::mt19937 rng(20261129);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<std::vector<v1::Event>> batches;
  for (size_t i = 0; i < all.size(); i += 7) {
    batches.emplace_back(all.begin() + i,
                         all.begin() + std::min(all.size(), i + 7));
  }
  auto results = Deliver(batches);
  EXPECT_EQ(results.size(), all.size());
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 120);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM charges"), 80);
  ExpectAppliedInOrder();
}

TEST_F(ConsumerTest, TwoReplicasRacingOnOneAggregateNeverStrandAnEvent) {
  // Two appliers with their own connections, as two consumer processes
  // sharing the database. Each gets every event of each chain, in its own
  // random order, one event per transaction, so holds and applies of the
  // same aggregate interleave in every way.
  Database db2(tdb_.url(), 4, "consumer-test-2");
  Metrics m2;
  Applier second(&db2, &m2);
  std::vector<std::vector<v1::Event>> chains;
  for (int i = 0; i < 60; ++i) chains.push_back(OrderChain(1 + i * 10, 3));
  auto run = [&](Applier* a, unsigned seed) {
    std::vector<const v1::Event*> mine;
    for (const auto& c : chains)
      for (const auto& e : c) mine.push_back(&e);
    std::mt19937 rng(seed);
    std::shuffle(mine.begin(), mine.end(), rng);
    for (const v1::Event* e : mine) {
      auto r = a->ApplyBatch({e});
      ASSERT_TRUE(r.ok()) << r.status();
    }
  };
  std::thread t1(run, &applier_, 1), t2(run, &second, 2);
  t1.join();
  t2.join();
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 180);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM charges"), 120);
  ExpectAppliedInOrder();
}

TEST_F(ConsumerTest, BadEventsAreRejectedWithAReasonAndOthersApply) {
  auto chain = OrderChain(1);
  v1::Event unknown = chain[0];
  unknown.set_event_id(NewUuid());
  unknown.set_event_type("OrderTeleported");
  v1::Event no_payload = chain[0];
  no_payload.set_event_id(NewUuid());
  no_payload.clear_order_created();
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

TEST_F(ConsumerTest, OversizedBatchEndsTheStreamWithInvalidArgument) {
  std::vector<v1::Event> big;
  for (int i = 0; i < kMaxBatchEvents + 1; ++i) big.push_back(OrderChain(1)[0]);
  grpc::Status status;
  Deliver({big}, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 0);
}

TEST(ConsumerDown, UnreachableDatabaseEndsTheStreamUnavailable) {
  Database db("postgresql://127.0.0.1:1/outbox_billing", 1, "t");
  Metrics metrics;
  Applier applier(&db, &metrics);
  EventSinkImpl sink(&applier);
  auto server = GrpcServer::Start({"127.0.0.1:0", absl::Seconds(1)},
                                  {{&sink, v1::EventSink::service_full_name()}});
  ASSERT_TRUE(server.ok());
  auto stub = v1::EventSink::NewStub(testing::Loopback((*server)->port()));
  grpc::ClientContext ctx;
  auto stream = stub->Deliver(&ctx);
  v1::DeliverRequest req;
  *req.add_events() = OrderChain(1)[0];
  stream->Write(req);
  v1::DeliverResponse resp;
  EXPECT_FALSE(stream->Read(&resp));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace outbox::consumer
