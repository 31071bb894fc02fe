#include "inbox/gauges.h"

#include <spdlog/spdlog.h>

#include <pqxx/pqxx>

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
