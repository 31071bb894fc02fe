#pragma once
// outbox.v1.OrderService over gRPC: translates requests and statuses; the
// rules live in order_logic and the writes in OrderStore.

#include "common/identity.h"
#include "common/metrics.h"
#include "common/watchdog.h"
#include "outbox/v1/order.grpc.pb.h"
#include "producer/order_store.h"

namespace outbox::producer {

class OrderServiceImpl final : public v1::OrderService::Service {
 public:
  // `store` and `metrics` must outlive the service; so must `watchdog` (may
  // be null), which hears whether calls that reach the database succeed.
  OrderServiceImpl(OrderStore* store, Metrics* metrics,
                   Watchdog* watchdog = nullptr,
                   const CallerCheck* check = nullptr);

  grpc::Status CreateOrder(grpc::ServerContext* ctx,
                           const v1::CreateOrderRequest* req,
                           v1::CreateOrderResponse* resp) override;
  grpc::Status PayOrder(grpc::ServerContext* ctx, const v1::PayOrderRequest* req,
                        v1::PayOrderResponse* resp) override;
  grpc::Status CancelOrder(grpc::ServerContext* ctx,
                           const v1::CancelOrderRequest* req,
                           v1::CancelOrderResponse* resp) override;
  grpc::Status GetOrder(grpc::ServerContext* ctx, const v1::GetOrderRequest* req,
                        v1::GetOrderResponse* resp) override;

 private:
  // Counts the call by method and code, logs failures that are ours.
  grpc::Status Finish(const char* method, const absl::Status& s);
  // The caller check's refusal of `method`, counted; OK when admitted.
  grpc::Status Refused(grpc::ServerContext* ctx, const char* method);
  // Tells the watchdog how a call that reached the database ended.
  const absl::Status& Watch(const absl::Status& s);
  Counter* CallCounter(const char* method, absl::StatusCode code);

  OrderStore* const store_;
  Metrics* const metrics_;
  Watchdog* const watchdog_;
  const CallerCheck* const check_;
};

// The request's W3C traceparent metadata if valid, else a new one.
std::string TraceParentFrom(const grpc::ServerContext& ctx);

}  // namespace outbox::producer
