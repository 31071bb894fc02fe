#pragma once
// The orders repository: each state change and its outbox event commit in
// one PostgreSQL transaction. The event's prev_seq is read from the order
// row under its row lock, so events of one order form a chain and an
// event is only ever visible after its predecessor has committed.

#include <string>

#include "absl/status/statusor.h"
#include "common/db.h"
#include "outbox/v1/event.pb.h"
#include "outbox/v1/order.pb.h"

namespace outbox::producer {

// The NOTIFY channel that wakes relays; the payload is the partition.
inline constexpr char kNotifyChannel[] = "outbox_events";

class OrderStore {
 public:
  // `db` must outlive the store. `notify` adds a NOTIFY to each write
  // transaction (it takes a brief global lock at commit).
  OrderStore(Database* db, bool notify);

  // Requests must have passed ValidateCreate/ValidatePay/ValidateCancel.
  // `trace_parent` is stored with the event.
  //
  // Create with an idempotency key seen before returns the first order and
  // writes nothing; InvalidArgument if that key was used for a different
  // request.
  absl::StatusOr<v1::Order> Create(const v1::CreateOrderRequest& req,
                                   int64_t total_cents,
                                   const std::string& trace_parent);
  // NotFound, Aborted (stale expected_version), FailedPrecondition
  // (illegal transition) or InvalidArgument (amount differs from the total).
  absl::StatusOr<v1::Order> Pay(const v1::PayOrderRequest& req,
                                const std::string& trace_parent);
  absl::StatusOr<v1::Order> Cancel(const v1::CancelOrderRequest& req,
                                   const std::string& trace_parent);
  absl::StatusOr<v1::Order> Get(const std::string& order_id);

 private:
  Database* const db_;
  const bool notify_;
};

}  // namespace outbox::producer
