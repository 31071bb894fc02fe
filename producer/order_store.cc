#include "producer/order_store.h"

#include <future>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/sql_state.h"
#include "absl/time/clock.h"
#include "common/fault.h"
#include "common/ids.h"
#include "producer/order_logic.h"

namespace outbox::producer {
namespace {

// The columns an order is read with, by name in OrderFromRow.
#define OUTBOX_ORDER_COLUMNS                                                  \
  "order_id::text AS order_id, customer_id, items::text AS items, currency, " \
  "total_cents, status, version, "                                            \
  "(extract(epoch from created_at) * 1000000)::bigint AS created_us, "        \
  "(extract(epoch from updated_at) * 1000000)::bigint AS updated_us, "        \
  "last_event_seq"
constexpr char kReadOrderSql[] =
    "SELECT " OUTBOX_ORDER_COLUMNS " FROM orders WHERE order_id = $1::uuid";
constexpr char kOrderByKeySql[] = "SELECT " OUTBOX_ORDER_COLUMNS
                                  ", request_hash FROM orders WHERE "
                                  "idempotency_key = $1";
#undef OUTBOX_ORDER_COLUMNS

// New orders, their events and the events' deliveries, in one statement
// (one round trip, one commit; autocommit makes it atomic) for a whole
// group of CreateOrder calls. Each event's seq is drawn from the outbox's
// own sequence first, so that its order row can point at it as it is
// inserted (a row cannot be written twice in one statement). An order whose
// idempotency key was seen before is not inserted (its drawn seq is
// skipped; seqs are not dense anyway) and not returned.
// Arrays, one element per order: $1 order_id, $2 customer, $3 items (json),
// $4 currency, $5 total, $6 idempotency key ('' for none), $7 fingerprint,
// $8 event_id, $9 payload (hex), $10 trace_parent, $11 partition.
constexpr char kCreateSql[] =
    "WITH input AS (SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], "
    "$4::text[], $5::bigint[], $6::text[], $7::text[], $8::uuid[], "
    "$9::text[], $10::text[], $11::int[]) AS t(order_id, customer_id, items, "
    "currency, total, key, fingerprint, event_id, payload, trace_parent, "
    "partition)), "
    "s AS (SELECT input.*, nextval('outbox_seq_seq') AS seq FROM input), "
    "o AS (INSERT INTO orders (order_id, customer_id, items, currency, "
    "total_cents, status, version, idempotency_key, request_hash, "
    "last_event_seq) SELECT order_id, customer_id, items::jsonb, currency, "
    "total, 'CREATED', 1, NULLIF(key, ''), fingerprint, seq FROM s "
    "ON CONFLICT (idempotency_key) DO NOTHING "
    "RETURNING order_id, (extract(epoch from created_at) * 1000000)::bigint "
    "AS created_us), "
    "e AS (INSERT INTO outbox (seq, event_id, aggregate_type, aggregate_id, "
    "prev_seq, event_type, schema_version, payload, trace_parent, partition) "
    "SELECT s.seq, s.event_id, 'order', s.order_id::text, 0, 'OrderCreated', "
    "1, decode(s.payload, 'hex'), s.trace_parent, s.partition "
    "FROM s JOIN o USING (order_id)) "
    "SELECT order_id::text, created_us FROM o";

// A change of an order read at version $2 and its event, in one
// statement: applied only if the order is still at that version (so the
// prev_seq read with it, $5, is still its newest event); nothing returned
// otherwise. $1 order_id, $3 new status, $4 event_id, $6 event_type,
// $7 payload, $8 trace_parent, $9 partition.
constexpr char kChangeSql[] =
    "WITH s AS (SELECT nextval('outbox_seq_seq') AS seq), "
    "u AS (UPDATE orders SET status = $3, version = version + 1, "
    "last_event_seq = s.seq, updated_at = now() FROM s "
    "WHERE order_id = $1::uuid AND version = $2 "
    "RETURNING orders.version, orders.last_event_seq, "
    "(extract(epoch from orders.updated_at) * 1000000)::bigint AS updated_us), "
    "e AS (INSERT INTO outbox (seq, event_id, aggregate_type, aggregate_id, "
    "prev_seq, event_type, schema_version, payload, trace_parent, partition) "
    "SELECT u.last_event_seq, $4::uuid, 'order', $1, $5, $6, 1, $7, $8, $9 "
    "FROM u) "
    "SELECT version, updated_us FROM u";

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

v1::Event NewEvent(const std::string& order_id, int64_t prev_seq,
                   const std::string& type, const std::string& trace_parent,
                   absl::Time now) {
  v1::Event e;
  e.set_event_id(NewUuid());
  e.set_aggregate_type("order");
  e.set_aggregate_id(order_id);
  // seq is the outbox row's, drawn in the statement; the relay sets it from
  // the column.
  e.set_prev_seq(prev_seq);
  e.set_event_type(type);
  e.set_schema_version(1);
  ToTimestamp(now, e.mutable_occurred_at());
  e.set_trace_parent(trace_parent);
  return e;
}

pqxx::binarystring Payload(const v1::Event& e) {
  return pqxx::binarystring(e.SerializeAsString());
}

constexpr int kChangeTries = 5;  // re-reads when a concurrent change wins

}  // namespace

OrderStore::OrderStore(Database* db, Notifier* notifier,
                       OrderStoreOptions options, Metrics* metrics)
    : db_(db),
      notifier_(notifier),
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
  ArrayLiteral id, customer, items, currency, total, key, fingerprint, event_id,
      payload, trace, partition;
  for (const NewOrder* o : group) {
    id.Add(o->order_id);
    customer.Add(o->req->customer_id());
    items.Add(o->items_json);
    currency.Add(o->req->currency());
    total.Add(o->total_cents);
    key.Add(o->req->idempotency_key());
    fingerprint.Add(o->fingerprint);
    event_id.Add(o->event_id);
    payload.AddHex(o->payload);
    trace.Add(o->trace_parent);
    partition.Add(PartitionOf(o->order_id));
  }
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::nontransaction tx(c);
    MaybeCrash("producer.before_commit");
    pqxx::result r = ExecPrepared(
        tx, "create_orders", kCreateSql, id.str(), customer.str(), items.str(),
        currency.str(), total.str(), key.str(), fingerprint.str(),
        event_id.str(), payload.str(), trace.str(), partition.str());
    std::map<std::string, int64_t> created;
    for (const auto& row : r) {
      created[row[0].as<std::string>()] = row[1].as<int64_t>();
    }
    for (size_t i = 0; i < group.size(); ++i) {
      auto it = created.find(group[i]->order_id);
      if (it != created.end()) results[i] = std::optional<int64_t>(it->second);
    }
    return absl::OkStatus();
  });
  if (s.ok()) {
    if (notifier_ != nullptr) notifier_->Poke();
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
  o.trace_parent = trace_parent;
  v1::Event event = NewEvent(o.order_id, 0, "OrderCreated", trace_parent,
                             absl::Now());
  v1::OrderCreated* created = event.mutable_order_created();
  created->set_order_id(o.order_id);
  created->set_customer_id(req.customer_id());
  *created->mutable_items() = req.items();
  created->set_currency(req.currency());
  created->set_total_cents(total_cents);
  o.event_id = event.event_id();
  o.payload = event.SerializeAsString();
  const std::string order_id = o.order_id;
  const std::string fingerprint = o.fingerprint;
  create_commit_.SubmitAsync(
      std::move(o), [this, &req, total_cents, order_id, fingerprint,
                     done = std::move(done)](
                        absl::StatusOr<std::optional<int64_t>> written) {
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
    pqxx::result first = ExecPrepared(tx, "order_by_key", kOrderByKeySql,
                                      req.idempotency_key());
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
    const char* event_type, const std::string& trace_parent,
    const std::function<absl::Status(const v1::Order&, v1::Event*)>& fill) {
  absl::StatusOr<v1::Order> result;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::nontransaction tx(c);
    // Read, decide, then write only if nothing changed meanwhile: the
    // version guards the write, so the prev_seq read here is the seq of the
    // order's newest committed event when the write lands. Two round trips,
    // no transaction held open between them; a lost race reads again.
    for (int attempt = 0; attempt < kChangeTries; ++attempt) {
      pqxx::result read =
          ExecPrepared(tx, "read_order", kReadOrderSql, order_id);
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
      const int64_t prev_seq = read[0]["last_event_seq"].as<int64_t>();
      v1::Event event =
          NewEvent(order_id, prev_seq, event_type, trace_parent, absl::Now());
      if (absl::Status f = fill(*current, &event); !f.ok()) return f;
      MaybeCrash("producer.before_commit");
      pqxx::result written = ExecPrepared(
          tx, "change_order", kChangeSql, order_id, current->version(),
          StatusName(to), event.event_id(), prev_seq, event_type,
          Payload(event), trace_parent, PartitionOf(order_id));
      if (written.empty()) continue;  // changed since read: read again
      if (notifier_ != nullptr) notifier_->Poke();
      MaybeCrash("producer.after_commit_before_answer");
      current->set_status(to);
      current->set_version(written[0]["version"].as<int64_t>());
      ToTimestamp(absl::FromUnixMicros(written[0]["updated_us"].as<int64_t>()),
                  current->mutable_updated_at());
      result = std::move(*current);
      return absl::OkStatus();
    }
    return absl::AbortedError(
        absl::StrCat("order ", order_id, " changed concurrently; retry"));
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
