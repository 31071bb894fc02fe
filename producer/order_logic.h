#pragma once
// The order domain without I/O: request validation and the state machine
// CREATED -> PAID -> CANCELLED, CREATED -> CANCELLED. Errors name the field
// and carry the gRPC-compatible code the service returns.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "outbox/v1/order.pb.h"

namespace outbox::producer {

inline constexpr int kMaxItems = 100;
inline constexpr int kMaxTextChars = 64;
inline constexpr int kMaxQuantity = 10000;
inline constexpr int64_t kMaxUnitPriceCents = 1000000000;
inline constexpr int kMaxIdempotencyKeyChars = 128;
inline constexpr int kMaxReasonChars = 500;

// InvalidArgument naming the first bad field of `req` (e.g.
// "items[2].quantity: must be between 1 and 10000, got 0"); else its total.
absl::StatusOr<int64_t> ValidateCreate(const v1::CreateOrderRequest& req);

// InvalidArgument unless `order_id` is a UUID.
absl::Status ValidateOrderId(const std::string& order_id);

absl::Status ValidatePay(const v1::PayOrderRequest& req);
absl::Status ValidateCancel(const v1::CancelOrderRequest& req);

// Aborted if `expected` is non-zero and differs from `actual`.
absl::Status CheckVersion(int64_t expected, int64_t actual);

// FailedPrecondition unless `from` -> `to` is an allowed transition.
absl::Status CheckTransition(v1::OrderStatus from, v1::OrderStatus to);

// The status's name as stored in the orders table ("CREATED", ...), and back.
std::string StatusName(v1::OrderStatus s);
v1::OrderStatus StatusFromName(absl::string_view name);

// A stable fingerprint of what CreateOrder was asked (the idempotency key
// aside), so that a key reused for a different order is refused.
std::string RequestFingerprint(const v1::CreateOrderRequest& req);

// The items as stored in orders.items (jsonb): a JSON array of
// {"sku", "quantity", "unitPriceCents"} objects, the names grpcurl shows.
std::string ItemsJson(
    const google::protobuf::RepeatedPtrField<v1::LineItem>& items);

// Reads what ItemsJson wrote, as PostgreSQL prints it back (any spacing or
// key order, JSON escapes), without a general JSON parser. InvalidArgument
// for anything else; `items` is cleared first.
absl::Status ParseItemsJson(
    absl::string_view json,
    google::protobuf::RepeatedPtrField<v1::LineItem>* items);

}  // namespace outbox::producer
