#include "tools/reconcile.h"

#include <map>
#include <pqxx/pqxx>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/schema.h"
#include "tools/checker.h"

namespace outbox::tools {
namespace {

// Ids per inbox query: one statement each, bounded.
constexpr size_t kChunk = 5000;

struct Committed {
  Finding f;
  int64_t prev_seq = 0;
  std::string status;
  int64_t attempts = 0;
  std::string last_error;
  double next_try_s = 0;  // from now; <= 0: due
  std::string aggregate_type;
};

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.0fs", absl::ToDoubleSeconds(d));
}

}  // namespace

std::string ReconcileReport::Summary() const {
  std::string s = absl::StrFormat(
      "reconcile: subscription %s, events committed between %s and %s ago\n"
      "events %d, applied %d (of which pruned from the inbox %d), not "
      "applied %d\n"
      "  pending %d, behind a dead letter %d, dead letters %d, held at the "
      "consumer %d, diverged %d, lost %d\n"
      "from the consumer back: applied but not in the outbox %d; aggregates "
      "diverged, waiting for an operator %d\n",
      subscription, Seconds(window), Seconds(grace), events, applied, pruned,
      not_applied(), pending, behind_dead, dead, held, diverged, lost, orphaned,
      open_divergences);
  for (const Finding& f : findings) {
    absl::StrAppend(
        &s, absl::StrFormat("  seq %d %s %s of %s, %s ago: %s%s%s\n", f.seq,
                            f.event_type, f.event_id, f.aggregate_id,
                            Seconds(f.age), f.reason,
                            f.detail.empty() ? "" : ": ", f.detail));
  }
  if (static_cast<int64_t>(findings.size()) < listed()) {
    absl::StrAppend(&s, "  ... and ", listed() - findings.size(), " more\n");
  }
  if (!heal_due.empty()) {
    absl::StrAppend(&s, "a heal is due (", heal_due,
                    "): until a relay ran it, what the consumer lost is not "
                    "delivered again and not every divergence is recorded; "
                    "run reconcile again once it is done\n");
  }
  absl::StrAppend(
      &s, ok()                ? "RESULT: OK, every event of the window is applied\n"
          : not_applied() > 0 ? "RESULT: NOT APPLIED, see above\n"
          : listed() > 0      ? "RESULT: DIVERGED, see above\n"
                              : "RESULT: INCOMPLETE, a heal is due\n");
  return s;
}

std::string ReconcileReport::Json() const {
  std::string list = "[";
  for (size_t i = 0; i < findings.size(); ++i) {
    const Finding& f = findings[i];
    absl::StrAppend(
        &list, i ? "," : "",
        absl::StrFormat("{\"seq\":%d,\"event_id\":\"%s\",\"aggregate_id\":"
                        "\"%s\",\"event_type\":\"%s\",\"age_s\":%.1f,"
                        "\"reason\":\"%s\",\"detail\":\"%s\"}",
                        f.seq, f.event_id, JsonEscape(f.aggregate_id),
                        JsonEscape(f.event_type), absl::ToDoubleSeconds(f.age),
                        f.reason, JsonEscape(f.detail)));
  }
  list += "]";
  return absl::StrFormat(
      "{\"ok\":%s,\"subscription\":\"%s\",\"window_s\":%.0f,\"grace_s\":%.0f,"
      "\"events\":%d,\"applied\":%d,\"pruned\":%d,\"pending\":%d,"
      "\"behind_dead\":%d,\"dead\":%d,\"held\":%d,\"lost\":%d,"
      "\"diverged\":%d,\"orphaned\":%d,\"open_divergences\":%d,"
      "\"heal_due\":\"%s\",\"findings\":%s}\n",
      ok() ? "true" : "false", JsonEscape(subscription),
      absl::ToDoubleSeconds(window), absl::ToDoubleSeconds(grace), events,
      applied, pruned, pending, behind_dead, dead, held, lost, diverged,
      orphaned, open_divergences, JsonEscape(heal_due), list);
}

absl::StatusOr<ReconcileReport> Reconcile(const std::string& outbox_url,
                                          const std::string& inbox_url,
                                          const ReconcileOptions& options,
                                          const DbSession& session) {
  ReconcileReport r;
  r.subscription = options.subscription;
  r.window = options.window;
  r.grace = options.grace;
  auto outbox_conn = Connect(outbox_url, "outboxctl-reconcile", session);
  if (!outbox_conn.ok()) return outbox_conn.status();
  auto inbox_conn = Connect(inbox_url, "outboxctl-reconcile", session);
  if (!inbox_conn.ok()) return inbox_conn.status();
  try {
    // The outbox first: an event it shows delivered was applied before it
    // was marked, so the inbox, read after, holds it.
    std::vector<Committed> events;
    std::map<std::string, int64_t> first_dead;  // chain -> lowest dead seq
    std::string source;                // the name this outbox's events carry
    std::vector<Finding> divergences;  // open, for an operator
    int64_t min_retained = 0;          // below it, retention deleted events
    {
      pqxx::read_transaction o(**outbox_conn);
      ApplyLimits(o);
      if (o.exec_params("SELECT 1 FROM subscriptions WHERE name = $1",
                        options.subscription)
              .empty()) {
        return absl::NotFoundError(
            absl::StrCat("no subscription ", options.subscription));
      }
      for (const auto& row : o.exec_params(
               absl::StrCat(
                   "SELECT o.seq, o.event_id::text AS event_id, "
                   "o.aggregate_id, o.event_type, o.prev_seq, "
                   "extract(epoch FROM now() - o.created_at)::float8 AS age, ",
                   kDeliveryStatusSql,
                   " AS status, coalesce(d.attempts, 0) AS attempts, "
                   "coalesce(d.last_error, '') AS last_error, "
                   "coalesce(extract(epoch FROM d.available_at - now()), 0)"
                   "::float8 AS next_try, o.aggregate_type FROM outbox o JOIN "
                   "subscriptions s ON s.name = $1 "
                   "LEFT JOIN outbox_delivery d ON d.subscription = $1 AND "
                   "d.seq = o.seq",
                   kDeliveryLogJoinsSql,
                   "WHERE o.seq >= s.start_seq AND o.created_at "
                   ">= now() - make_interval(secs => $2::float8) AND "
                   "o.created_at < now() - make_interval(secs => $3::float8) "
                   "ORDER BY o.seq"),
               options.subscription, absl::ToDoubleSeconds(options.window),
               absl::ToDoubleSeconds(options.grace))) {
        Committed c;
        c.f.seq = row["seq"].as<int64_t>();
        c.f.event_id = row["event_id"].as<std::string>();
        c.f.aggregate_id = row["aggregate_id"].as<std::string>();
        c.f.event_type = row["event_type"].as<std::string>();
        c.prev_seq = row["prev_seq"].as<int64_t>();
        c.f.age = absl::Seconds(row["age"].as<double>());
        c.status = row["status"].as<std::string>();
        c.attempts = row["attempts"].as<int64_t>();
        c.last_error = row["last_error"].as<std::string>();
        c.next_try_s = row["next_try"].as<double>();
        c.aggregate_type = row["aggregate_type"].as<std::string>();
        events.push_back(std::move(c));
      }
      for (const auto& row : o.exec_params(
               "SELECT o.aggregate_type, d.aggregate_id, min(d.seq) AS seq "
               "FROM "
               "outbox_delivery d JOIN outbox o ON o.seq = d.seq WHERE "
               "d.subscription = $1 AND d.status IN ('dead', 'diverged') "
               "GROUP BY 1, 2",
               options.subscription)) {
        first_dead[ChainKey("", row["aggregate_type"].as<std::string>(),
                            row["aggregate_id"].as<std::string>())] =
            row["seq"].as<int64_t>();
      }
      source = OutboxSourceName(o);
      r.heal_due = DueHealText(o, options.subscription);
      if (o.exec("SELECT to_regclass('outbox_divergences') IS NOT NULL")[0][0]
              .as<bool>()) {
        for (const auto& row : o.exec_params(
                 "SELECT aggregate_id, kind, detail, extract(epoch FROM now() "
                 "- detected_at)::float8 AS age, "
                 "coalesce(consumer_event_id::text, '') AS consumer_event_id, "
                 "coalesce(consumer_seq, 0) AS consumer_seq FROM "
                 "outbox_divergences "
                 "WHERE subscription = $1 AND resolved_at IS NULL ORDER BY id",
                 options.subscription)) {
          Finding f;
          f.aggregate_id = row["aggregate_id"].as<std::string>();
          f.reason = "diverged aggregate";
          f.detail = absl::StrCat(row["kind"].as<std::string>(), ": ",
                                  row["detail"].as<std::string>(),
                                  " (outboxctl resolve decides)");
          f.age = absl::Seconds(row["age"].as<double>());
          f.event_id = row["consumer_event_id"].as<std::string>();
          f.seq = row["consumer_seq"].as<int64_t>();
          divergences.push_back(std::move(f));
        }
      }
      // Below it retention deleted: nothing applied there is an orphan.
      min_retained =
          o.exec(absl::StrCat("SELECT ", kMinRetainedSql))[0][0].as<int64_t>();
    }

    std::set<std::string> applied;
    std::map<std::string, int64_t> held_prev;       // event id -> its prev_seq
    std::map<std::string, int64_t> pruned_through;  // by chain
    bool by_source = false;
    std::string ours;  // the inbox rows of this outbox's source
    {
      pqxx::read_transaction b(**inbox_conn);
      ApplyLimits(b);
      const bool has_pruned =
          !b.exec(
                "SELECT 1 FROM information_schema.columns WHERE table_name "
                "= 'aggregate_cursors' AND column_name = 'pruned_through'")
               .empty();
      ours = RowsOfSource(b, source, "");
      by_source = ours != "true";
      for (size_t i = 0; i < events.size(); i += kChunk) {
        ArrayLiteral ids, aggs;
        for (size_t j = i; j < std::min(events.size(), i + kChunk); ++j) {
          ids.Add(events[j].f.event_id);
          aggs.Add(events[j].f.aggregate_id);
        }
        for (const auto& row :
             b.exec_params("SELECT event_id::text FROM inbox WHERE event_id = "
                           "ANY($1::uuid[])",
                           ids.str())) {
          applied.insert(row[0].as<std::string>());
        }
        for (const auto& row :
             b.exec_params("SELECT event_id::text AS event_id, prev_seq FROM "
                           "held_events WHERE "
                           "event_id = ANY($1::uuid[])",
                           ids.str())) {
          held_prev[row["event_id"].as<std::string>()] =
              row["prev_seq"].as<int64_t>();
        }
        if (has_pruned) {
          for (const auto& row : b.exec_params(
                   absl::StrCat(
                       "SELECT aggregate_id, pruned_through, ",
                       by_source ? "aggregate_type" : "'' AS aggregate_type",
                       " FROM aggregate_cursors WHERE aggregate_id = "
                       "ANY($1::text[]) AND pruned_through > 0 AND ",
                       ours),
                   aggs.str())) {
            pruned_through[ChainKey("", row["aggregate_type"].as<std::string>(),
                                    row["aggregate_id"].as<std::string>())] =
                row["pruned_through"].as<int64_t>();
          }
        }
      }
    }

    // From the consumer back: events applied in the window (committed at
    // most as long ago) that the outbox does not hold.
    std::vector<Finding> orphans;
    {
      std::set<std::string> in_window;
      for (const Committed& c : events) in_window.insert(c.f.event_id);
      std::vector<Finding> unknown;
      {
        pqxx::read_transaction b(**inbox_conn);
        ApplyLimits(b);
        for (const auto& row : b.exec_params(
                 absl::StrCat(
                     "SELECT event_id::text AS event_id, aggregate_id, seq, "
                     "event_type, extract(epoch FROM now() - applied_at)"
                     "::float8 AS age FROM "
                     "inbox WHERE applied_at >= now() - make_interval(secs => "
                     "$1::float8) AND applied_at < now() - make_interval(secs "
                     "=> $2::float8) AND ",
                     ours, " ORDER BY applied_at"),
                 absl::ToDoubleSeconds(options.window),
                 absl::ToDoubleSeconds(options.grace))) {
          Finding f;
          f.event_id = row["event_id"].as<std::string>();
          f.seq = row["seq"].as<int64_t>();
          if (in_window.count(f.event_id)) continue;
          if (f.seq < min_retained) continue;  // retention
          f.aggregate_id = row["aggregate_id"].as<std::string>();
          f.event_type = row["event_type"].as<std::string>();
          f.age = absl::Seconds(row["age"].as<double>());
          unknown.push_back(std::move(f));
        }
      }
      pqxx::read_transaction o(**outbox_conn);
      ApplyLimits(o);
      std::set<std::string> held_there;
      for (size_t i = 0; i < unknown.size(); i += kChunk) {
        ArrayLiteral ids;
        for (size_t j = i; j < std::min(unknown.size(), i + kChunk); ++j) {
          ids.Add(unknown[j].event_id);
        }
        for (const auto& row :
             o.exec_params("SELECT event_id::text FROM outbox WHERE event_id "
                           "= ANY($1::uuid[])",
                           ids.str())) {
          held_there.insert(row[0].as<std::string>());
        }
      }
      // Retention may have deleted some of them since min_retained was
      // read: it records how far in the statement that deletes, so a
      // statement after the lookups (READ COMMITTED: a newer snapshot)
      // knows every deletion they missed.
      const int64_t retained_now =
          o.exec(absl::StrCat("SELECT ", kMinRetainedSql))[0][0].as<int64_t>();
      for (Finding& f : unknown) {
        if (held_there.count(f.event_id) || f.seq < retained_now) continue;
        f.reason = "applied, not in the outbox";
        f.detail =
            "the consumer applied it (its effects stand), but the outbox "
            "does not hold it: committed and then lost by a failover of "
            "the outbox database, or never committed";
        orphans.push_back(std::move(f));
      }
    }
    r.orphaned = static_cast<int64_t>(orphans.size());
    r.open_divergences = static_cast<int64_t>(divergences.size());

    for (Committed& c : events) {
      ++r.events;
      if (applied.count(c.f.event_id)) {
        ++r.applied;
        continue;
      }
      const std::string chain =
          ChainKey("", c.aggregate_type, c.f.aggregate_id);
      auto p = pruned_through.find(chain);
      if (p == pruned_through.end()) {
        p = pruned_through.find(ChainKey("", "", c.f.aggregate_id));
      }
      if (p != pruned_through.end() && c.f.seq <= p->second) {
        ++r.applied;
        ++r.pruned;
        continue;
      }
      auto dead = first_dead.find(chain);
      if (c.status == kDeliveryDiverged) {
        ++r.diverged;
        c.f.reason = "diverged";
        c.f.detail = absl::StrCat(
            "the consumer holds another history of "
            "its aggregate: ",
            c.last_error);
      } else if (c.status == kDeliveryDead) {
        ++r.dead;
        c.f.reason = "dead letter";
        c.f.detail =
            absl::StrCat(c.attempts, " attempts; last error: ", c.last_error);
      } else if (held_prev.count(c.f.event_id)) {
        ++r.held;
        c.f.reason = "held at the consumer";
        c.f.detail = absl::StrCat("waits for its predecessor, seq ",
                                  held_prev[c.f.event_id]);
      } else if (c.status == kDeliveryPending && dead != first_dead.end() &&
                 dead->second < c.f.seq) {
        ++r.behind_dead;
        c.f.reason = "behind a dead letter";
        c.f.detail = absl::StrCat("dead letter seq ", dead->second,
                                  " of its aggregate comes first");
      } else if (c.status == kDeliveryPending) {
        ++r.pending;
        c.f.reason = "pending";
        c.f.detail = absl::StrCat(
            c.attempts, " attempts",
            c.next_try_s > 0
                ? absl::StrFormat(", next try in %.0fs", c.next_try_s)
                : std::string(", due now"),
            c.last_error.empty() ? "" : "; last error: ", c.last_error);
      } else {
        ++r.lost;
        c.f.reason = "lost";
        c.f.detail = absl::StrCat(
            "marked ", c.status,
            " for the subscription, but the consumer has no trace of it");
      }
      if (r.findings.size() < options.max_listed) {
        r.findings.push_back(std::move(c.f));
      }
    }
    for (std::vector<Finding>* more : {&divergences, &orphans}) {
      for (Finding& f : *more) {
        if (r.findings.size() >= options.max_listed) break;
        r.findings.push_back(std::move(f));
      }
    }
    return r;
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

}  // namespace outbox::tools
