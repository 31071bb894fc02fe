#include "producer/order_store.h"

#include <algorithm>
#include <future>
#include <map>
#include <set>

#include "absl/strings/ascii.h"
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
// Reads the orders $1 (uuid[]). LIMIT 1 keeps each a lookup by primary
// key whatever plan the prepared statement settles on.
constexpr char kReadOrdersSql[] =
    "SELECT o.* FROM unnest($1::uuid[]) AS k JOIN LATERAL "
    "(SELECT " OUTBOX_ORDER_COLUMNS
    " FROM orders WHERE order_id = k LIMIT 1) o ON true";
constexpr char kOrderByKeySql[] = "SELECT " OUTBOX_ORDER_COLUMNS
                                  ", request_hash FROM orders WHERE "
                                  "idempotency_key = $1";
#undef OUTBOX_ORDER_COLUMNS

// The tail of a statement that wrote orders: the events of the orders
// that CTE `written` returned (order_id text), from the array parameters
// a-h (outbox::EventRows), appended by the writer's CTEs; then, if it
// returned any, NOTIFY the channel in parameter `channel` ('' for none)
// at the commit. The caller's final SELECT joins n (LEFT JOIN n ON true).
#define OUTBOX_ORDER_EVENTS(written, a, b, c, d, e, f, g, h, channel)        \
  "input AS (SELECT * FROM unnest(" a "::text[], " b "::text[], " c          \
  "::uuid[], " d "::text[], " e "::int[], " f "::text[], " g "::text[], " h  \
  "::int[]) AS t(aggregate_type, aggregate_id, event_id, event_type, "       \
  "schema_version, payload, trace_parent, partition) "                       \
  "WHERE aggregate_id IN (SELECT order_id FROM " written                     \
  ")), " OUTBOX_WRITER_APPEND_CTES ", n AS (SELECT pg_notify(" channel       \
  "::text, '') FROM (SELECT 1 FROM " written " LIMIT 1) AS w WHERE " channel \
  "::text <> '') "

// A group of CreateOrder calls in one statement, run in autocommit (one
// round trip): the new orders, and the OrderCreated event of each order
// inserted. An order whose idempotency key was seen before is neither
// inserted nor returned, and gets no event. Arrays, one element per order:
// $1 order_id, $2 customer, $3 items (json), $4 currency, $5 total,
// $6 idempotency key ('' for none), $7 fingerprint; then the events, one
// per order: $8-$15 (outbox::EventRows); $16 the channel to NOTIFY at the
// commit if it wrote an order ('' for none).
constexpr char kCreateSql[] =
    "WITH o AS (INSERT INTO orders (order_id, customer_id, items, currency, "
    "total_cents, status, version, idempotency_key, request_hash) "
    "SELECT order_id, customer_id, items::jsonb, currency, total, "
    "'CREATED', 1, NULLIF(key, ''), fingerprint FROM unnest($1::uuid[], "
    "$2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], "
    "$7::text[]) AS t(order_id, customer_id, items, currency, total, key, "
    "fingerprint) "
    "ON CONFLICT (idempotency_key) DO NOTHING "
    "RETURNING order_id::text AS order_id, "
    "(extract(epoch from created_at) * 1000000)::bigint AS "
    "created_us), " OUTBOX_ORDER_EVENTS(
        "o", "$8", "$9", "$10", "$11", "$12", "$13", "$14", "$15",
        "$16") "SELECT order_id, created_us FROM o LEFT JOIN n ON true";

// A round of a group's changes in one statement, run in autocommit (one
// round trip): each order at most once, moved to its new status and
// version only if no one changed it since it was read (its version is
// still the new one less 1), and the event of each order it moved. Arrays:
// $1 order_id, $2 status, $3 version (new); then the events, one per
// order: $4-$11 (outbox::EventRows); $12 the channel to NOTIFY at the
// commit if it moved an order ('' for none). Returns the orders moved.
// Prepared: each order is found by a primary-key probe (LATERAL ... LIMIT
// 1, as kReadOrdersSql) and updated through the row it found (a TID scan),
// so that the generic plan, often made while the table is small, never
// joins the orders by a scan. The version test is what decides: an order
// moved by another writer in between is updated in its newest version
// only if that version is still the one read (never, as every change
// bumps it), and is then left out of the result.
constexpr char kChangeOrdersSql[] =
    "WITH t AS (SELECT t.*, k.tid FROM unnest($1::uuid[], $2::text[], "
    "$3::bigint[]) AS t(order_id, status, version) JOIN LATERAL (SELECT "
    "ctid AS tid FROM orders WHERE order_id = t.order_id LIMIT 1) k ON true), "
    "u AS (UPDATE orders o SET status = t.status, version = t.version, "
    "updated_at = now() FROM t WHERE o.ctid = t.tid "
    "AND o.version = t.version - 1 "
    "RETURNING o.order_id::text AS order_id, "
    "(extract(epoch from o.updated_at) * 1000000)::bigint AS "
    "updated_us), " OUTBOX_ORDER_EVENTS(
        "u", "$4", "$5", "$6", "$7", "$8", "$9", "$10", "$11",
        "$12") "SELECT order_id, updated_us FROM u LEFT JOIN n ON true";

#undef OUTBOX_ORDER_EVENTS

// The names each is prepared under below.
constexpr char kCreateName[] = "create_orders";
constexpr char kReadOrdersName[] = "read_orders";
constexpr char kChangeOrdersName[] = "change_orders";

// Rounds of a group that may find orders moved under them (by another
// producer) before the changes left fail as Aborted.
constexpr int kChangeConflicts = 16;

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

// Starts an asynchronous store call with a Done of its own and waits for
// its result.
absl::StatusOr<v1::Order> Await(
    const std::function<void(OrderStore::Done)>& start) {
  std::promise<absl::StatusOr<v1::Order>> promise;
  start([&promise](absl::StatusOr<v1::Order> order) {
    promise.set_value(std::move(order));
  });
  return promise.get_future().get();
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

std::vector<OrderStore::Statement> OrderStore::Statements() {
  return {{kCreateName, kCreateSql},
          {kReadOrdersName, kReadOrdersSql},
          {kChangeOrdersName, kChangeOrdersSql}};
}

OrderStore::OrderStore(Database* db, Writer* writer, OrderStoreOptions options,
                       Metrics* metrics)
    : db_(db),
      writer_(writer),
      create_commit_(options.create_groups,
                     [this](const std::vector<const NewOrder*>& group) {
                       return InsertOrders(group);
                     }),
      change_commit_(options.change_groups,
                     [this](const std::vector<const OrderChange*>& group) {
                       return WriteChanges(group);
                     }),
      notify_channel_(std::move(options.notify_channel)),
      between_read_and_write_(std::move(options.between_read_and_write)) {
  if (metrics != nullptr) {
    Histogram* sizes = metrics->AddHistogram(
        "outbox_producer_commit_group_size",
        "CreateOrder calls written together in one statement and commit.",
        Histogram::SizeBuckets());
    create_commit_.set_on_group([sizes](size_t n) { sizes->Observe(n); });
    Histogram* changes = metrics->AddHistogram(
        "outbox_producer_change_group_size",
        "PayOrder and CancelOrder calls written together (a read, then one "
        "statement).",
        Histogram::SizeBuckets());
    change_commit_.set_on_group([changes](size_t n) { changes->Observe(n); });
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
  std::vector<const NewEvent*> events;
  events.reserve(group.size());
  for (const NewOrder* o : group) events.push_back(&o->event);
  absl::StatusOr<EventRows> rows = Writer::Rows(events);
  absl::Status s = rows.status();
  if (s.ok()) {
    s = db_->Run([&](pqxx::connection& c) -> absl::Status {
      // Autocommit: a crash here leaves nothing written, as before a COMMIT.
      MaybeCrash("producer.before_commit");
      // Autocommit, or behind a transaction pooler a transaction that sets
      // the session limits first (common/db.h OpenUnit).
      auto unit = OpenUnit(c);
      pqxx::transaction_base& tx = *unit;
      pqxx::result r = ExecPrepared(
          tx, kCreateName, kCreateSql, id.str(), customer.str(),
          items.str(), currency.str(), total.str(), key.str(),
          fingerprint.str(), rows->aggregate_type, rows->aggregate_id,
          rows->event_id, rows->event_type, rows->schema_version, rows->payload,
          rows->trace_parent, rows->partition, notify_channel_);
      unit->commit();
      for (const auto& row : r) {
        results[index.at(row[0].as<std::string>())] =
            std::optional<int64_t>(row[1].as<int64_t>());
      }
      return absl::OkStatus();
    });
  }
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
  return Await([&](Done done) {
    CreateAsync(req, total_cents, trace_parent, std::move(done));
  });
}

void OrderStore::CreateAsync(const v1::CreateOrderRequest& req,
                             int64_t total_cents,
                             const std::string& trace_parent, Done done,
                             Waiter waiter) {
  NewOrder o;
  o.req = &req;
  o.total_cents = total_cents;
  o.order_id = NewTimeOrderedUuid();
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
      },
      std::move(waiter));
}

absl::StatusOr<v1::Order> OrderStore::OrderForKey(
    const v1::CreateOrderRequest& req, const std::string& fingerprint) {
  absl::StatusOr<v1::Order> result;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    auto unit = OpenUnit(c);
    pqxx::transaction_base& tx = *unit;
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

std::vector<absl::StatusOr<v1::Order>> OrderStore::WriteChanges(
    const std::vector<const OrderChange*>& group) {
  std::vector<absl::StatusOr<v1::Order>> results(
      group.size(), absl::InternalError("order change unwritten"));
  std::vector<size_t> pending(group.size());
  for (size_t i = 0; i < group.size(); ++i) pending[i] = i;
  bool wrote = false;
  absl::Status s;
  for (int conflicts = 0; !pending.empty();) {
    if (conflicts == kChangeConflicts) {
      s = absl::AbortedError(
          "order changed concurrently too often; retry with its new version");
      break;
    }
    // The first pending change of each order goes in this round; the others
    // wait for the next, to be decided against the order it leaves.
    std::vector<size_t> now, later;
    std::set<std::string> taken;
    for (size_t i : pending) {
      (taken.insert(group[i]->order_id).second ? now : later).push_back(i);
    }
    std::vector<size_t> moved;  // read, then changed by another: again
    s = WriteRound(group, now, &results, &moved, &wrote);
    if (!s.ok()) {
      if (OriginOf(s) != ErrorOrigin::kConflict) break;
      ++conflicts;  // a deadlock with another writer, say: again
      continue;
    }
    if (!moved.empty()) ++conflicts;
    pending = std::move(later);
    pending.insert(pending.end(), moved.begin(), moved.end());
    std::sort(pending.begin(), pending.end());  // arrival order
  }
  if (wrote) {
    writer_->Committed();
    MaybeCrash("producer.after_commit_before_answer");
  }
  if (s.ok()) return results;
  if (OriginOf(s) == ErrorOrigin::kData && pending.size() > 1) {
    // The database refused the data of one change: the rest each alone,
    // so that only that one fails.
    for (size_t i : pending)
      results[i] = std::move(WriteChanges({group[i]})[0]);
    return results;
  }
  for (size_t i : pending) results[i] = s;
  return results;
}

absl::Status OrderStore::WriteRound(
    const std::vector<const OrderChange*>& group,
    const std::vector<size_t>& round,
    std::vector<absl::StatusOr<v1::Order>>* results, std::vector<size_t>* moved,
    bool* wrote) {
  std::set<std::string> ids;
  for (size_t i : round) ids.insert(group[i]->order_id);
  return db_->Run([&](pqxx::connection& conn) -> absl::Status {
    auto unit = OpenUnit(conn);
    pqxx::transaction_base& tx = *unit;
    std::map<std::string, absl::StatusOr<v1::Order>> orders;
    for (const auto& row : ExecPrepared(tx, kReadOrdersName, kReadOrdersSql,
                                        ArrayLiteral(ids).str())) {
      orders.emplace(row["order_id"].as<std::string>(), OrderFromRow(row));
    }
    std::vector<NewEvent> events;
    std::vector<size_t> changed;
    ArrayLiteral id, status, version;
    for (size_t i : round) {
      const OrderChange& c = *group[i];
      auto it = orders.find(c.order_id);
      if (it == orders.end()) {
        (*results)[i] = absl::NotFoundError(
            absl::StrCat("order ", c.order_id, " does not exist"));
        continue;
      }
      if (!it->second.ok()) {
        (*results)[i] = it->second.status();
        continue;
      }
      v1::Order order = *it->second;
      absl::Status check = CheckVersion(c.expected_version, order.version());
      if (check.ok()) check = CheckTransition(order.status(), c.to);
      absl::StatusOr<NewEvent> e =
          check.ok() ? c.event(order) : absl::StatusOr<NewEvent>(check);
      if (!e.ok()) {
        (*results)[i] = e.status();
        continue;
      }
      e->trace_parent = c.trace_parent;
      events.push_back(*std::move(e));
      order.set_status(c.to);
      order.set_version(order.version() + 1);
      id.Add(c.order_id);
      status.Add(StatusName(order.status()));
      version.Add(order.version());
      (*results)[i] = std::move(order);
      changed.push_back(i);
    }
    if (changed.empty()) return absl::OkStatus();  // nothing to write
    if (between_read_and_write_) between_read_and_write_();
    absl::StatusOr<EventRows> rows = Writer::Rows(events);
    if (!rows.ok()) return rows.status();
    // Autocommit: a crash here leaves nothing written, as before a COMMIT.
    MaybeCrash("producer.before_commit");
    std::map<std::string, int64_t> updated;
    for (const auto& row :
         ExecPrepared(tx, kChangeOrdersName, kChangeOrdersSql, id.str(),
                      status.str(), version.str(), rows->aggregate_type,
                      rows->aggregate_id, rows->event_id, rows->event_type,
                      rows->schema_version, rows->payload, rows->trace_parent,
                      rows->partition, notify_channel_)) {
      updated[row[0].as<std::string>()] = row[1].as<int64_t>();
    }
    unit->commit();
    *wrote |= !updated.empty();
    for (size_t i : changed) {
      auto it = updated.find(group[i]->order_id);
      if (it == updated.end()) {
        moved->push_back(i);  // changed since it was read: decide again
        continue;
      }
      ToTimestamp(absl::FromUnixMicros(it->second),
                  (*results)[i]->mutable_updated_at());
    }
    return absl::OkStatus();
  });
}

void OrderStore::PayAsync(const v1::PayOrderRequest& req,
                          const std::string& trace_parent, Done done,
                          Waiter waiter) {
  OrderChange c;
  // As the database prints uuids: the group's rounds match orders by it,
  // and the event names the aggregate the way every other event of it does.
  c.order_id = absl::AsciiStrToLower(req.order_id());
  c.expected_version = req.expected_version();
  c.to = v1::ORDER_STATUS_PAID;
  c.trace_parent = trace_parent;
  c.event = [order_id = c.order_id, amount = req.amount_cents()](
                const v1::Order& current) -> absl::StatusOr<NewEvent> {
    if (amount != current.total_cents()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "amount_cents: ", amount, " does not equal the order total ",
          current.total_cents()));
    }
    v1::OrderPaid paid;
    paid.set_order_id(order_id);
    paid.set_amount_cents(amount);
    paid.set_currency(current.currency());
    return OrderEvent(order_id, paid, "");
  };
  change_commit_.SubmitAsync(std::move(c), std::move(done), std::move(waiter));
}

void OrderStore::CancelAsync(const v1::CancelOrderRequest& req,
                             const std::string& trace_parent, Done done,
                             Waiter waiter) {
  OrderChange c;
  c.order_id = absl::AsciiStrToLower(req.order_id());
  c.expected_version = req.expected_version();
  c.to = v1::ORDER_STATUS_CANCELLED;
  c.trace_parent = trace_parent;
  c.event = [order_id = c.order_id, reason = req.reason()](
                const v1::Order& current) -> absl::StatusOr<NewEvent> {
    v1::OrderCancelled cancelled;
    cancelled.set_order_id(order_id);
    cancelled.set_reason(reason);
    cancelled.set_currency(current.currency());
    cancelled.set_refund_cents(
        current.status() == v1::ORDER_STATUS_PAID ? current.total_cents() : 0);
    return OrderEvent(order_id, cancelled, "");
  };
  change_commit_.SubmitAsync(std::move(c), std::move(done), std::move(waiter));
}

absl::StatusOr<v1::Order> OrderStore::Pay(const v1::PayOrderRequest& req,
                                          const std::string& trace_parent) {
  return Await(
      [&](Done done) { PayAsync(req, trace_parent, std::move(done)); });
}

absl::StatusOr<v1::Order> OrderStore::Cancel(const v1::CancelOrderRequest& req,
                                             const std::string& trace_parent) {
  return Await(
      [&](Done done) { CancelAsync(req, trace_parent, std::move(done)); });
}

absl::StatusOr<v1::Order> OrderStore::Get(const std::string& order_id) {
  absl::StatusOr<v1::Order> result;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    auto unit = OpenUnit(c);
    pqxx::transaction_base& tx = *unit;
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
