#include "consumer/billing.h"

#include <map>
#include <string>

#include "common/db.h"

namespace outbox::consumer {
namespace {

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
void Evolve(const v1::Event& e, OrderState* order,
            std::vector<ChargeRow>* charges) {
  order->dirty = true;
  order->last_seq = e.seq();
  if (e.has_order_created()) {
    const v1::OrderCreated& p = e.order_created();
    order->customer_id = p.customer_id();
    order->status = "CREATED";
    order->total_cents = p.total_cents();
    order->currency = p.currency();
  } else if (e.has_order_paid()) {
    const v1::OrderPaid& p = e.order_paid();
    if (order->currency.empty()) order->currency = p.currency();
    charges->push_back({e.event_id(), e.aggregate_id(), "charge",
                        order->currency, p.amount_cents()});
    order->status = "PAID";
  } else if (e.has_order_cancelled()) {
    if (order->status == "PAID") {
      charges->push_back({e.event_id(), e.aggregate_id(), "refund",
                          order->currency, order->total_cents});
    }
    order->status = "CANCELLED";
  }
}

}  // namespace

void Billing::Apply(pqxx::work& tx, const std::vector<const v1::Event*>& events) {
  if (events.empty()) return;
  std::map<std::string, OrderState> orders;
  // An order whose first event here is its OrderCreated has no view yet:
  // only the others are read.
  ArrayLiteral ids;
  for (const v1::Event* e : events) {
    if (orders.emplace(e->aggregate_id(), OrderState{}).second &&
        !(e->prev_seq() == 0 && e->has_order_created())) {
      ids.Add(e->aggregate_id());
    }
  }
  for (const auto& row :
       ids.empty() ? pqxx::result()
                   : ExecPrepared(tx, "read_views",
                                  "SELECT v.* FROM unnest($1::text[]) AS a "
                                  "JOIN LATERAL (SELECT order_id, customer_id, "
                                  "status, total_cents, currency, last_seq "
                                  "FROM order_view WHERE order_id = a) v ON true",
                                  ids.str())) {
    OrderState& o = orders[row["order_id"].as<std::string>()];
    o.customer_id = row["customer_id"].as<std::string>();
    o.status = row["status"].as<std::string>();
    o.total_cents = row["total_cents"].as<int64_t>();
    o.currency = row["currency"].as<std::string>();
    o.last_seq = row["last_seq"].as<int64_t>();
  }
  std::vector<ChargeRow> charges;
  for (const v1::Event* e : events) {
    Evolve(*e, &orders[e->aggregate_id()], &charges);
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
  ExecPrepared(
      tx, "upsert_views",
      "INSERT INTO order_view (order_id, customer_id, status, total_cents, "
      "currency, last_seq) SELECT * FROM unnest($1::text[], $2::text[], "
      "$3::text[], $4::bigint[], $5::text[], $6::bigint[]) "
      "ON CONFLICT (order_id) DO UPDATE SET customer_id = "
      "EXCLUDED.customer_id, status = EXCLUDED.status, total_cents = "
      "EXCLUDED.total_cents, currency = EXCLUDED.currency, last_seq = "
      "EXCLUDED.last_seq, updated_at = now()",
      oid.str(), cust.str(), status.str(), total.str(), cur.str(), last.str());
  if (charges.empty()) return;
  ArrayLiteral cev, cord, kind, amount, ccur;
  for (const ChargeRow& ch : charges) {
    cev.Add(ch.event_id);
    cord.Add(ch.order_id);
    kind.Add(ch.kind);
    amount.Add(ch.amount_cents);
    ccur.Add(ch.currency);
  }
  ExecPrepared(
      tx, "insert_charges",
      "INSERT INTO charges (event_id, order_id, kind, amount_cents, currency) "
      "SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bigint[], "
      "$5::text[]) ON CONFLICT DO NOTHING",
      cev.str(), cord.str(), kind.str(), amount.str(), ccur.str());
}

}  // namespace outbox::consumer
