// Fuzzes the producer's request validation with arbitrary wire bytes: the
// first byte picks the request (CreateOrder, PayOrder, CancelOrder,
// GetOrder), the rest is parsed as its protobuf. Nothing may crash, and what
// validation accepts must be what the service can store: a total that is
// the exact sum of its items and fits, fields within their bounds.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "producer/order_logic.h"

namespace {

// Fails the run, saying which property broke.
#define Require(cond)                                                   \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "%s:%d: violated: %s\n", __FILE__, __LINE__, \
                   #cond);                                              \
      std::abort();                                                     \
    }                                                                   \
  } while (0)

void CheckCreate(const outbox::v1::CreateOrderRequest& req) {
  absl::StatusOr<int64_t> total = outbox::producer::ValidateCreate(req);
  if (!total.ok()) {
    Require(total.status().code() == absl::StatusCode::kInvalidArgument);
    Require(!total.status().message().empty());
    return;
  }
  Require(req.items_size() >= 1 && req.items_size() <= 100);
  __int128 sum = 0;
  for (const auto& item : req.items()) {
    Require(item.quantity() >= 1 && item.unit_price_cents() >= 0);
    sum += static_cast<__int128>(item.quantity()) * item.unit_price_cents();
  }
  Require(sum == *total && *total >= 0);
  Require(req.currency().size() == 3);
  Require(!req.customer_id().empty() && req.customer_id().size() <= 64);
  // The idempotency fingerprint is a function of the request.
  Require(outbox::producer::RequestFingerprint(req) ==
          outbox::producer::RequestFingerprint(req));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const char* body = reinterpret_cast<const char*>(data + 1);
  const int n = static_cast<int>(size - 1);
  switch (data[0] % 4) {
    case 0: {
      outbox::v1::CreateOrderRequest req;
      if (req.ParseFromArray(body, n)) CheckCreate(req);
      break;
    }
    case 1: {
      outbox::v1::PayOrderRequest req;
      if (req.ParseFromArray(body, n)) {
        absl::Status s = outbox::producer::ValidatePay(req);
        Require(s.ok() || s.code() == absl::StatusCode::kInvalidArgument);
        if (s.ok())
          Require(outbox::producer::ValidateOrderId(req.order_id()).ok());
      }
      break;
    }
    case 2: {
      outbox::v1::CancelOrderRequest req;
      if (req.ParseFromArray(body, n)) {
        absl::Status s = outbox::producer::ValidateCancel(req);
        Require(s.ok() || s.code() == absl::StatusCode::kInvalidArgument);
        if (s.ok()) Require(req.reason().size() <= 500);
      }
      break;
    }
    default: {
      outbox::v1::GetOrderRequest req;
      if (req.ParseFromArray(body, n)) {
        absl::Status s = outbox::producer::ValidateOrderId(req.order_id());
        Require(s.ok() || s.code() == absl::StatusCode::kInvalidArgument);
      }
    }
  }
  return 0;
}
