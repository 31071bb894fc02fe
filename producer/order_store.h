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
  // commit); this many groups are written at once, at most, and this many
  // calls wait for them, at most.
  GroupCommitOptions create_groups;
  // Concurrent PayOrder and CancelOrder calls share their statements: one
  // reads their orders, one changes them and appends their events.
  GroupCommitOptions change_groups;
  // NOTIFY this channel from each statement that writes events, at its
  // commit (relays LISTEN on common/schema.h's kNotifyChannel): no
  // transaction of its own, no thread hop. PostgreSQL serializes the
  // commits of notifying transactions; a few group writers lose nothing by
  // it. Empty: none (the relays poll, or the writer notifies).
  std::string notify_channel;
  // Tests only: runs between a change round's read and its write, where
  // another writer may move the orders.
  std::function<void()> between_read_and_write;
};

class OrderStore {
 public:
  // The statements the store prepares (name, SQL), in the form it runs
  // them: what a baseline that runs the producer's own SQL without the
  // service (scripts/bench's pgbench scripts) reads.
  struct Statement {
    const char* name;
    const char* sql;
  };
  static std::vector<Statement> Statements();

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
  // valid until then. Never blocks on the database. An order whose `waiter`
  // stopped waiting before its group was written is not written (`done`
  // gets DeadlineExceeded or Cancelled); when the queue is full of orders
  // still wanted, `done` gets ResourceExhausted at once (see GroupCommit).
  void CreateAsync(const v1::CreateOrderRequest& req, int64_t total_cents,
                   const std::string& trace_parent, Done done,
                   Waiter waiter = {});
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
  // the database. `waiter` and a full queue as for CreateAsync.
  void PayAsync(const v1::PayOrderRequest& req, const std::string& trace_parent,
                Done done, Waiter waiter = {});
  void CancelAsync(const v1::CancelOrderRequest& req,
                   const std::string& trace_parent, Done done,
                   Waiter waiter = {});
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
  // Writes the changes of a group in rounds of two round trips each: read
  // the orders, decide each change in arrival order, then one statement
  // moves each order whose version is still the one read and appends its
  // event. A round takes each order's first pending change; its next ones,
  // and a change whose order another writer moved in between, go in the
  // next round, decided against the order as it now is. One result per
  // change. A data error is retried change by change, so that only the
  // culprit fails.
  std::vector<absl::StatusOr<v1::Order>> WriteChanges(
      const std::vector<const OrderChange*>& group);
  // One round of WriteChanges: the changes `round` of `group` (at most one
  // per order). Fills their results; adds to `moved` those whose order
  // changed after it was read; sets `wrote` if anything was written.
  absl::Status WriteRound(const std::vector<const OrderChange*>& group,
                          const std::vector<size_t>& round,
                          std::vector<absl::StatusOr<v1::Order>>* results,
                          std::vector<size_t>* moved, bool* wrote);

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
  // Inserts the orders of a group and their events in one statement, in
  // autocommit (one round trip); one result per order: its created_at in
  // microseconds, or nothing when its idempotency key was taken. A data error
  // of the group is retried order by order, so that only the culprit fails.
  std::vector<absl::StatusOr<std::optional<int64_t>>> InsertOrders(
      const std::vector<const NewOrder*>& group);

  Database* const db_;
  Writer* const writer_;
  GroupCommit<NewOrder, std::optional<int64_t>> create_commit_;
  GroupCommit<OrderChange, v1::Order> change_commit_;
  const std::string notify_channel_;
  std::function<void()> between_read_and_write_;
};

}  // namespace outbox::producer
