#pragma once
// The consumer's gRPC surface: EventSink.Deliver (the relay's stream) and
// BillingQuery (order view, stats, held events). Both translate only; the
// rules are in Applier.

#include "common/db.h"
#include "common/metrics.h"
#include "consumer/applier.h"
#include "outbox/v1/consumer.grpc.pb.h"

namespace outbox::consumer {

// Largest batch one DeliverRequest may carry.
inline constexpr int kMaxBatchEvents = 1000;

class EventSinkImpl final : public v1::EventSink::Service {
 public:
  // `applier` must outlive the service.
  explicit EventSinkImpl(Applier* applier);

  // Reads batches, applies each in one transaction, answers after commit.
  // Ends the stream with the database's status (e.g. UNAVAILABLE) when a
  // batch cannot be committed, so the relay retries it elsewhere or later.
  grpc::Status Deliver(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DeliverResponse, v1::DeliverRequest>* stream)
      override;

 private:
  Applier* const applier_;
};

class BillingQueryImpl final : public v1::BillingQuery::Service {
 public:
  BillingQueryImpl(Database* db, Metrics* metrics);

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
};

}  // namespace outbox::consumer
