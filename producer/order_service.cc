#include "producer/order_service.h"

#include <grpc/support/time.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/ids.h"
#include "common/server.h"
#include "producer/order_logic.h"

namespace outbox::producer {

Waiter WaiterOf(grpc::CallbackServerContext* ctx) {
  Waiter waiter;
  const gpr_timespec deadline =
      gpr_convert_clock_type(ctx->raw_deadline(), GPR_CLOCK_REALTIME);
  if (gpr_time_cmp(deadline, gpr_inf_future(GPR_CLOCK_REALTIME)) != 0) {
    waiter.deadline = absl::FromUnixSeconds(deadline.tv_sec) +
                      absl::Nanoseconds(deadline.tv_nsec);
  }
  // Safe from any thread, in the callback API, until the call finishes.
  waiter.cancelled = [ctx] { return ctx->IsCancelled(); };
  return waiter;
}

std::string TraceParentFrom(const grpc::ServerContextBase& ctx) {
  auto it = ctx.client_metadata().find("traceparent");
  if (it != ctx.client_metadata().end()) {
    std::string value(it->second.data(), it->second.size());
    if (IsTraceParent(value)) return value;
  }
  return NewTraceParent();
}

OrderServiceImpl::OrderServiceImpl(OrderStore* store, Metrics* metrics,
                                   WorkerPool* workers, Watchdog* watchdog,
                                   const CallerCheck* check)
    : store_(store),
      metrics_(metrics),
      workers_(workers),
      watchdog_(watchdog),
      check_(check) {
  // Visible from the first scrape, before any call.
  for (const char* method :
       {"CreateOrder", "PayOrder", "CancelOrder", "GetOrder"}) {
    CallCounter(method, absl::StatusCode::kOk);
  }
}

Counter* OrderServiceImpl::CallCounter(const char* method,
                                       absl::StatusCode code) {
  return metrics_->AddCounter(
      absl::StrCat("outbox_producer_requests_total{method=\"", method,
                   "\",code=\"", absl::StatusCodeToString(code), "\"}"),
      "OrderService calls by method and status code.");
}

void OrderServiceImpl::Finish(grpc::ServerUnaryReactor* reactor,
                              const char* method, absl::Time start,
                              const absl::Status& s) {
  CallCounter(method, s.code())->Add();
  metrics_
      ->AddHistogram(
          absl::StrCat("outbox_producer_request_duration_seconds{method=\"",
                       method, "\"}"),
          "OrderService call latency, from the request to the answer.",
          Histogram::LatencyBuckets())
      ->Observe(absl::ToDoubleSeconds(absl::Now() - start));
  if (s.code() == absl::StatusCode::kUnavailable ||
      s.code() == absl::StatusCode::kInternal) {
    spdlog::warn("{}: {}", method, s.ToString());
  }
  reactor->Finish(ToGrpcStatus(s));
}

grpc::Status OrderServiceImpl::Refused(grpc::CallbackServerContext* ctx,
                                       const char* method) {
  grpc::Status a = Admit(check_, ctx, Access::kCall,
                         absl::StrCat("OrderService.", method).c_str());
  if (!a.ok()) {
    CallCounter(method, static_cast<absl::StatusCode>(a.error_code()))->Add();
  }
  return a;
}

void OrderServiceImpl::Watch(const absl::Status& s) {
  if (watchdog_ == nullptr) return;
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDeadlineExceeded:   // waited for it in vain
    case absl::StatusCode::kResourceExhausted:  // refused: it keeps no pace
    case absl::StatusCode::kDataLoss:
      watchdog_->Failed(s);
      break;
    case absl::StatusCode::kCancelled:
      break;  // the caller went away: nothing said of the database
    default:
      watchdog_->Done();  // the database answered
  }
}

OrderStore::Done OrderServiceImpl::Answer(grpc::ServerUnaryReactor* reactor,
                                          const char* method, absl::Time start,
                                          v1::Order* order) {
  if (watchdog_ != nullptr) watchdog_->Working();
  return [=](absl::StatusOr<v1::Order> result) {
    Watch(result.status());
    if (result.ok()) *order = std::move(*result);
    Finish(reactor, method, start, result.status());
  };
}

void OrderServiceImpl::OnWorker(
    grpc::ServerUnaryReactor* reactor, const char* method, absl::Time start,
    v1::Order* order, Waiter waiter,
    std::function<absl::StatusOr<v1::Order>()> call) {
  const bool queued =
      workers_->Post([call = std::move(call), waiter = std::move(waiter),
                      done = Answer(reactor, method, start, order)] {
        // A call that waited in the queue past its caller asks nothing of
        // the database.
        absl::Status waiting = StillWaiting(waiter, absl::Now());
        done(waiting.ok() ? call() : absl::StatusOr<v1::Order>(waiting));
      });
  if (!queued) {
    Finish(reactor, method, start,
           absl::ResourceExhaustedError("too many calls in progress; retry"));
  }
}

grpc::ServerUnaryReactor* OrderServiceImpl::CreateOrder(
    grpc::CallbackServerContext* ctx, const v1::CreateOrderRequest* req,
    v1::CreateOrderResponse* resp) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (grpc::Status a = Refused(ctx, "CreateOrder"); !a.ok()) {
    reactor->Finish(a);
    return reactor;
  }
  absl::StatusOr<int64_t> total = ValidateCreate(*req);
  if (!total.ok()) {
    Finish(reactor, "CreateOrder", start, total.status());
    return reactor;
  }
  store_->CreateAsync(
      *req, *total, TraceParentFrom(*ctx),
      Answer(reactor, "CreateOrder", start, resp->mutable_order()),
      WaiterOf(ctx));
  return reactor;
}

grpc::ServerUnaryReactor* OrderServiceImpl::PayOrder(
    grpc::CallbackServerContext* ctx, const v1::PayOrderRequest* req,
    v1::PayOrderResponse* resp) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (grpc::Status a = Refused(ctx, "PayOrder"); !a.ok()) {
    reactor->Finish(a);
  } else if (absl::Status s = ValidatePay(*req); !s.ok()) {
    Finish(reactor, "PayOrder", start, s);
  } else {
    store_->PayAsync(*req, TraceParentFrom(*ctx),
                     Answer(reactor, "PayOrder", start, resp->mutable_order()),
                     WaiterOf(ctx));
  }
  return reactor;
}

grpc::ServerUnaryReactor* OrderServiceImpl::CancelOrder(
    grpc::CallbackServerContext* ctx, const v1::CancelOrderRequest* req,
    v1::CancelOrderResponse* resp) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (grpc::Status a = Refused(ctx, "CancelOrder"); !a.ok()) {
    reactor->Finish(a);
  } else if (absl::Status s = ValidateCancel(*req); !s.ok()) {
    Finish(reactor, "CancelOrder", start, s);
  } else {
    store_->CancelAsync(
        *req, TraceParentFrom(*ctx),
        Answer(reactor, "CancelOrder", start, resp->mutable_order()),
        WaiterOf(ctx));
  }
  return reactor;
}

grpc::ServerUnaryReactor* OrderServiceImpl::GetOrder(
    grpc::CallbackServerContext* ctx, const v1::GetOrderRequest* req,
    v1::GetOrderResponse* resp) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (grpc::Status a = Refused(ctx, "GetOrder"); !a.ok()) {
    reactor->Finish(a);
  } else if (absl::Status s = ValidateOrderId(req->order_id()); !s.ok()) {
    Finish(reactor, "GetOrder", start, s);
  } else {
    OnWorker(reactor, "GetOrder", start, resp->mutable_order(), WaiterOf(ctx),
             [this, req] { return store_->Get(req->order_id()); });
  }
  return reactor;
}

}  // namespace outbox::producer
