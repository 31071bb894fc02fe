#include "tools/checker.h"

#include <algorithm>
#include <map>
#include <pqxx/pqxx>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/db.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/schema.h"
#include "consumer/billing.h"
#include "outbox/v1/event.pb.h"

namespace outbox::tools {
namespace {

constexpr size_t kMaxExamples = 20;

// Chains are keyed as the relay keys them (OutboxChain: type and id); a
// consumer's row from before chains had a type has type "".
std::string Chain(const std::string& type, const std::string& id) {
  return ChainKey("", type, id);
}

void Example(CheckReport* r, std::string s) {
  if (r->examples.size() < kMaxExamples) r->examples.push_back(std::move(s));
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i =
      std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

}  // namespace

std::string CheckReport::Summary() const {
  std::string s = absl::StrFormat(
      "events committed   %d\n"
      "applied            %d\n"
      "dead letters       %d (and %d events waiting behind them)\n"
      "still pending      %d\n"
      "held at consumer   %d\n"
      "drained            %s in %s%s\n"
      "latency created->applied  p50 %.1f ms  p99 %.1f ms\n"
      "I1 lost            %s (missing effects %d)\n"
      "I2 duplicate effect %d\n"
      "I3 order violations %d\n"
      "I4 phantoms        %d\n"
      "view mismatches    %d\n"
      "pruned by retention %d from the outbox, %d from the inbox\n"
      "diverged           %d aggregates (%d deliveries parked, %d applied "
      "events the outbox lacks); superseded by an operator %d\n",
      events, applied, dead_letters, behind_dead, pending, held,
      drained ? "yes" : "NO", absl::FormatDuration(drain_time),
      heal_due.empty()
          ? ""
          : absl::StrCat(" (a heal is due: ", heal_due,
                         "; until a relay ran it, what the consumer lost is "
                         "not delivered again, nor every divergence "
                         "recorded)"),
      latency_p50_ms,
      latency_p99_ms,
      drained ? absl::StrCat(lost)
              : absl::StrCat(lost, " known; unknown until drained (", pending,
                             " pending, ", held, " held)"),
      missing_effects, duplicate_effects, order_violations, phantoms,
      view_mismatches, pruned_from_outbox, pruned_from_inbox, diverged,
      diverged_events, orphaned, superseded);
  for (const std::string& e : examples) absl::StrAppend(&s, "  ! ", e, "\n");
  absl::StrAppend(
      &s, ok() ? "RESULT: OK, every invariant holds\n" : "RESULT: VIOLATION\n");
  return s;
}

std::string CheckReport::Json() const {
  std::string ex = "[";
  for (size_t i = 0; i < examples.size(); ++i) {
    absl::StrAppend(&ex, i ? "," : "", "\"", JsonEscape(examples[i]), "\"");
  }
  ex += "]";
  return absl::StrFormat(
      "{\"ok\":%s,\"events\":%d,\"applied\":%d,\"dead_letters\":%d,"
      "\"behind_dead\":%d,\"pending\":%d,\"held\":%d,\"drained\":%s,"
      "\"drain_seconds\":%.3f,\"lost\":%d,\"missing_effects\":%d,"
      "\"duplicate_effects\":%d,\"order_violations\":%d,\"phantoms\":%d,"
      "\"view_mismatches\":%d,\"latency_p50_ms\":%.2f,"
      "\"latency_p99_ms\":%.2f,\"pruned_from_outbox\":%d,"
      "\"pruned_from_inbox\":%d,\"lost_known\":%s,\"diverged\":%d,"
      "\"diverged_events\":%d,\"orphaned\":%d,\"superseded\":%d,"
      "\"heal_due\":\"%s\",\"examples\":%s}\n",
      ok() ? "true" : "false", events, applied, dead_letters, behind_dead,
      pending, held, drained ? "true" : "false",
      absl::ToDoubleSeconds(drain_time), lost, missing_effects,
      duplicate_effects, order_violations, phantoms, view_mismatches,
      latency_p50_ms, latency_p99_ms, pruned_from_outbox, pruned_from_inbox,
      drained ? "true" : "false", diverged, diverged_events, orphaned,
      superseded, JsonEscape(heal_due), ex);
}

std::string OutboxSourceName(pqxx::transaction_base& o) {
  if (!o.exec("SELECT to_regclass('outbox_source') IS NOT NULL")[0][0]
           .as<bool>()) {
    return "";
  }
  pqxx::result n = o.exec("SELECT name FROM outbox_source");
  return n.empty() ? "" : n[0][0].as<std::string>();
}

std::string RowsOfSource(pqxx::transaction_base& b, const std::string& source,
                         const std::string& prefix) {
  if (b.exec("SELECT 1 FROM information_schema.columns WHERE table_name = "
             "'inbox' AND column_name = 'source'")
          .empty()) {
    return "true";
  }
  const std::string q = b.quote(source);
  return absl::StrCat("(", prefix, "source = ", q, " OR (", prefix,
                      "source = '' AND EXISTS (SELECT 1 FROM "
                      "inbox_legacy_source l WHERE l.source IS NULL OR "
                      "l.source = ",
                      q, ")))");
}

CheckReport Verdict(const CheckFacts& f) {
  CheckReport r;
  r.drained = f.drained;
  r.drain_time = f.drain_time;
  r.heal_due = f.heal_due;
  const auto& committed = f.committed;
  const auto& applied = f.applied;
  const auto& pruned_through = f.pruned_through;
  const auto& superseded = f.superseded;
  const int64_t retained_from = f.retained_from;
  r.held = f.held;
  r.superseded = static_cast<int64_t>(superseded.size());
  // A divergence from before chains had a type ("") is of every type.
  auto diverged_at = [&](const std::string& type, const std::string& id) {
    return f.diverged.count(Chain(type, id)) > 0 ||
           f.diverged.count(Chain("", id)) > 0;
  };
  r.diverged = static_cast<int64_t>(f.diverged.size());
  for (const auto& [agg, why] : f.diverged) {
    Example(&r, absl::StrCat("diverged: aggregate ", ChainLabel(agg), ": ", why,
                             " (outboxctl resolve decides)"));
  }
  // Chains stalled for an operator: a dead letter or a divergence.
  std::set<std::string> dead_aggregates;
  for (const auto& [id, c] : committed) {
    if (c.status == kDeliveryDead || c.status == kDeliveryDiverged) {
      dead_aggregates.insert(c.chain);
    }
  }
  // Of a chain (a cursor from before chains had a type counts for each).
  auto pruned_at = [&](const std::string& chain, int64_t seq) {
    auto it = pruned_through.find(chain);
    if (it == pruned_through.end()) {
      ChainId c;
      ParseChainKey(chain, &c);
      it = pruned_through.find(Chain("", c.id));
    }
    return it != pruned_through.end() && seq <= it->second;
  };
  auto is_diverged = [&](const std::string& chain) {
    ChainId c;
    ParseChainKey(chain, &c);
    return diverged_at(c.type, c.id);
  };

  r.events = static_cast<int64_t>(committed.size());
  r.applied = static_cast<int64_t>(applied.size());
  std::set<std::string> applied_ids;
  std::set<std::string> pruned_from_outbox_ids;
  std::set<std::string> orphan_ids;             // applied, lost by the outbox
  std::map<std::string, int64_t> last_applied;  // aggregate -> seq
  std::vector<double> latencies;
  for (const AppliedEvent& a : applied) {
    applied_ids.insert(a.event_id);
    auto c = committed.find(a.event_id);
    if (c == committed.end() && a.seq < retained_from) {
      ++r.pruned_from_outbox;
      pruned_from_outbox_ids.insert(a.event_id);
      last_applied[a.chain] = a.seq;
      continue;
    }
    if (c == committed.end() && is_diverged(a.chain)) {
      // Committed once and lost by the outbox (a failover): a divergence
      // names it, for an operator.
      ++r.orphaned;
      orphan_ids.insert(a.event_id);
      last_applied[a.chain] = a.seq;
      continue;
    }
    if (c == committed.end()) {
      ++r.phantoms;
      Example(&r, absl::StrCat("I4 phantom: event ", a.event_id, " of ",
                               a.aggregate_id, " applied, never committed"));
      continue;
    }
    int64_t& last = last_applied[c->second.chain];
    // Its predecessor's inbox row may be gone to retention.
    if (c->second.prev_seq != last &&
        !(last == 0 && pruned_at(c->second.chain, c->second.prev_seq))) {
      ++r.order_violations;
      Example(&r,
              absl::StrCat("I3 order: aggregate ", ChainLabel(c->second.chain),
                           " applied seq ", a.seq, " (prev_seq ",
                           c->second.prev_seq, ") after seq ", last));
    }
    last = a.seq;
    latencies.push_back((a.applied_us - c->second.created_us) / 1000.0);
  }
  for (const auto& [id, c] : committed) {
    if (c.status == kDeliveryDead) {
      ++r.dead_letters;
      continue;
    }
    if (c.status == kDeliveryDiverged) {
      ++r.diverged_events;
      continue;
    }
    if (applied_ids.count(id)) {
      // The effect each applied event must have, exactly once.
      const bool pays = c.type == "OrderPaid" ||
                        (c.type == "OrderCancelled" && c.refund_cents > 0);
      auto ch = f.charges_by_event.find(id);
      const int charges = ch == f.charges_by_event.end() ? 0 : ch->second;
      if (pays && charges == 0) {
        ++r.missing_effects;
        Example(&r, absl::StrCat("I1 effect: ", c.type, " ", id, " of ",
                                 c.aggregate_id, " has no charge row"));
      }
      if (charges > (pays ? 1 : 0)) {
        ++r.duplicate_effects;
        Example(&r,
                absl::StrCat("I2 duplicate effect: ", c.type, " ", id, " of ",
                             c.aggregate_id, " has ", charges, " charge rows"));
      }
      continue;
    }
    if (pruned_at(c.chain, c.seq)) {
      ++r.pruned_from_inbox;  // applied; its inbox row is gone
    } else if (c.status == kDeliveryPending && dead_aggregates.count(c.chain)) {
      ++r.behind_dead;
    } else if (!r.drained) {
      ++r.pending;  // not delivered yet, or held: not lost (yet)
    } else {
      ++r.lost;
      Example(&r, absl::StrCat("I1 lost: ", c.type, " ", id, " (seq ", c.seq,
                               ", aggregate ", c.aggregate_id, ", ", c.status,
                               ") was never applied"));
    }
  }
  for (const auto& [event_id, n] : f.charges_by_event) {
    // A charge of an event no database holds any more (both retentions
    // deleted it) is not a phantom.
    if (!committed.count(event_id) && !applied_ids.count(event_id) &&
        retained_from > 1 && !pruned_through.empty()) {
      continue;
    }
    if (superseded.count(event_id)) continue;  // recorded, decided
    if (!committed.count(event_id) && !pruned_from_outbox_ids.count(event_id) &&
        !orphan_ids.count(event_id)) {
      ++r.phantoms;
      Example(&r, absl::StrCat("I4 phantom charge for event ", event_id));
    }
  }
  for (const auto& [order_id, status] : f.order_status) {
    if (dead_aggregates.count(Chain("order", order_id)) ||
        diverged_at("order", order_id) || !r.drained) {
      continue;
    }
    auto v = f.view_status.find(order_id);
    if (v == f.view_status.end() || v->second != status) {
      ++r.view_mismatches;
      Example(&r,
              absl::StrCat("order ", order_id, " is ", status,
                           " but the consumer's view says ",
                           v == f.view_status.end() ? "nothing" : v->second));
    }
  }
  r.latency_p50_ms = Percentile(latencies, 0.50);
  r.latency_p99_ms = Percentile(latencies, 0.99);
  return r;
}

absl::StatusOr<CheckReport> Check(const std::string& orders_url,
                                  const std::string& billing_url,
                                  absl::Duration wait, const DbSession& session,
                                  const std::string& subscription) {
  CheckFacts f;
  auto orders_conn = Connect(orders_url, "outboxctl-verify", session);
  if (!orders_conn.ok()) return orders_conn.status();
  auto billing_conn = Connect(billing_url, "outboxctl-verify", session);
  if (!billing_conn.ok()) return billing_conn.status();
  pqxx::connection& orders = **orders_conn;
  pqxx::connection& billing = **billing_conn;
  try {
    const absl::Time start = absl::Now();
    // What waits for an operator (a divergence), as the relays recorded it.
    auto diverged_aggregates = [&](pqxx::transaction_base& o) {
      std::map<std::string, std::string> out;
      if (o.exec("SELECT to_regclass('outbox_divergences') IS NOT NULL")[0][0]
              .as<bool>()) {
        for (const auto& row : o.exec_params(
                 "SELECT aggregate_id, kind || ': ' || detail AS why, "
                 "aggregate_type FROM outbox_divergences WHERE subscription "
                 "= $1 AND resolved_at IS NULL",
                 subscription)) {
          out[Chain(row["aggregate_type"].as<std::string>(),
                    row["aggregate_id"].as<std::string>())] =
              row["why"].as<std::string>();
        }
      }
      return out;
    };
    // The name this outbox's events carry, and whether the consumer keeps
    // chains by source: then only its rows of this source count (and those
    // from before chains had one, source ''), as it may take events from
    // other outboxes too.
    // A WHERE condition on the billing table aliased `t`.
    std::string ours;
    bool by_source = false;
    {
      pqxx::nontransaction o(orders), b(billing);
      ours = RowsOfSource(b, OutboxSourceName(o), "t.");
      by_source = ours != "true";
    }
    for (;;) {
      pqxx::nontransaction o(orders), b(billing);
      // Pending rows not behind a dead or diverged event of their
      // aggregate, and what the log still owes (read, it joins the rows
      // above), counted in one scan rather than a function call per event.
      static const std::string kUndrainedSql =
          "SELECT (SELECT count(*) FROM outbox_delivery p"
          "          JOIN outbox op ON op.seq = p.seq"
          "         WHERE p.subscription = $1 AND p.status = 'pending'"
          "           AND NOT EXISTS ("
          "               SELECT 1 FROM outbox_delivery d"
          "                 JOIN outbox od ON od.seq = d.seq"
          "                WHERE d.subscription = $1"
          "                  AND d.aggregate_id = p.aggregate_id"
          "                  AND od.aggregate_type = op.aggregate_type"
          "                  AND d.status IN ('dead', 'diverged')))"
          "     + (SELECT coalesce(sum(events), 0)"
          "          FROM outbox_log_owed_by($1, $2::int[], 1000000000))";
      std::vector<int> every_partition;
      for (int p = 0; p < kPartitionCount; ++p) every_partition.push_back(p);
      const int64_t undrained =
          o.exec_params(kUndrainedSql, subscription,
                        ArrayLiteral(every_partition).str())[0][0]
              .as<int64_t>();
      ArrayLiteral waiting;
      for (const auto& [agg, why] : diverged_aggregates(o)) {
        ChainId c;
        ParseChainKey(agg, &c);
        waiting.Add(c.id);
      }
      const int64_t held =
          b.exec_params(absl::StrCat("SELECT count(*) FROM held_events t "
                                     "WHERE NOT (aggregate_id = "
                                     "ANY($1::text[])) AND ",
                                     ours),
                        waiting.str())[0][0]
              .as<int64_t>();
      f.heal_due = DueHealText(o, subscription);
      if (undrained == 0 && held == 0 && f.heal_due.empty()) {
        f.drained = true;
        break;
      }
      if (absl::Now() - start > wait) break;
      o.abort();
      b.abort();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    f.drain_time = absl::Now() - start;

    pqxx::read_transaction o(orders);
    ApplyLimits(o);
    f.diverged = diverged_aggregates(o);
    for (const auto& row : o.exec_params(
             absl::StrCat(
                 "SELECT o.event_id::text AS event_id, o.aggregate_id, o.seq, "
                 "o.prev_seq, o.event_type, ",
                 kDeliveryStatusSql,
                 " AS status, "
                 "(extract(epoch FROM o.created_at) * 1000000)::bigint AS "
                 "created_us, o.payload, o.aggregate_type FROM outbox o JOIN "
                 "subscriptions s ON s.name = $1 "
                 "LEFT JOIN outbox_delivery d ON d.subscription = $1 AND "
                 "d.seq = o.seq",
                 kDeliveryLogJoinsSql, "WHERE o.seq >= s.start_seq"),
             subscription)) {
      CommittedEvent c;
      c.aggregate_id = row["aggregate_id"].as<std::string>();
      c.chain = Chain(row["aggregate_type"].as<std::string>(), c.aggregate_id);
      c.seq = row["seq"].as<int64_t>();
      c.prev_seq = row["prev_seq"].as<int64_t>();
      c.type = row["event_type"].as<std::string>();
      c.status = row["status"].as<std::string>();
      c.created_us = row["created_us"].as<int64_t>();
      if (c.type == "OrderCancelled") {
        v1::Event e;
        if (e.ParseFromString(pqxx::binarystring(row["payload"]).str())) {
          if (auto p = consumer::DecodeOrderPayload(e); p.ok()) {
            c.refund_cents = p->order_cancelled().refund_cents();
          }
        }
      }
      f.committed.emplace(row["event_id"].as<std::string>(), std::move(c));
    }
    // Events below it were deleted by --retention.
    f.retained_from =
        o.exec(absl::StrCat("SELECT ", kMinRetainedSql))[0][0].as<int64_t>();
    for (const auto& row :
         o.exec("SELECT order_id::text AS order_id, status FROM orders")) {
      f.order_status[row["order_id"].as<std::string>()] =
          row["status"].as<std::string>();
    }
    o.commit();

    pqxx::read_transaction b(billing);
    ApplyLimits(b);
    for (const auto& row : b.exec(absl::StrCat(
             "SELECT event_id::text AS event_id, aggregate_id, seq, "
             "(extract(epoch FROM applied_at) * 1000000)::bigint AS "
             "applied_us, ",
             by_source ? "aggregate_type" : "'' AS aggregate_type",
             " FROM inbox t WHERE ", ours, " ORDER BY apply_id"))) {
      const std::string event_id = row["event_id"].as<std::string>();
      const std::string aggregate_id = row["aggregate_id"].as<std::string>();
      std::string type = row["aggregate_type"].as<std::string>();
      if (type.empty()) {
        // Recorded before chains had a type: that of the committed event.
        auto c = f.committed.find(event_id);
        if (c != f.committed.end()) {
          ChainId id;
          ParseChainKey(c->second.chain, &id);
          type = id.type;
        }
      }
      f.applied.push_back({event_id, Chain(type, aggregate_id), aggregate_id,
                           row["seq"].as<int64_t>(),
                           row["applied_us"].as<int64_t>()});
    }
    // Charges of events applied from another source are that source's.
    for (const auto& row : b.exec(absl::StrCat(
             "SELECT event_id::text AS event_id FROM charges c",
             by_source ? " WHERE NOT EXISTS (SELECT 1 FROM inbox t WHERE "
                         "t.event_id = c.event_id AND NOT "
                       : "",
             by_source ? ours : "", by_source ? ")" : ""))) {
      ++f.charges_by_event[row["event_id"].as<std::string>()];
    }
    for (const auto& row : b.exec("SELECT order_id, status FROM order_view")) {
      f.view_status[row["order_id"].as<std::string>()] =
          row["status"].as<std::string>();
    }
    f.held = b.exec(absl::StrCat("SELECT count(*) FROM held_events t WHERE ",
                                 ours))[0][0]
                 .as<int64_t>();
    // Applied events an operator superseded (their effects stay, recorded).
    if (b.exec("SELECT to_regclass('inbox_superseded') IS NOT NULL")[0][0]
            .as<bool>()) {
      for (const auto& row :
           b.exec("SELECT DISTINCT event_id::text AS event_id FROM "
                  "inbox_superseded")) {
        f.superseded.insert(row["event_id"].as<std::string>());
      }
    }
    // How far --inbox_retention deleted each aggregate's inbox rows.
    if (b.exec("SELECT 1 FROM information_schema.columns WHERE table_name = "
               "'aggregate_cursors' AND column_name = 'pruned_through'")
            .size() > 0) {
      for (const auto& row : b.exec(absl::StrCat(
               "SELECT aggregate_id, pruned_through, ",
               by_source ? "aggregate_type" : "'' AS aggregate_type",
               " FROM aggregate_cursors t WHERE pruned_through > 0 AND ",
               ours))) {
        f.pruned_through[Chain(row["aggregate_type"].as<std::string>(),
                               row["aggregate_id"].as<std::string>())] =
            row["pruned_through"].as<int64_t>();
      }
    }
    b.commit();
    return Verdict(f);
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

}  // namespace outbox::tools
