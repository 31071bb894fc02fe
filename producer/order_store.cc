#include "producer/order_store.h"

#include <future>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fault.h"
#include "common/ids.h"
#include "common/sql_state.h"
#include "producer/order_logic.h"

namespace outbox::producer {
namespace {

// The columns an order is read with, by name in OrderFromRow.
#define OUTBOX_ORDER_COLUMNS                                                  \
  "order_id::text AS order_id, customer_id, items::text AS items, currency, " \
  "total_cents, status, version, "                                            \
  "(extract(epoch from created_at) * 1000000)::bigint AS created_us, "        \
  "(extract(epoch from updated_at) * 1000000)::bigint AS updated_us"
constexpr char kReadOrderSql[] =
    "SELECT " OUTBOX_ORDER_COLUMNS " FROM orders WHERE order_id = $1::uuid";
constexpr char kLockOrderSql[] = "SELECT " OUTBOX_ORDER_COLUMNS
                                 " FROM orders WHERE order_id = $1::uuid "
                                 "FOR UPDATE";
constexpr char kOrderByKeySql[] = "SELECT " OUTBOX_ORDER_COLUMNS
                                  ", request_hash FROM orders WHERE "
                                  "idempotency_key = $1";
#undef OUTBOX_ORDER_COLUMNS

// The new orders of a group of CreateOrder calls, in one statement. An
// order whose idempotency key was seen before is not inserted and not
// returned. Arrays, one element per order: $1 order_id, $2 customer,
// $3 items (json), $4 currency, $5 total, $6 idempotency key ('' for none),
// $7 fingerprint.
constexpr char kCreateSql[] =
    "INSERT INTO orders (order_id, customer_id, items, currency, "
    "total_cents, status, version, idempotency_key, request_hash) "
    "SELECT order_id, customer_id, items::jsonb, currency, total, "
    "'CREATED', 1, NULLIF(key, ''), fingerprint FROM unnest($1::uuid[], "
    "$2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], "
    "$7::text[]) AS t(order_id, customer_id, items, currency, total, key, "
    "fingerprint) "
    "ON CONFLICT (idempotency_key) DO NOTHING "
    "RETURNING order_id::text, "
    "(extract(epoch from created_at) * 1000000)::bigint AS created_us";

// A change of an order locked by kLockOrderSql. $1 order_id, $2 status.
constexpr char kChangeSql[] =
    "UPDATE orders SET status = $2, version = version + 1, "
    "updated_at = now() WHERE order_id = $1::uuid "
    "RETURNING version, "
    "(extract(epoch from updated_at) * 1000000)::bigint AS updated_us";

// Row (selected with kOrderColumns) -> Order.
absl::StatusOr<v1::Order> OrderFromRow(const pqxx::row& row) {
  v1::Order order;
  order.set_order_id(row["order_id"].as<std::string>());
  order.set_customer_id(row["customer_id"].as<std::string>());
  if (!ParseItemsJson(row["items"].c_str(), order.mutable_items()).ok()) {
    return absl::InternalError(
        absl::StrCat("order ", order.order_id(), ": unreadable items"));
  }
  order.set_currency(row["currency"].as<std::string>());
  order.set_total_cents(row["total_cents"].as<int64_t>());
  order.set_status(StatusFromName(row["status"].as<std::string>()));
  order.set_version(row["version"].as<int64_t>());
  ToTimestamp(absl::FromUnixMicros(row["created_us"].as<int64_t>()),
              order.mutable_created_at());
  ToTimestamp(absl::FromUnixMicros(row["updated_us"].as<int64_t>()),
              order.mutable_updated_at());
  return order;
}

// The event of an order change: `payload`, typed by its message name.
NewEvent OrderEvent(const std::string& order_id,
                    const google::protobuf::Message& payload,
                    const std::string& trace_parent) {
  NewEvent e = NewEvent::Of("order", order_id, payload);
  e.trace_parent = trace_parent;
  return e;
}

}  // namespace

OrderStore::OrderStore(Database* db, Writer* writer, OrderStoreOptions options,
                       Metrics* metrics)
    : db_(db),
      writer_(writer),
      create_commit_(options.create_groups,
                     [this](const std::vector<const NewOrder*>& group) {
                       return InsertOrders(group);
                     }) {
  if (metrics != nullptr) {
    Histogram* sizes = metrics->AddHistogram(
        "outbox_producer_commit_group_size",
        "CreateOrder calls written together in one statement and commit.",
        Histogram::SizeBuckets());
    create_commit_.set_on_group([sizes](size_t n) { sizes->Observe(n); });
  }
}

std::vector<absl::StatusOr<std::optional<int64_t>>> OrderStore::InsertOrders(
    const std::vector<const NewOrder*>& group) {
  std::vector<absl::StatusOr<std::optional<int64_t>>> results(
      group.size(), std::optional<int64_t>());
  ArrayLiteral id, customer, items, currency, total, key, fingerprint;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < group.size(); ++i) {
    const NewOrder* o = group[i];
    id.Add(o->order_id);
    customer.Add(o->req->customer_id());
    items.Add(o->items_json);
    currency.Add(o->req->currency());
    total.Add(o->total_cents);
    key.Add(o->req->idempotency_key());
    fingerprint.Add(o->fingerprint);
    index[o->order_id] = i;
  }
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::work tx(c);
    pqxx::result r = ExecPrepared(tx, "create_orders", kCreateSql, id.str(),
                                  customer.str(), items.str(), currency.str(),
                                  total.str(), key.str(), fingerprint.str());
    std::vector<NewEvent> events;
    std::vector<std::pair<size_t, int64_t>> created;
    events.reserve(r.size());
    for (const auto& row : r) {
      const size_t i = index.at(row[0].as<std::string>());
      created.emplace_back(i, row[1].as<int64_t>());
      events.push_back(group[i]->event);
    }
    if (!events.empty()) {
      auto appended = writer_->AppendMany(tx, events);
      if (!appended.ok()) return appended.status();
    }
    MaybeCrash("producer.before_commit");
    tx.commit();
    for (const auto& [i, at] : created) results[i] = std::optional<int64_t>(at);
    return absl::OkStatus();
  });
  if (s.ok()) {
    writer_->Committed();
    MaybeCrash("producer.after_commit_before_answer");
    return results;
  }
  if (OriginOf(s) == ErrorOrigin::kData && group.size() > 1) {
    for (size_t i = 0; i < group.size(); ++i) {
      results[i] = std::move(InsertOrders({group[i]})[0]);
    }
    return results;
  }
  for (auto& r : results) r = s;
  return results;
}

absl::StatusOr<v1::Order> OrderStore::Create(const v1::CreateOrderRequest& req,
                                             int64_t total_cents,
                                             const std::string& trace_parent) {
  std::promise<absl::StatusOr<v1::Order>> promise;
  std::future<absl::StatusOr<v1::Order>> future = promise.get_future();
  CreateAsync(req, total_cents, trace_parent,
              [&promise](absl::StatusOr<v1::Order> order) {
                promise.set_value(std::move(order));
              });
  return future.get();
}

void OrderStore::CreateAsync(
    const v1::CreateOrderRequest& req, int64_t total_cents,
    const std::string& trace_parent,
    std::function<void(absl::StatusOr<v1::Order>)> done) {
  NewOrder o;
  o.req = &req;
  o.total_cents = total_cents;
  o.order_id = NewUuid();
  o.fingerprint = RequestFingerprint(req);
  o.items_json = ItemsJson(req.items());
  v1::OrderCreated created;
  created.set_order_id(o.order_id);
  created.set_customer_id(req.customer_id());
  *created.mutable_items() = req.items();
  created.set_currency(req.currency());
  created.set_total_cents(total_cents);
  o.event = OrderEvent(o.order_id, created, trace_parent);
  const std::string order_id = o.order_id;
  const std::string fingerprint = o.fingerprint;
  create_commit_.SubmitAsync(
      std::move(o),
      [this, &req, total_cents, order_id, fingerprint,
       done = std::move(done)](absl::StatusOr<std::optional<int64_t>> written) {
        if (!written.ok()) return done(written.status());
        if (!written->has_value()) {
          // The key was used before (ON CONFLICT waited for a concurrent
          // insert of it to commit). One indexed read, and rare.
          return done(OrderForKey(req, fingerprint));
        }
        // Everything the answer holds is known: no read back.
        v1::Order order;
        order.set_order_id(order_id);
        order.set_customer_id(req.customer_id());
        *order.mutable_items() = req.items();
        order.set_currency(req.currency());
        order.set_total_cents(total_cents);
        order.set_status(v1::ORDER_STATUS_CREATED);
        order.set_version(1);
        const absl::Time at = absl::FromUnixMicros(**written);
        ToTimestamp(at, order.mutable_created_at());
        ToTimestamp(at, order.mutable_updated_at());
        done(std::move(order));
      });
}

absl::StatusOr<v1::Order> OrderStore::OrderForKey(
    const v1::CreateOrderRequest& req, const std::string& fingerprint) {
  absl::StatusOr<v1::Order> result;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::nontransaction tx(c);
    pqxx::result first =
        ExecPrepared(tx, "order_by_key", kOrderByKeySql, req.idempotency_key());
    if (first.empty()) {
      return absl::AbortedError("idempotency_key: concurrent request; retry");
    }
    if (first[0]["request_hash"].as<std::string>() != fingerprint) {
      return absl::InvalidArgumentError(
          "idempotency_key: already used for a different order request");
    }
    result = OrderFromRow(first[0]);
    return result.status();
  });
  if (!s.ok()) return s;
  return result;
}

absl::StatusOr<v1::Order> OrderStore::Change(
    const std::string& order_id, int64_t expected_version, v1::OrderStatus to,
    const std::string& trace_parent,
    const std::function<absl::StatusOr<NewEvent>(const v1::Order&)>& event) {
  absl::StatusOr<v1::Order> result;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::work tx(c);
    pqxx::result read = ExecPrepared(tx, "lock_order", kLockOrderSql, order_id);
    if (read.empty()) {
      return absl::NotFoundError(
          absl::StrCat("order ", order_id, " does not exist"));
    }
    absl::StatusOr<v1::Order> current = OrderFromRow(read[0]);
    if (!current.ok()) return current.status();
    if (absl::Status v = CheckVersion(expected_version, current->version());
        !v.ok()) {
      return v;
    }
    if (absl::Status t = CheckTransition(current->status(), to); !t.ok()) {
      return t;
    }
    absl::StatusOr<NewEvent> e = event(*current);
    if (!e.ok()) return e.status();
    e->trace_parent = trace_parent;
    pqxx::result written =
        ExecPrepared(tx, "change_order", kChangeSql, order_id, StatusName(to));
    if (auto appended = writer_->Append(tx, *e); !appended.ok()) {
      return appended.status();
    }
    MaybeCrash("producer.before_commit");
    tx.commit();
    current->set_status(to);
    current->set_version(written[0]["version"].as<int64_t>());
    ToTimestamp(absl::FromUnixMicros(written[0]["updated_us"].as<int64_t>()),
                current->mutable_updated_at());
    result = std::move(*current);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  writer_->Committed();
  MaybeCrash("producer.after_commit_before_answer");
  return result;
}

absl::StatusOr<v1::Order> OrderStore::Pay(const v1::PayOrderRequest& req,
                                          const std::string& trace_parent) {
  return Change(
      req.order_id(), req.expected_version(), v1::ORDER_STATUS_PAID,
      trace_parent, [&](const v1::Order& current) -> absl::StatusOr<NewEvent> {
        if (req.amount_cents() != current.total_cents()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "amount_cents: ", req.amount_cents(),
              " does not equal the order total ", current.total_cents()));
        }
        v1::OrderPaid paid;
        paid.set_order_id(req.order_id());
        paid.set_amount_cents(req.amount_cents());
        paid.set_currency(current.currency());
        return OrderEvent(req.order_id(), paid, "");
      });
}

absl::StatusOr<v1::Order> OrderStore::Cancel(const v1::CancelOrderRequest& req,
                                             const std::string& trace_parent) {
  return Change(
      req.order_id(), req.expected_version(), v1::ORDER_STATUS_CANCELLED,
      trace_parent, [&](const v1::Order& current) -> absl::StatusOr<NewEvent> {
        v1::OrderCancelled cancelled;
        cancelled.set_order_id(req.order_id());
        cancelled.set_reason(req.reason());
        cancelled.set_currency(current.currency());
        cancelled.set_refund_cents(current.status() == v1::ORDER_STATUS_PAID
                                       ? current.total_cents()
                                       : 0);
        return OrderEvent(req.order_id(), cancelled, "");
      });
}

absl::StatusOr<v1::Order> OrderStore::Get(const std::string& order_id) {
  absl::StatusOr<v1::Order> result;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::nontransaction tx(c);
    pqxx::result r = ExecPrepared(tx, "read_order", kReadOrderSql, order_id);
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
