#include "consumer/billing.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/db.h"

namespace outbox::consumer {
namespace {

// Versions 1-3 once also made the inbox engine's tables; its schema
// (applied first) now owns them and adopts a database that has them.
const std::vector<Migration> kMigrations = {
    {1, "inbox, cursors, held events and billing", R"sql(
-- The billing domain's view of each order.
CREATE TABLE order_view (
  order_id    text COLLATE "C" PRIMARY KEY,
  customer_id text NOT NULL,
  status      text NOT NULL,
  total_cents bigint NOT NULL,
  currency    text NOT NULL,
  last_seq    bigint NOT NULL,
  updated_at  timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 70);

-- Money movements: a charge when an order is paid, a refund when a paid
-- order is cancelled. One per event, at most.
CREATE TABLE charges (
  event_id     uuid PRIMARY KEY,
  order_id     text COLLATE "C" NOT NULL,
  kind         text NOT NULL CHECK (kind IN ('charge', 'refund')),
  amount_cents bigint NOT NULL,
  currency     text NOT NULL,
  created_at   timestamptz NOT NULL DEFAULT now(),
  UNIQUE (order_id, kind)
);
)sql"},
    {2, "held events: one per link and position, counted per aggregate",
     "SELECT 1  -- now the inbox schema's"},
    {3, "cheaper writes per applied event", R"sql(
ALTER TABLE order_view ALTER COLUMN order_id TYPE text COLLATE "C";
ALTER TABLE charges ALTER COLUMN order_id TYPE text COLLATE "C";
ALTER TABLE order_view SET (fillfactor = 70);
)sql"},
    {4, "money movements of superseded events", R"sql(
-- When an operator adopts the producer's history of an order whose
-- histories diverged (a failover lost events applied here), the charges
-- and refunds of the events no longer in it move here: they happened, and
-- someone must compensate them, but they no longer count for the order.
CREATE TABLE IF NOT EXISTS charges_superseded (
  event_id      uuid NOT NULL,
  order_id      text COLLATE "C" NOT NULL,
  kind          text NOT NULL,
  amount_cents  bigint NOT NULL,
  currency      text NOT NULL,
  created_at    timestamptz NOT NULL,
  superseded_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (event_id, superseded_at)
);
)sql"},
};

// The billing view of one order while a batch is applied.
struct OrderState {
  std::string customer_id;
  std::string status;
  int64_t total_cents = 0;
  std::string currency;
  int64_t last_seq = 0;
  bool dirty = false;
};

struct ChargeRow {
  std::string event_id, order_id, kind, currency;
  int64_t amount_cents;
};

// The effect of `e` on `order`; appends the money movement it causes. A
// refund only when this consumer saw the order paid: its own state, applied
// in order, decides.
void Evolve(const v1::Event& e, const v1::LegacyOrderPayload& payload,
            OrderState* order, std::vector<ChargeRow>* charges) {
  order->dirty = true;
  order->last_seq = e.seq();
  if (payload.has_order_created()) {
    const v1::OrderCreated& p = payload.order_created();
    order->customer_id = p.customer_id();
    order->status = "CREATED";
    order->total_cents = p.total_cents();
    order->currency = p.currency();
  } else if (payload.has_order_paid()) {
    const v1::OrderPaid& p = payload.order_paid();
    if (order->currency.empty()) order->currency = p.currency();
    charges->push_back({e.event_id(), e.aggregate_id(), "charge",
                        order->currency, p.amount_cents()});
    order->status = "PAID";
  } else if (payload.has_order_cancelled()) {
    if (order->status == "PAID") {
      charges->push_back({e.event_id(), e.aggregate_id(), "refund",
                          order->currency, order->total_cents});
    }
    order->status = "CANCELLED";
  }
}

}  // namespace

absl::StatusOr<v1::LegacyOrderPayload> DecodeOrderPayload(const v1::Event& e) {
  v1::LegacyOrderPayload p;
  const std::string& type = e.event_type();
  bool ok = false;
  if (e.has_payload()) {
    if (type == "OrderCreated") {
      ok = e.payload().UnpackTo(p.mutable_order_created());
    } else if (type == "OrderPaid") {
      ok = e.payload().UnpackTo(p.mutable_order_paid());
    } else if (type == "OrderCancelled") {
      ok = e.payload().UnpackTo(p.mutable_order_cancelled());
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "event_type: unknown type \"", type.substr(0, 64), "\""));
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "payload: ", type, " expected, got \"",
          e.payload().type_url().substr(0, 128), "\" (or it does not parse)"));
    }
    return p;
  }
  // An event written before the envelope was domain-free: its payload is
  // in fields 10-12, which this message names.
  if (!p.ParseFromString(e.SerializeAsString())) {
    return absl::InvalidArgumentError("payload: does not parse");
  }
  const bool matches = (type == "OrderCreated" && p.has_order_created()) ||
                       (type == "OrderPaid" && p.has_order_paid()) ||
                       (type == "OrderCancelled" && p.has_order_cancelled());
  if (!matches) {
    if (type != "OrderCreated" && type != "OrderPaid" &&
        type != "OrderCancelled") {
      return absl::InvalidArgumentError(absl::StrCat(
          "event_type: unknown type \"", type.substr(0, 64), "\""));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("payload: ", type, " without its payload"));
  }
  return p;
}

const std::vector<Migration>& BillingHandler::migrations() const {
  return kMigrations;
}

absl::Status BillingHandler::Validate(const v1::Event& e) const {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(parts...));
  };
  if (e.aggregate_type() != "order") {
    return bad("aggregate_type: \"", e.aggregate_type().substr(0, 32),
               "\" is not handled here (expected \"order\")");
  }
  if (e.schema_version() != kOrderSchemaVersion) {
    return bad("schema_version: ", e.schema_version(), " is not supported (",
               kOrderSchemaVersion, " is)");
  }
  absl::StatusOr<v1::LegacyOrderPayload> p = DecodeOrderPayload(e);
  if (!p.ok()) return p.status();
  std::string order_id;
  if (p->has_order_created()) {
    if (p->order_created().total_cents() < 0)
      return bad("payload: negative total");
    if (p->order_created().currency().size() != 3)
      return bad("payload: bad currency");
    order_id = p->order_created().order_id();
  } else if (p->has_order_paid()) {
    if (p->order_paid().amount_cents() < 0)
      return bad("payload: negative amount");
    order_id = p->order_paid().order_id();
  } else {
    if (p->order_cancelled().refund_cents() < 0)
      return bad("payload: negative refund");
    order_id = p->order_cancelled().order_id();
  }
  if (order_id != e.aggregate_id()) {
    return bad("payload: order_id does not match aggregate_id");
  }
  return absl::OkStatus();
}

std::vector<inbox::Rejection> BillingHandler::Apply(
    pqxx::work& tx, const std::vector<const v1::Event*>& events) {
  if (events.empty()) return {};
  // Validate passed for each, so each decodes; but a held event may have
  // been validated by an older release.
  std::vector<v1::LegacyOrderPayload> payloads;
  std::vector<inbox::Rejection> refused;
  payloads.reserve(events.size());
  for (size_t i = 0; i < events.size(); ++i) {
    absl::StatusOr<v1::LegacyOrderPayload> p = DecodeOrderPayload(*events[i]);
    if (!p.ok()) {
      refused.push_back({i, std::string(p.status().message())});
      continue;
    }
    payloads.push_back(*std::move(p));
  }
  if (!refused.empty()) return refused;
  std::map<std::string, OrderState> orders;
  // An order whose first event here is its OrderCreated has no view yet:
  // only the others are read, one index probe each (LIMIT 1 keeps the
  // planner from a join over a scan of every view; see inbox/engine.cc).
  ArrayLiteral ids;
  for (size_t i = 0; i < events.size(); ++i) {
    const v1::Event* e = events[i];
    if (orders.emplace(e->aggregate_id(), OrderState{}).second &&
        !(e->prev_seq() == 0 && payloads[i].has_order_created())) {
      ids.Add(e->aggregate_id());
    }
  }
  for (const auto& row :
       ids.empty()
           ? pqxx::result()
           : ExecPrepared(tx, "read_views",
                          "SELECT v.* FROM unnest($1::text[]) AS a "
                          "JOIN LATERAL (SELECT order_id, customer_id, "
                          "status, total_cents, currency, last_seq "
                          "FROM order_view WHERE order_id = a LIMIT 1) v "
                          "ON true",
                          ids.str())) {
    OrderState& o = orders[row["order_id"].as<std::string>()];
    o.customer_id = row["customer_id"].as<std::string>();
    o.status = row["status"].as<std::string>();
    o.total_cents = row["total_cents"].as<int64_t>();
    o.currency = row["currency"].as<std::string>();
    o.last_seq = row["last_seq"].as<int64_t>();
  }
  std::vector<ChargeRow> charges;
  for (size_t i = 0; i < events.size(); ++i) {
    Evolve(*events[i], payloads[i], &orders[events[i]->aggregate_id()],
           &charges);
  }
  ArrayLiteral oid, cust, status, total, cur, last;
  for (const auto& [id, o] : orders) {
    if (!o.dirty) continue;
    oid.Add(id);
    cust.Add(o.customer_id);
    status.Add(o.status.empty() ? "UNKNOWN" : o.status);
    total.Add(o.total_cents);
    cur.Add(o.currency);
    last.Add(o.last_seq);
  }
  // The views and the charges in one statement (one round trip).
#define OUTBOX_UPSERT_VIEWS                                                   \
  "INSERT INTO order_view (order_id, customer_id, status, total_cents, "      \
  "currency, last_seq) SELECT * FROM unnest($1::text[], $2::text[], "         \
  "$3::text[], $4::bigint[], $5::text[], $6::bigint[]) "                      \
  "ON CONFLICT (order_id) DO UPDATE SET customer_id = EXCLUDED.customer_id, " \
  "status = EXCLUDED.status, total_cents = EXCLUDED.total_cents, currency = " \
  "EXCLUDED.currency, last_seq = EXCLUDED.last_seq, updated_at = now()"
  if (charges.empty()) {
    ExecPrepared(tx, "upsert_views", OUTBOX_UPSERT_VIEWS, oid.str(), cust.str(),
                 status.str(), total.str(), cur.str(), last.str());
    return {};
  }
  ArrayLiteral cev, cord, kind, amount, ccur;
  for (const ChargeRow& ch : charges) {
    cev.Add(ch.event_id);
    cord.Add(ch.order_id);
    kind.Add(ch.kind);
    amount.Add(ch.amount_cents);
    ccur.Add(ch.currency);
  }
  ExecPrepared(
      tx, "upsert_views_charges",
      "WITH v AS (" OUTBOX_UPSERT_VIEWS
      ") INSERT INTO charges (event_id, order_id, kind, amount_cents, "
      "currency) SELECT * FROM unnest($7::uuid[], $8::text[], $9::text[], "
      "$10::bigint[], $11::text[]) ON CONFLICT DO NOTHING",
      oid.str(), cust.str(), status.str(), total.str(), cur.str(), last.str(),
      cev.str(), cord.str(), kind.str(), amount.str(), ccur.str());
#undef OUTBOX_UPSERT_VIEWS
  return {};
}

void BillingHandler::Rewound(
    pqxx::work& tx, const std::string& aggregate_id,
    const std::vector<inbox::AppliedEvent>& kept,
    const std::vector<inbox::AppliedEvent>& superseded) {
  ArrayLiteral gone;
  for (const inbox::AppliedEvent& e : superseded) gone.Add(e.event_id);
  tx.exec_params(
      "WITH m AS (DELETE FROM charges WHERE event_id = ANY($1::uuid[]) "
      "RETURNING *) INSERT INTO charges_superseded (event_id, order_id, kind, "
      "amount_cents, currency, created_at) SELECT event_id, order_id, kind, "
      "amount_cents, currency, created_at FROM m",
      gone.str());
  if (kept.empty()) {
    tx.exec_params("DELETE FROM order_view WHERE order_id = $1", aggregate_id);
    return;
  }
  // The view as the kept history left it: each event type sets the status.
  const std::string& last = kept.back().event_type;
  const char* status = last == "OrderPaid"        ? "PAID"
                       : last == "OrderCancelled" ? "CANCELLED"
                                                  : "CREATED";
  tx.exec_params(
      "UPDATE order_view SET status = $2, last_seq = $3, updated_at = now() "
      "WHERE order_id = $1",
      aggregate_id, status, kept.back().seq);
}

}  // namespace outbox::consumer
