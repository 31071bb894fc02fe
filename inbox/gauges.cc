#include "inbox/gauges.h"

#include <spdlog/spdlog.h>

#include <pqxx/pqxx>

#include "absl/synchronization/mutex.h"

namespace outbox::inbox {

InboxGauges::InboxGauges(Database* db, Metrics* metrics,
                         absl::Duration interval)
    : db_(db), task_(interval, [this] { return Refresh(); }) {
  metrics->AddGauge("outbox_consumer_held_events",
                    "Events held for their predecessor now.",
                    [this] { return held_.load(); });
  metrics->AddGauge("outbox_consumer_oldest_held_seconds",
                    "Since the oldest held event arrived (0: none held).",
                    [this] { return oldest_held_seconds_.load(); });
  metrics->AddGauge(
      "outbox_consumer_held_failed_events",
      "Held events whose own effect failed as they drained; each stops its "
      "aggregate until an operator releases or skips it (outboxctl held "
      "--failed).",
      [this] { return held_failed_.load(); });
  metrics->AddGaugeFamily(
      "outbox_consumer_oldest_gap_seconds",
      "Since the oldest gap opened: its aggregate holds events while the "
      "one after seq missing_after_seq has not arrived. One series; 0 with "
      "empty labels when there is no gap.",
      [this] {
        absl::MutexLock lock(&gap_mu_);
        return std::vector<std::pair<Labels, double>>{
            {{{"aggregate_id", gap_aggregate_},
              {"aggregate_type", gap_type_},
              {"source", gap_source_},
              {"missing_after_seq",
               gap_aggregate_.empty() ? "" : std::to_string(gap_after_seq_)}},
             gap_seconds_}};
      });
  metrics->AddGauge(
      "outbox_consumer_aggregates",
      "Aggregates with a cursor (the statistics' live row count).",
      [this] { return aggregates_.load(); });
}

bool InboxGauges::Refresh() {
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::read_transaction tx(c);
    ApplyLimits(tx);
    // Held events are capped per aggregate and drain quickly: counting
    // them is cheap; the age comes from held_events_age_idx. The
    // aggregates come from the statistics, not a count.
    const pqxx::row held = tx.exec1(
        "SELECT count(*), coalesce(extract(epoch FROM now() - "
        "min(received_at)), 0)::float8 FROM held_events");
    const pqxx::row aggs = tx.exec1(
        "SELECT coalesce((SELECT n_live_tup FROM pg_stat_user_tables WHERE "
        "relid = 'aggregate_cursors'::regclass), 0)::float8");
    // A gap: no held event of the aggregate takes the link at its cursor
    // (a failed one there is not a gap; it has its own gauge).
    const pqxx::result gap = tx.exec(
        "SELECT h.aggregate_id, coalesce(c.last_seq, 0), extract(epoch FROM "
        "now() - min(h.received_at))::float8, h.aggregate_type, h.source FROM "
        "held_events h LEFT JOIN aggregate_cursors c USING (source, "
        "aggregate_type, aggregate_id) WHERE NOT EXISTS (SELECT 1 FROM "
        "held_events n WHERE n.source = h.source AND n.aggregate_type = "
        "h.aggregate_type AND n.aggregate_id = h.aggregate_id AND n.prev_seq "
        "= coalesce(c.last_seq, 0)) GROUP BY 1, 2, 4, 5 ORDER BY 3 DESC "
        "LIMIT 1");
    const pqxx::row failed = tx.exec1(
        "SELECT count(*) FROM held_events WHERE attempts > 0");
    {
      absl::MutexLock lock(&gap_mu_);
      gap_aggregate_ = gap.empty() ? "" : gap[0][0].as<std::string>();
      gap_type_ = gap.empty() ? "" : gap[0][3].as<std::string>();
      gap_source_ = gap.empty() ? "" : gap[0][4].as<std::string>();
      gap_after_seq_ = gap.empty() ? 0 : gap[0][1].as<int64_t>();
      gap_seconds_ = gap.empty() ? 0 : std::max(0.0, gap[0][2].as<double>());
    }
    held_failed_ = failed[0].as<double>();
    held_ = held[0].as<double>();
    oldest_held_seconds_ = std::max(0.0, held[1].as<double>());
    aggregates_ = aggs[0].as<double>();
    return absl::OkStatus();
  });
  if (!s.ok()) {
    spdlog::warn("consumer: inbox gauges: {}", std::string(s.message()));
  }
  return false;
}

}  // namespace outbox::inbox
