#include "producer/order_store.h"

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fault.h"
#include "common/ids.h"
#include "common/log.h"
#include "producer/order_logic.h"

namespace outbox::producer {
namespace {

constexpr char kOrderColumns[] =
    "order_id::text, customer_id, jsonb_build_object('items', items)::text, "
    "currency, total_cents, status, version, "
    "(extract(epoch from created_at) * 1000000)::bigint, "
    "(extract(epoch from updated_at) * 1000000)::bigint, last_event_seq";

// Row (selected with kOrderColumns) -> Order.
absl::StatusOr<v1::Order> OrderFromRow(const pqxx::row& row) {
  v1::Order order;
  order.set_order_id(row[0].as<std::string>());
  order.set_customer_id(row[1].as<std::string>());
  v1::CreateOrderRequest items;
  auto parsed = google::protobuf::util::JsonStringToMessage(
      row[2].as<std::string>(), &items);
  if (!parsed.ok()) {
    return absl::InternalError(
        absl::StrCat("order ", order.order_id(), ": unreadable items"));
  }
  order.mutable_items()->Swap(items.mutable_items());
  order.set_currency(row[3].as<std::string>());
  order.set_total_cents(row[4].as<int64_t>());
  order.set_status(StatusFromName(row[5].as<std::string>()));
  order.set_version(row[6].as<int64_t>());
  ToTimestamp(absl::FromUnixMicros(row[7].as<int64_t>()),
              order.mutable_created_at());
  ToTimestamp(absl::FromUnixMicros(row[8].as<int64_t>()),
              order.mutable_updated_at());
  return order;
}

std::string ItemsJson(const google::protobuf::RepeatedPtrField<v1::LineItem>& items) {
  std::string out = "{\"items\":[";
  for (int i = 0; i < items.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", "{\"sku\":\"",
                    JsonEscape(items[i].sku()), "\",\"quantity\":",
                    items[i].quantity(), ",\"unitPriceCents\":",
                    items[i].unit_price_cents(), "}");
  }
  return out + "]}";
}

v1::Event NewEvent(const std::string& order_id, int64_t prev_seq,
                   const std::string& type, const std::string& trace_parent,
                   absl::Time now) {
  v1::Event e;
  e.set_event_id(NewUuid());
  e.set_aggregate_type("order");
  e.set_aggregate_id(order_id);
  // seq is the outbox row's identity, assigned on insert; the relay sets it
  // from the column.
  e.set_prev_seq(prev_seq);
  e.set_event_type(type);
  e.set_schema_version(1);
  ToTimestamp(now, e.mutable_occurred_at());
  e.set_trace_parent(trace_parent);
  return e;
}

// Inserts `event` into the outbox and points the order at it, in one
// statement; returns the order row as kOrderColumns after the update.
// `order_update` is the SET list for the order ("status = 'PAID', ...").
pqxx::result AppendEvent(pqxx::work& tx, const v1::Event& event,
                         const std::string& order_update) {
  const int partition = PartitionOf(event.aggregate_id());
  const std::string payload = event.SerializeAsString();
  return tx.exec_params(
      absl::StrCat(
          "WITH e AS (INSERT INTO outbox (event_id, aggregate_type, "
          "aggregate_id, prev_seq, event_type, schema_version, payload, "
          "trace_parent, partition) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, "
          "$9) RETURNING seq), "
          "u AS (UPDATE orders SET ", order_update,
          ", last_event_seq = e.seq, updated_at = now() FROM e "
          "WHERE order_id = $3::uuid RETURNING orders.*) "
          "SELECT ", kOrderColumns, " FROM u"),
      event.event_id(), event.aggregate_type(), event.aggregate_id(),
      event.prev_seq(), event.event_type(), event.schema_version(),
      pqxx::binarystring(payload), event.trace_parent(), partition);
}

}  // namespace

OrderStore::OrderStore(Database* db, Notifier* notifier)
    : db_(db), notifier_(notifier) {}

absl::StatusOr<v1::Order> OrderStore::Create(const v1::CreateOrderRequest& req,
                                             int64_t total_cents,
                                             const std::string& trace_parent) {
  const std::string fingerprint = RequestFingerprint(req);
  const std::string order_id = NewUuid();
  absl::StatusOr<v1::Order> result;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::work tx(c);
    // ON CONFLICT waits for a concurrent insert of the same key to commit or
    // roll back, so of ten concurrent retries exactly one inserts.
    pqxx::result inserted = tx.exec_params(
        "INSERT INTO orders (order_id, customer_id, items, currency, "
        "total_cents, status, version, idempotency_key, request_hash) "
        "VALUES ($1, $2, ($3::jsonb)->'items', $4, $5, 'CREATED', 1, "
        "NULLIF($6, ''), $7) "
        "ON CONFLICT (idempotency_key) DO NOTHING RETURNING order_id",
        order_id, req.customer_id(), ItemsJson(req.items()), req.currency(),
        total_cents, req.idempotency_key(), fingerprint);
    if (inserted.empty()) {
      pqxx::result first = tx.exec_params(
          absl::StrCat("SELECT ", kOrderColumns,
                       ", request_hash FROM orders WHERE idempotency_key = $1"),
          req.idempotency_key());
      tx.commit();
      if (first.empty()) {
        return absl::AbortedError("idempotency_key: concurrent request; retry");
      }
      if (first[0][10].as<std::string>() != fingerprint) {
        return absl::InvalidArgumentError(
            "idempotency_key: already used for a different order request");
      }
      result = OrderFromRow(first[0]);
      return result.status();
    }
    v1::Event event = NewEvent(order_id, 0, "OrderCreated", trace_parent,
                               absl::Now());
    v1::OrderCreated* created = event.mutable_order_created();
    created->set_order_id(order_id);
    created->set_customer_id(req.customer_id());
    *created->mutable_items() = req.items();
    created->set_currency(req.currency());
    created->set_total_cents(total_cents);
    pqxx::result row = AppendEvent(tx, event, "version = version");
    MaybeCrash("producer.before_commit");
    tx.commit();
    if (notifier_ != nullptr) notifier_->Poke();
    MaybeCrash("producer.after_commit_before_answer");
    result = OrderFromRow(row[0]);
    return result.status();
  });
  if (!s.ok()) return s;
  return result;
}

namespace {

// Locks the order row; NotFound if there is none.
absl::StatusOr<pqxx::row> LockOrder(pqxx::work& tx, const std::string& id) {
  pqxx::result r = tx.exec_params(
      absl::StrCat("SELECT ", kOrderColumns,
                   " FROM orders WHERE order_id = $1::uuid FOR UPDATE"),
      id);
  if (r.empty()) {
    return absl::NotFoundError(absl::StrCat("order ", id, " does not exist"));
  }
  return r[0];
}

}  // namespace

absl::StatusOr<v1::Order> OrderStore::Change(
    const std::string& order_id, int64_t expected_version, v1::OrderStatus to,
    const char* event_type, const std::string& trace_parent,
    const std::function<absl::Status(const v1::Order&, v1::Event*)>& fill) {
  absl::StatusOr<v1::Order> result;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::work tx(c);
    // The row lock serializes this order's changes: prev_seq read here is
    // the seq of an event that has committed.
    absl::StatusOr<pqxx::row> row = LockOrder(tx, order_id);
    if (!row.ok()) return row.status();
    absl::StatusOr<v1::Order> current = OrderFromRow(*row);
    if (!current.ok()) return current.status();
    if (absl::Status v = CheckVersion(expected_version, current->version());
        !v.ok()) {
      return v;
    }
    if (absl::Status t = CheckTransition(current->status(), to); !t.ok()) {
      return t;
    }
    v1::Event event = NewEvent(order_id, (*row)[9].as<int64_t>(), event_type,
                               trace_parent, absl::Now());
    if (absl::Status f = fill(*current, &event); !f.ok()) return f;
    pqxx::result updated = AppendEvent(
        tx, event,
        absl::StrCat("status = '", StatusName(to),
                     "', version = orders.version + 1"));
    MaybeCrash("producer.before_commit");
    tx.commit();
    if (notifier_ != nullptr) notifier_->Poke();
    MaybeCrash("producer.after_commit_before_answer");
    result = OrderFromRow(updated[0]);
    return result.status();
  });
  if (!s.ok()) return s;
  return result;
}

absl::StatusOr<v1::Order> OrderStore::Pay(const v1::PayOrderRequest& req,
                                          const std::string& trace_parent) {
  return Change(
      req.order_id(), req.expected_version(), v1::ORDER_STATUS_PAID,
      "OrderPaid", trace_parent,
      [&](const v1::Order& current, v1::Event* event) {
        if (req.amount_cents() != current.total_cents()) {
          return absl::InvalidArgumentError(
              absl::StrCat("amount_cents: ", req.amount_cents(),
                           " does not equal the order total ",
                           current.total_cents()));
        }
        v1::OrderPaid* paid = event->mutable_order_paid();
        paid->set_order_id(req.order_id());
        paid->set_amount_cents(req.amount_cents());
        paid->set_currency(current.currency());
        return absl::OkStatus();
      });
}

absl::StatusOr<v1::Order> OrderStore::Cancel(const v1::CancelOrderRequest& req,
                                             const std::string& trace_parent) {
  return Change(
      req.order_id(), req.expected_version(), v1::ORDER_STATUS_CANCELLED,
      "OrderCancelled", trace_parent,
      [&](const v1::Order& current, v1::Event* event) {
        v1::OrderCancelled* cancelled = event->mutable_order_cancelled();
        cancelled->set_order_id(req.order_id());
        cancelled->set_reason(req.reason());
        cancelled->set_currency(current.currency());
        cancelled->set_refund_cents(
            current.status() == v1::ORDER_STATUS_PAID ? current.total_cents()
                                                       : 0);
        return absl::OkStatus();
      });
}

absl::StatusOr<v1::Order> OrderStore::Get(const std::string& order_id) {
  absl::StatusOr<v1::Order> result;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::read_transaction tx(c);
    pqxx::result r = tx.exec_params(
        absl::StrCat("SELECT ", kOrderColumns,
                     " FROM orders WHERE order_id = $1::uuid"),
        order_id);
    if (r.empty()) {
      return absl::NotFoundError(
          absl::StrCat("order ", order_id, " does not exist"));
    }
    result = OrderFromRow(r[0]);
    return result.status();
  });
  if (!s.ok()) return s;
  return result;
}

}  // namespace outbox::producer
