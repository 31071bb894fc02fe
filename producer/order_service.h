#pragma once
// outbox.v1.OrderService over gRPC (the callback API): translates requests
// and statuses; the rules live in order_logic and the writes in OrderStore.
// No handler waits on the database on gRPC's threads: CreateOrder, PayOrder
// and CancelOrder are queued for the store's group commits and answered from
// their writer threads; GetOrder runs on a worker pool. Each queue is
// bounded, and a call whose deadline passed (or that was cancelled) while it
// waited is answered without reaching the database.

#include "common/identity.h"
#include "common/metrics.h"
#include "common/watchdog.h"
#include "common/worker_pool.h"
#include "outbox/v1/order.grpc.pb.h"
#include "producer/order_store.h"

namespace outbox::producer {

class OrderServiceImpl final : public v1::OrderService::CallbackService {
 public:
  // `store`, `metrics` and `workers` must outlive the service; so must
  // `watchdog` (may be null), which hears whether calls that reach the
  // database succeed, and `check` (may be null: every caller admitted).
  OrderServiceImpl(OrderStore* store, Metrics* metrics, WorkerPool* workers,
                   Watchdog* watchdog = nullptr,
                   const CallerCheck* check = nullptr);

  grpc::ServerUnaryReactor* CreateOrder(grpc::CallbackServerContext* ctx,
                                        const v1::CreateOrderRequest* req,
                                        v1::CreateOrderResponse* resp) override;
  grpc::ServerUnaryReactor* PayOrder(grpc::CallbackServerContext* ctx,
                                     const v1::PayOrderRequest* req,
                                     v1::PayOrderResponse* resp) override;
  grpc::ServerUnaryReactor* CancelOrder(grpc::CallbackServerContext* ctx,
                                        const v1::CancelOrderRequest* req,
                                        v1::CancelOrderResponse* resp) override;
  grpc::ServerUnaryReactor* GetOrder(grpc::CallbackServerContext* ctx,
                                     const v1::GetOrderRequest* req,
                                     v1::GetOrderResponse* resp) override;

 private:
  // Counts the call by method and code and its duration, logs failures that
  // are ours, and finishes the call.
  void Finish(grpc::ServerUnaryReactor* reactor, const char* method,
              absl::Time start, const absl::Status& s);
  Counter* CallCounter(const char* method, absl::StatusCode code);
  // The caller check's refusal of `method`; OK when admitted.
  grpc::Status Refused(grpc::CallbackServerContext* ctx, const char* method);
  // Tells the watchdog how a call that reached the database ended.
  void Watch(const absl::Status& s);
  // The end of a call that reached the store: tells the watchdog the call
  // is working now; the callback it returns tells it how the call ended,
  // fills `order` and finishes.
  OrderStore::Done Answer(grpc::ServerUnaryReactor* reactor, const char* method,
                          absl::Time start, v1::Order* order);
  // Runs `call` (which returns the order or why not) on a worker, then
  // answers as Answer does; if `waiter` stopped waiting before a worker was
  // free, answers why instead of running `call`.
  void OnWorker(grpc::ServerUnaryReactor* reactor, const char* method,
                absl::Time start, v1::Order* order, Waiter waiter,
                std::function<absl::StatusOr<v1::Order>()> call);

  OrderStore* const store_;
  Metrics* const metrics_;
  WorkerPool* const workers_;
  Watchdog* const watchdog_;
  const CallerCheck* const check_;
};

// The request's W3C traceparent metadata if valid, else a new one.
std::string TraceParentFrom(const grpc::ServerContextBase& ctx);

// Who waits for the call: its deadline (none if the client set none) and
// whether it was cancelled. Valid until the call is finished.
Waiter WaiterOf(grpc::CallbackServerContext* ctx);

}  // namespace outbox::producer
