#pragma once
// The consumer's gRPC surface: EventSink.Deliver (the relay's stream) and
// BillingQuery (order view, stats, held events). Both translate only; the
// rules are in Applier.

#include "common/db.h"
#include "common/identity.h"
#include "common/metrics.h"
#include "consumer/applier.h"
#include "outbox/v1/consumer.grpc.pb.h"

namespace outbox::consumer {

// Largest batch one DeliverRequest may carry.
inline constexpr int kMaxBatchEvents = 1000;

class EventSinkImpl final : public v1::EventSink::Service {
 public:
  // `applier` and `check` (may be null: every caller admitted) must outlive
  // the service.
  explicit EventSinkImpl(Applier* applier, const CallerCheck* check = nullptr);

  // Reads batches, applies each in one transaction, answers after commit.
  // Ends the stream with the database's status (e.g. UNAVAILABLE) when a
  // batch cannot be committed, so the relay retries it elsewhere or later.
  grpc::Status Deliver(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DeliverResponse, v1::DeliverRequest>* stream)
      override;

 private:
  Applier* const applier_;
  const CallerCheck* const check_;
};

class BillingQueryImpl final : public v1::BillingQuery::Service {
 public:
  // `db` should be a pool of its own, so that queries never take the
  // connections delivery needs. `check` may be null (every caller admitted).
  BillingQueryImpl(Database* db, Metrics* metrics,
                   const CallerCheck* check = nullptr);

  grpc::Status GetOrderView(grpc::ServerContext* ctx,
                            const v1::GetOrderViewRequest* req,
                            v1::GetOrderViewResponse* resp) override;
  grpc::Status GetStats(grpc::ServerContext* ctx,
                        const v1::GetConsumerStatsRequest* req,
                        v1::ConsumerStats* resp) override;
  grpc::Status ListHeldEvents(grpc::ServerContext* ctx,
                              const v1::ListHeldEventsRequest* req,
                              v1::ListHeldEventsResponse* resp) override;

 private:
  Database* const db_;
  Metrics* const metrics_;
  const CallerCheck* const check_;
};

}  // namespace outbox::consumer
