#include "consumer/applier.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fault.h"
#include "common/ids.h"
#include "consumer/apply_rules.h"

namespace outbox::consumer {
namespace {

// A PostgreSQL text[] literal of `values` (escaped for the array syntax).
std::string TextArray(const std::set<std::string>& values) {
  std::string out = "{";
  bool first = true;
  for (const std::string& v : values) {
    if (!first) out += ",";
    first = false;
    out += "\"";
    for (char c : v) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    out += "\"";
  }
  return out + "}";
}

std::string OccurredAt(const v1::Event& e) {
  absl::Time t = FromTimestamp(e.occurred_at());
  return absl::FormatTime("%Y-%m-%d %H:%M:%E6S+00", t, absl::UTCTimeZone());
}

// Writes the inbox row and the billing effects of `e`. False if the inbox
// already had it (nothing written then).
bool ApplyEffects(pqxx::work& tx, const v1::Event& e) {
  pqxx::result inbox = tx.exec_params(
      "INSERT INTO inbox (event_id, aggregate_id, seq, event_type, "
      "occurred_at) VALUES ($1, $2, $3, $4, $5) "
      "ON CONFLICT DO NOTHING RETURNING apply_id",
      e.event_id(), e.aggregate_id(), e.seq(), e.event_type(), OccurredAt(e));
  if (inbox.empty()) return false;
  if (e.has_order_created()) {
    const v1::OrderCreated& p = e.order_created();
    tx.exec_params(
        "INSERT INTO order_view (order_id, customer_id, status, total_cents, "
        "currency, last_seq) VALUES ($1, $2, 'CREATED', $3, $4, $5) "
        "ON CONFLICT (order_id) DO UPDATE SET customer_id = EXCLUDED.customer_id, "
        "total_cents = EXCLUDED.total_cents, currency = EXCLUDED.currency, "
        "last_seq = EXCLUDED.last_seq, updated_at = now()",
        p.order_id(), p.customer_id(), p.total_cents(), p.currency(), e.seq());
  } else if (e.has_order_paid()) {
    const v1::OrderPaid& p = e.order_paid();
    tx.exec_params(
        "WITH v AS (UPDATE order_view SET status = 'PAID', last_seq = $3, "
        "updated_at = now() WHERE order_id = $2 RETURNING currency) "
        "INSERT INTO charges (event_id, order_id, kind, amount_cents, currency) "
        "SELECT $1, $2, 'charge', $4, coalesce((SELECT currency FROM v), $5) "
        "ON CONFLICT DO NOTHING",
        e.event_id(), p.order_id(), e.seq(), p.amount_cents(), p.currency());
  } else if (e.has_order_cancelled()) {
    // A refund only if this consumer saw the order paid: its own state,
    // applied in order, decides.
    const v1::OrderCancelled& p = e.order_cancelled();
    tx.exec_params(
        "WITH old AS (SELECT status, total_cents, currency FROM order_view "
        "WHERE order_id = $2), "
        "v AS (UPDATE order_view SET status = 'CANCELLED', last_seq = $3, "
        "updated_at = now() WHERE order_id = $2) "
        "INSERT INTO charges (event_id, order_id, kind, amount_cents, currency) "
        "SELECT $1, $2, 'refund', total_cents, currency FROM old "
        "WHERE status = 'PAID' ON CONFLICT DO NOTHING",
        e.event_id(), p.order_id(), e.seq());
  }
  return true;
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

  int64_t drained = 0;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::work tx(c);
    const std::string ids = TextArray(aggregates);
    // Lock every aggregate of the batch, in sorted order, for the whole
    // transaction: holding and applying serialize on these rows.
    tx.exec_params(
        "INSERT INTO aggregate_cursors (aggregate_id) "
        "SELECT a FROM unnest($1::text[]) AS a ORDER BY a "
        "ON CONFLICT DO NOTHING",
        ids);
    std::map<std::string, int64_t> cursor;
    for (const auto& row : tx.exec_params(
             "SELECT aggregate_id, last_seq FROM aggregate_cursors "
             "WHERE aggregate_id = ANY($1::text[]) ORDER BY aggregate_id "
             "FOR UPDATE",
             ids)) {
      cursor[row[0].as<std::string>()] = row[1].as<int64_t>();
    }
    std::set<std::string> advanced;
    for (size_t i = 0; i < events.size(); ++i) {
      if (!valid[i]) continue;
      const v1::Event& e = *events[i];
      int64_t& cur = cursor[e.aggregate_id()];
      switch (Decide(e.seq(), e.prev_seq(), cur)) {
        case Decision::kDuplicate:
          results[i] = Result(e, v1::DUPLICATE);
          break;
        case Decision::kApply:
          if (ApplyEffects(tx, e)) {
            cur = e.seq();
            advanced.insert(e.aggregate_id());
            results[i] = Result(e, v1::APPLIED);
          } else {
            results[i] = Result(e, v1::DUPLICATE);
          }
          break;
        case Decision::kHold:
          tx.exec_params(
              "INSERT INTO held_events (event_id, aggregate_id, seq, prev_seq, "
              "payload) VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
              e.event_id(), e.aggregate_id(), e.seq(), e.prev_seq(),
              pqxx::binarystring(e.SerializeAsString()));
          results[i] = Result(e, v1::HELD);
          break;
        case Decision::kReject:
          results[i] = Result(
              e, v1::REJECTED,
              absl::StrCat("prev_seq ", e.prev_seq(), " is behind the applied "
                           "position ", cur, " while seq ", e.seq(),
                           " is ahead of it: the chain is broken"));
          break;
      }
    }
    // Held successors of every aggregate that moved, in chain order.
    for (const std::string& agg : advanced) {
      int64_t& cur = cursor[agg];
      for (;;) {
        pqxx::result next = tx.exec_params(
            "SELECT payload FROM held_events WHERE aggregate_id = $1 AND "
            "prev_seq = $2 ORDER BY seq LIMIT 1",
            agg, cur);
        if (next.empty()) break;
        v1::Event held;
        if (!held.ParseFromString(pqxx::binarystring(next[0][0]).str())) {
          return absl::DataLossError(
              absl::StrCat("held event of ", agg, " is unreadable"));
        }
        ApplyEffects(tx, held);
        tx.exec_params("DELETE FROM held_events WHERE event_id = $1",
                       held.event_id());
        cur = held.seq();
        ++drained;
      }
      // Held copies of events applied meanwhile are duplicates now.
      tx.exec_params(
          "DELETE FROM held_events WHERE aggregate_id = $1 AND seq <= $2", agg,
          cur);
      tx.exec_params(
          "UPDATE aggregate_cursors SET last_seq = $2, updated_at = now() "
          "WHERE aggregate_id = $1",
          agg, cur);
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
