#pragma once
// The orders repository: each state change and its outbox event commit in
// one PostgreSQL transaction; the outbox writer (writer/writer.h) appends
// the event and keeps each order's chain of events.

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/db.h"
#include "common/group_commit.h"
#include "common/metrics.h"
#include "outbox/v1/order.pb.h"
#include "writer/writer.h"

namespace outbox::producer {

struct OrderStoreOptions {
  // Concurrent CreateOrder calls share one statement and one commit (group
  // commit); this many groups are written at once, at most.
  GroupCommitOptions create_groups;
  // Concurrent PayOrder and CancelOrder calls share one transaction: their
  // orders locked by one statement, changed by one, their events appended
  // by one.
  GroupCommitOptions change_groups;
};

class OrderStore {
 public:
  // `db` and `writer` must outlive the store; so must `metrics` (may be
  // null).
  OrderStore(Database* db, Writer* writer, OrderStoreOptions options = {},
             Metrics* metrics = nullptr);

  // Requests must have passed ValidateCreate/ValidatePay/ValidateCancel.
  // `trace_parent` is stored with the event.
  //
  // Create with an idempotency key seen before returns the first order and
  // writes nothing; InvalidArgument if that key was used for a different
  // request.
  absl::StatusOr<v1::Order> Create(const v1::CreateOrderRequest& req,
                                   int64_t total_cents,
                                   const std::string& trace_parent);
  // Gets the result of an asynchronous call.
  using Done = std::function<void(absl::StatusOr<v1::Order>)>;
  // Create without waiting: queues the order for the next group commit;
  // `done` gets the result on the store's writer thread. `req` must stay
  // valid until then. Never blocks on the database.
  void CreateAsync(const v1::CreateOrderRequest& req, int64_t total_cents,
                   const std::string& trace_parent, Done done);
  // NotFound, Aborted (stale expected_version), FailedPrecondition
  // (illegal transition) or InvalidArgument (amount differs from the total).
  // Each is decided against the order as committed changes and those before
  // it in its group left it; a refused change writes nothing and fails
  // nothing else.
  absl::StatusOr<v1::Order> Pay(const v1::PayOrderRequest& req,
                                const std::string& trace_parent);
  absl::StatusOr<v1::Order> Cancel(const v1::CancelOrderRequest& req,
                                   const std::string& trace_parent);
  // Pay and Cancel without waiting: queued for the next group commit;
  // `done` gets the result on the store's writer thread. Never blocks on
  // the database.
  void PayAsync(const v1::PayOrderRequest& req, const std::string& trace_parent,
                Done done);
  void CancelAsync(const v1::CancelOrderRequest& req,
                   const std::string& trace_parent, Done done);
  absl::StatusOr<v1::Order> Get(const std::string& order_id);

 private:
  // One change of an existing order: its version and transition are
  // checked, then `event` checks the request against the order and makes
  // the event.
  struct OrderChange {
    std::string order_id;
    int64_t expected_version = 0;
    v1::OrderStatus to = v1::ORDER_STATUS_UNSPECIFIED;
    std::string trace_parent;
    std::function<absl::StatusOr<NewEvent>(const v1::Order&)> event;
  };
  // Writes the changes of a group in one transaction: locks their orders
  // (sorted), decides each in arrival order, updates each order once and
  // appends the events in order. One result per change. A data error of
  // the group is retried change by change, so that only the culprit fails.
  std::vector<absl::StatusOr<v1::Order>> WriteChanges(
      const std::vector<const OrderChange*>& group);

  // The order of a Create whose idempotency key was taken: the first one if
  // it came from the same request.
  absl::StatusOr<v1::Order> OrderForKey(const v1::CreateOrderRequest& req,
                                        const std::string& fingerprint);

  // One CreateOrder's write, ready to join a group.
  struct NewOrder {
    const v1::CreateOrderRequest* req;
    int64_t total_cents;
    std::string order_id, fingerprint, items_json;
    NewEvent event;
  };
  // Inserts the orders of a group and their events in one transaction; one
  // result per order: its created_at in microseconds, or nothing when its
  // idempotency key was taken. A data error of the group is retried order
  // by order, so that only the culprit fails.
  std::vector<absl::StatusOr<std::optional<int64_t>>> InsertOrders(
      const std::vector<const NewOrder*>& group);

  Database* const db_;
  Writer* const writer_;
  GroupCommit<NewOrder, std::optional<int64_t>> create_commit_;
  GroupCommit<OrderChange, v1::Order> change_commit_;
};

}  // namespace outbox::producer
