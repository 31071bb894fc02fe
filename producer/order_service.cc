#include "producer/order_service.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/server.h"
#include "producer/order_logic.h"

namespace outbox::producer {

std::string TraceParentFrom(const grpc::ServerContext& ctx) {
  auto it = ctx.client_metadata().find("traceparent");
  if (it != ctx.client_metadata().end()) {
    std::string value(it->second.data(), it->second.size());
    if (IsTraceParent(value)) return value;
  }
  return NewTraceParent();
}

OrderServiceImpl::OrderServiceImpl(OrderStore* store, Metrics* metrics,
                                   Watchdog* watchdog,
                                   const CallerCheck* check)
    : store_(store), metrics_(metrics), watchdog_(watchdog), check_(check) {
  // Visible from the first scrape, before any call.
  for (const char* method : {"CreateOrder", "PayOrder", "CancelOrder", "GetOrder"}) {
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

grpc::Status OrderServiceImpl::Finish(const char* method,
                                      const absl::Status& s) {
  CallCounter(method, s.code())->Add();
  if (s.code() == absl::StatusCode::kUnavailable ||
      s.code() == absl::StatusCode::kInternal) {
    spdlog::warn("{}: {}", method, s.ToString());
  }
  return ToGrpcStatus(s);
}

grpc::Status OrderServiceImpl::Refused(grpc::ServerContext* ctx,
                                       const char* method) {
  grpc::Status a = Admit(check_, ctx, Access::kCall,
                         absl::StrCat("OrderService.", method).c_str());
  if (!a.ok()) {
    CallCounter(method, static_cast<absl::StatusCode>(a.error_code()))->Add();
  }
  return a;
}

const absl::Status& OrderServiceImpl::Watch(const absl::Status& s) {
  if (watchdog_ == nullptr) return s;
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kDataLoss:
      watchdog_->Failed(s);
      break;
    default:
      watchdog_->Done();  // the database answered
  }
  return s;
}

grpc::Status OrderServiceImpl::CreateOrder(grpc::ServerContext* ctx,
                                           const v1::CreateOrderRequest* req,
                                           v1::CreateOrderResponse* resp) {
  if (grpc::Status a = Refused(ctx, "CreateOrder"); !a.ok()) return a;
  absl::StatusOr<int64_t> total = ValidateCreate(*req);
  if (!total.ok()) return Finish("CreateOrder", total.status());
  if (watchdog_ != nullptr) watchdog_->Working();
  auto order = store_->Create(*req, *total, TraceParentFrom(*ctx));
  Watch(order.status());
  if (order.ok()) *resp->mutable_order() = std::move(*order);
  return Finish("CreateOrder", order.status());
}

grpc::Status OrderServiceImpl::PayOrder(grpc::ServerContext* ctx,
                                        const v1::PayOrderRequest* req,
                                        v1::PayOrderResponse* resp) {
  if (grpc::Status a = Refused(ctx, "PayOrder"); !a.ok()) return a;
  if (absl::Status s = ValidatePay(*req); !s.ok()) return Finish("PayOrder", s);
  if (watchdog_ != nullptr) watchdog_->Working();
  auto order = store_->Pay(*req, TraceParentFrom(*ctx));
  Watch(order.status());
  if (order.ok()) *resp->mutable_order() = std::move(*order);
  return Finish("PayOrder", order.status());
}

grpc::Status OrderServiceImpl::CancelOrder(grpc::ServerContext* ctx,
                                           const v1::CancelOrderRequest* req,
                                           v1::CancelOrderResponse* resp) {
  if (grpc::Status a = Refused(ctx, "CancelOrder"); !a.ok()) return a;
  if (absl::Status s = ValidateCancel(*req); !s.ok()) {
    return Finish("CancelOrder", s);
  }
  if (watchdog_ != nullptr) watchdog_->Working();
  auto order = store_->Cancel(*req, TraceParentFrom(*ctx));
  Watch(order.status());
  if (order.ok()) *resp->mutable_order() = std::move(*order);
  return Finish("CancelOrder", order.status());
}

grpc::Status OrderServiceImpl::GetOrder(grpc::ServerContext* ctx,
                                        const v1::GetOrderRequest* req,
                                        v1::GetOrderResponse* resp) {
  if (grpc::Status a = Refused(ctx, "GetOrder"); !a.ok()) return a;
  if (absl::Status s = ValidateOrderId(req->order_id()); !s.ok()) {
    return Finish("GetOrder", s);
  }
  if (watchdog_ != nullptr) watchdog_->Working();
  auto order = store_->Get(req->order_id());
  Watch(order.status());
  if (order.ok()) *resp->mutable_order() = std::move(*order);
  return Finish("GetOrder", order.status());
}

}  // namespace outbox::producer
