#include "consumer/applier.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/fault.h"
#include "common/ids.h"
#include "consumer/apply_rules.h"

namespace outbox::consumer {
namespace {

std::string Hex(const std::string& bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

std::string OccurredAt(const v1::Event& e) {
  absl::Time t = FromTimestamp(e.occurred_at());
  return absl::FormatTime("%Y-%m-%d %H:%M:%E6S+00", t, absl::UTCTimeZone());
}

// The billing view of one order while a batch is applied.
struct OrderState {
  bool exists = false;
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
    order->exists = true;
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

v1::EventResult Result(const v1::Event& e, v1::DeliveryOutcome outcome,
                       std::string reason = "") {
  v1::EventResult r;
  r.set_event_id(e.event_id());
  r.set_seq(e.seq());
  r.set_outcome(outcome);
  r.set_reason(std::move(reason));
  return r;
}

bool Transient(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kAborted ||
         s.code() == absl::StatusCode::kDeadlineExceeded ||
         s.code() == absl::StatusCode::kResourceExhausted;
}

}  // namespace

Applier::Applier(Database* db, Metrics* metrics)
    : db_(db),
      applied_(metrics->AddCounter(
          "outbox_consumer_events_total{outcome=\"applied\"}",
          "Events answered, by outcome.")),
      duplicates_(metrics->AddCounter(
          "outbox_consumer_events_total{outcome=\"duplicate\"}",
          "Events answered, by outcome.")),
      held_(metrics->AddCounter("outbox_consumer_events_total{outcome=\"held\"}",
                                "Events answered, by outcome.")),
      rejected_(metrics->AddCounter(
          "outbox_consumer_events_total{outcome=\"rejected\"}",
          "Events answered, by outcome.")),
      drained_(metrics->AddCounter(
          "outbox_consumer_held_applied_total",
          "Held events applied once their predecessor arrived.")) {}

absl::StatusOr<std::vector<v1::EventResult>> Applier::ApplyBatch(
    const std::vector<const v1::Event*>& events) {
  absl::StatusOr<std::vector<v1::EventResult>> results;
  for (int attempt = 0; attempt < 5; ++attempt) {
    results = ApplyOnce(events);
    if (results.ok() || results.status().code() != absl::StatusCode::kAborted) {
      break;  // Aborted (serialization, deadlock) is worth an immediate retry
    }
  }
  if (!results.ok() && !Transient(results.status()) && events.size() > 1) {
    // Something in the batch fails for good (bad data the rules did not
    // catch). Apply one by one so that only the culprit is rejected.
    spdlog::warn("consumer: batch of {} failed ({}); applying one by one",
                 events.size(), results.status().ToString());
    std::vector<v1::EventResult> each;
    for (const v1::Event* e : events) {
      auto one = ApplyBatch({e});
      if (!one.ok()) return one.status();
      each.push_back(std::move((*one)[0]));
    }
    return each;
  }
  if (!results.ok() && !Transient(results.status())) {
    rejected_->Add();
    return std::vector<v1::EventResult>{
        Result(*events[0], v1::REJECTED,
               absl::StrCat("cannot apply: ", results.status().message()))};
  }
  if (results.ok()) {
    for (const auto& r : *results) {
      switch (r.outcome()) {
        case v1::APPLIED: applied_->Add(); break;
        case v1::DUPLICATE: duplicates_->Add(); break;
        case v1::HELD: held_->Add(); break;
        default: rejected_->Add();
      }
    }
  }
  return results;
}

absl::StatusOr<std::vector<v1::EventResult>> Applier::ApplyOnce(
    const std::vector<const v1::Event*>& events) {
  std::vector<v1::EventResult> results(events.size());
  std::vector<bool> valid(events.size());
  std::set<std::string> aggregates;
  for (size_t i = 0; i < events.size(); ++i) {
    absl::Status s = ValidateEvent(*events[i]);
    valid[i] = s.ok();
    if (valid[i]) {
      aggregates.insert(events[i]->aggregate_id());
    } else {
      results[i] = Result(*events[i], v1::REJECTED, std::string(s.message()));
    }
  }
  if (aggregates.empty()) return results;

  // The whole batch is decided in memory and written with a fixed handful
  // of statements, whatever its size.
  int64_t drained = 0;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    drained = 0;
    pqxx::work tx(c);
    ArrayLiteral ids;
    for (const std::string& a : aggregates) ids.Add(a);
    // Lock every aggregate of the batch, in sorted order, for the whole
    // transaction: holding and applying serialize on these rows, so two
    // replicas never strand a held event, and never deadlock.
    tx.exec_params(
        "INSERT INTO aggregate_cursors (aggregate_id) "
        "SELECT a FROM unnest($1::text[]) AS a ORDER BY a "
        "ON CONFLICT DO NOTHING",
        ids.str());
    std::map<std::string, int64_t> cursor;
    for (const auto& row : tx.exec_params(
             "SELECT aggregate_id, last_seq FROM aggregate_cursors "
             "WHERE aggregate_id = ANY($1::text[]) ORDER BY aggregate_id "
             "FOR UPDATE",
             ids.str())) {
      cursor[row[0].as<std::string>()] = row[1].as<int64_t>();
    }
    const std::map<std::string, int64_t> cursor_before = cursor;
    // Held events of these aggregates, by (aggregate, prev_seq).
    std::map<std::pair<std::string, int64_t>, v1::Event> held;
    std::set<std::string> held_ids;
    for (const auto& row : tx.exec_params(
             "SELECT payload FROM held_events WHERE aggregate_id = "
             "ANY($1::text[])",
             ids.str())) {
      v1::Event h;
      if (!h.ParseFromString(pqxx::binarystring(row[0]).str())) {
        return absl::DataLossError("a held event is unreadable");
      }
      held_ids.insert(h.event_id());
      held.emplace(std::make_pair(h.aggregate_id(), h.prev_seq()),
                   std::move(h));
    }
    std::map<std::string, OrderState> orders;
    for (const auto& row : tx.exec_params(
             "SELECT order_id, customer_id, status, total_cents, currency, "
             "last_seq FROM order_view WHERE order_id = ANY($1::text[])",
             ids.str())) {
      OrderState& o = orders[row[0].as<std::string>()];
      o.exists = true;
      o.customer_id = row[1].as<std::string>();
      o.status = row[2].as<std::string>();
      o.total_cents = row[3].as<int64_t>();
      o.currency = row[4].as<std::string>();
      o.last_seq = row[5].as<int64_t>();
    }

    std::vector<v1::Event> to_apply;  // in apply order
    std::vector<v1::Event> to_hold;
    std::vector<std::string> unheld;  // drained from held_events
    auto apply = [&](const v1::Event& e) {
      to_apply.push_back(e);
      int64_t& cur = cursor[e.aggregate_id()];
      cur = e.seq();
      // Its held successors follow at once, in chain order.
      for (auto it = held.find({e.aggregate_id(), cur}); it != held.end();
           it = held.find({e.aggregate_id(), cur})) {
        to_apply.push_back(it->second);
        cur = it->second.seq();
        if (held_ids.count(it->second.event_id())) {
          unheld.push_back(it->second.event_id());
          ++drained;
        }
        held.erase(it);
      }
    };
    for (size_t i = 0; i < events.size(); ++i) {
      if (!valid[i]) continue;
      const v1::Event& e = *events[i];
      const int64_t cur = cursor[e.aggregate_id()];
      switch (Decide(e.seq(), e.prev_seq(), cur)) {
        case Decision::kDuplicate:
          results[i] = Result(e, v1::DUPLICATE);
          break;
        case Decision::kApply:
          apply(e);
          results[i] = Result(e, v1::APPLIED);
          break;
        case Decision::kHold: {
          // Parked in memory too, so a predecessor later in this batch
          // drains it at once.
          auto key = std::make_pair(e.aggregate_id(), e.prev_seq());
          if (!held.count(key)) {
            held.emplace(key, e);
            to_hold.push_back(e);
          }
          results[i] = Result(e, v1::HELD);
          break;
        }
        case Decision::kReject:
          results[i] = Result(
              e, v1::REJECTED,
              absl::StrCat("prev_seq ", e.prev_seq(), " is behind the applied "
                           "position ", cur, " while seq ", e.seq(),
                           " is ahead of it: the chain is broken"));
          break;
      }
    }
    // Held in this batch and drained in this batch: never written as held.
    std::set<std::string> applied_ids;
    for (const v1::Event& e : to_apply) applied_ids.insert(e.event_id());
    for (v1::EventResult& r : results) {
      if (r.outcome() == v1::HELD && applied_ids.count(r.event_id())) {
        r.set_outcome(v1::APPLIED);
      }
    }

    if (!to_apply.empty()) {
      ArrayLiteral ev, agg, seq, type, at;
      for (const v1::Event& e : to_apply) {
        ev.Add(e.event_id());
        agg.Add(e.aggregate_id());
        seq.Add(e.seq());
        type.Add(e.event_type());
        at.Add(OccurredAt(e));
      }
      pqxx::result inserted = tx.exec_params(
          "INSERT INTO inbox (event_id, aggregate_id, seq, event_type, "
          "occurred_at) SELECT * FROM unnest($1::uuid[], $2::text[], "
          "$3::bigint[], $4::text[], $5::timestamptz[]) "
          "ON CONFLICT DO NOTHING",
          ev.str(), agg.str(), seq.str(), type.str(), at.str());
      if (inserted.affected_rows() != to_apply.size()) {
        // The inbox knew an event the cursor did not: never written by this
        // code. Refuse rather than guess which effect is owed.
        return absl::DataLossError(
            "inbox and aggregate cursors disagree; refusing the batch");
      }
      std::vector<ChargeRow> charges;
      for (const v1::Event& e : to_apply) {
        Evolve(e, &orders[e.aggregate_id()], &charges);
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
      tx.exec_params(
          "INSERT INTO order_view (order_id, customer_id, status, "
          "total_cents, currency, last_seq) SELECT * FROM unnest($1::text[], "
          "$2::text[], $3::text[], $4::bigint[], $5::text[], $6::bigint[]) "
          "ON CONFLICT (order_id) DO UPDATE SET customer_id = "
          "EXCLUDED.customer_id, status = EXCLUDED.status, total_cents = "
          "EXCLUDED.total_cents, currency = EXCLUDED.currency, last_seq = "
          "EXCLUDED.last_seq, updated_at = now()",
          oid.str(), cust.str(), status.str(), total.str(), cur.str(),
          last.str());
      if (!charges.empty()) {
        ArrayLiteral cev, cord, kind, amount, ccur;
        for (const ChargeRow& ch : charges) {
          cev.Add(ch.event_id);
          cord.Add(ch.order_id);
          kind.Add(ch.kind);
          amount.Add(ch.amount_cents);
          ccur.Add(ch.currency);
        }
        tx.exec_params(
            "INSERT INTO charges (event_id, order_id, kind, amount_cents, "
            "currency) SELECT * FROM unnest($1::uuid[], $2::text[], "
            "$3::text[], $4::bigint[], $5::text[]) ON CONFLICT DO NOTHING",
            cev.str(), cord.str(), kind.str(), amount.str(), ccur.str());
      }
    }
    ArrayLiteral hev, hagg, hseq, hprev, hpay;
    for (const v1::Event& e : to_hold) {
      if (applied_ids.count(e.event_id())) continue;
      hev.Add(e.event_id());
      hagg.Add(e.aggregate_id());
      hseq.Add(e.seq());
      hprev.Add(e.prev_seq());
      hpay.Add(Hex(e.SerializeAsString()));
    }
    if (!hev.empty()) {
      tx.exec_params(
          "INSERT INTO held_events (event_id, aggregate_id, seq, prev_seq, "
          "payload) SELECT e, a, s, p, decode(h, 'hex') FROM unnest("
          "$1::uuid[], $2::text[], $3::bigint[], $4::bigint[], $5::text[]) "
          "AS t(e, a, s, p, h) ON CONFLICT DO NOTHING",
          hev.str(), hagg.str(), hseq.str(), hprev.str(), hpay.str());
    }
    ArrayLiteral moved, moved_to;
    for (const auto& [agg, seq] : cursor) {
      if (seq == cursor_before.at(agg)) continue;
      moved.Add(agg);
      moved_to.Add(seq);
    }
    if (!moved.empty()) {
      // Held copies at or below the new position are drained or stale.
      tx.exec_params(
          "DELETE FROM held_events h USING unnest($1::text[], $2::bigint[]) "
          "AS m(a, s) WHERE h.aggregate_id = m.a AND h.seq <= m.s",
          moved.str(), moved_to.str());
      tx.exec_params(
          "UPDATE aggregate_cursors c SET last_seq = m.s, updated_at = now() "
          "FROM unnest($1::text[], $2::bigint[]) AS m(a, s) "
          "WHERE c.aggregate_id = m.a",
          moved.str(), moved_to.str());
    }
    MaybeCrash("consumer.before_commit");
    tx.commit();
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  drained_->Add(drained);
  return results;
}

}  // namespace outbox::consumer
