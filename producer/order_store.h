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
  // Create without waiting: queues the order for the next group commit;
  // `done` gets the result on the store's writer thread. `req` must stay
  // valid until then. Never blocks on the database.
  void CreateAsync(const v1::CreateOrderRequest& req, int64_t total_cents,
                   const std::string& trace_parent,
                   std::function<void(absl::StatusOr<v1::Order>)> done);
  // NotFound, Aborted (stale expected_version), FailedPrecondition
  // (illegal transition) or InvalidArgument (amount differs from the total).
  absl::StatusOr<v1::Order> Pay(const v1::PayOrderRequest& req,
                                const std::string& trace_parent);
  absl::StatusOr<v1::Order> Cancel(const v1::CancelOrderRequest& req,
                                   const std::string& trace_parent);
  absl::StatusOr<v1::Order> Get(const std::string& order_id);

 private:
  // One change of an existing order: lock, check version and transition,
  // let `event` check the request against the order and make the event,
  // then update the order and append the event in one commit.
  absl::StatusOr<v1::Order> Change(
      const std::string& order_id, int64_t expected_version, v1::OrderStatus to,
      const std::string& trace_parent,
      const std::function<absl::StatusOr<NewEvent>(const v1::Order&)>& event);

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
};

}  // namespace outbox::producer
