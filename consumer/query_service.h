#pragma once
// BillingQuery: the demo consumer's query API. Stats and held events read
// the inbox engine's tables, whatever the handler; the order view is the
// billing handler's, and answers UNIMPLEMENTED under another handler.

#include <string>

#include "common/db.h"
#include "common/identity.h"
#include "common/metrics.h"
#include "inbox/engine.h"
#include "outbox/v1/billing.grpc.pb.h"

namespace outbox::consumer {

class BillingQueryImpl final : public v1::BillingQuery::Service {
 public:
  // `db` should be a pool of its own, so that queries never take the
  // connections delivery needs. `handler` names the consumer's handler.
  // `check` may be null (every caller admitted); `engine` (for actions on
  // held events) may be null: they answer UNIMPLEMENTED.
  BillingQueryImpl(Database* db, Metrics* metrics, std::string handler,
                   const CallerCheck* check = nullptr,
                   inbox::Engine* engine = nullptr);

  grpc::Status GetOrderView(grpc::ServerContext* ctx,
                            const v1::GetOrderViewRequest* req,
                            v1::GetOrderViewResponse* resp) override;
  grpc::Status GetStats(grpc::ServerContext* ctx,
                        const v1::GetConsumerStatsRequest* req,
                        v1::ConsumerStats* resp) override;
  grpc::Status ListHeldEvents(grpc::ServerContext* ctx,
                              const v1::ListHeldEventsRequest* req,
                              v1::ListHeldEventsResponse* resp) override;
  grpc::Status ReleaseHeldEvent(grpc::ServerContext* ctx,
                                const v1::HeldEventActionRequest* req,
                                v1::HeldEventActionResponse* resp) override;
  grpc::Status SkipHeldEvent(grpc::ServerContext* ctx,
                             const v1::HeldEventActionRequest* req,
                             v1::HeldEventActionResponse* resp) override;

 private:
  Database* const db_;
  Metrics* const metrics_;
  const std::string handler_;
  const CallerCheck* const check_;
  inbox::Engine* const engine_;

  // Release or skip (`skip`), after the admin check and the request's.
  grpc::Status Act(grpc::ServerContext* ctx, const char* method, bool skip,
                   const v1::HeldEventActionRequest* req,
                   v1::HeldEventActionResponse* resp);
};

}  // namespace outbox::consumer
