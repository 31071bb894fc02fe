#include "relay/relay_metrics.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace outbox::relay {
namespace {

constexpr char kRedeliveredHelp[] =
    "Events owed again because the consumer lacked them after it had "
    "answered them: a HELD answer showed a missing predecessor, or a heal "
    "found its cursor behind (its database lost commits).";

}  // namespace

RelayCounters::RelayCounters(Metrics* metrics)
    : delivered(metrics->AddCounter("outbox_relay_delivered_total",
                                    "Rows marked delivered by this process.")),
      rejected(metrics->AddCounter(
          "outbox_relay_rejected_total",
          "REJECTED answers (each counts an attempt of its row).")),
      dead(metrics->AddCounter("outbox_relay_dead_letters_total",
                               "Rows that became dead letters.")),
      stream_failures(
          metrics->AddCounter("outbox_relay_stream_failures_total",
                              "Delivery streams that broke or timed out.")),
      batches(metrics->AddCounter("outbox_relay_batches_total",
                                  "Delivery batches sent.")),
      redelivered_held(metrics->AddCounter(
          "outbox_relay_redelivered_total{reason=\"held\"}", kRedeliveredHelp)),
      redelivered_heal(metrics->AddCounter(
          "outbox_relay_redelivered_total{reason=\"heal\"}", kRedeliveredHelp)),
      diverged(metrics->AddCounter(
          "outbox_relay_diverged_total",
          "Aggregates recorded as diverged by this process (DIVERGED "
          "answers and heals): producer and consumer hold different "
          "histories; an operator decides (RelayAdmin.ResolveDivergence).")),
      claim_seconds(metrics->AddHistogram(
          "outbox_relay_claim_seconds",
          "Time of one claim query (pending rows of a stream's partitions; "
          "it also deletes the rows answered delivered since the claim "
          "before).",
          Histogram::LatencyBuckets())),
      answer_seconds(metrics->AddHistogram(
          "outbox_relay_answer_seconds",
          "From sending a batch to the consumer's answer.",
          Histogram::LatencyBuckets())),
      mark_seconds(metrics->AddHistogram(
          "outbox_relay_mark_seconds",
          "Time of one mark statement or transaction of its own (rejected "
          "rows rescheduled; delivered rows deleted when no claim follows, "
          "before a rebalance or when stopping).",
          Histogram::LatencyBuckets())),
      batch_events(metrics->AddHistogram("outbox_relay_batch_events",
                                         "Events per delivery batch sent.",
                                         Histogram::SizeBuckets())) {
  const char* kinds[4] = {"failover", "new_server", "recreated", "went_back"};
  for (int i = 0; i < 4; ++i) {
    consumer_changes_[i] = metrics->AddCounter(
        absl::StrCat("outbox_relay_consumer_database_changes_total{kind=\"",
                     kinds[i], "\"}"),
        "Times the subscription's consumer database was seen to change "
        "identity (a failover, another server, a restore), or to go back in "
        "time under the same identity (a restore in place); each requests a "
        "heal.");
  }
}

void RelayCounters::ConsumerChanged(const IdentityChange& c) const {
  consumer_changes_[c.kind == IdentityChange::kFailover    ? 0
                    : c.kind == IdentityChange::kNewServer ? 1
                                                           : 2]
      ->Add();
}

void RelayCounters::ConsumerWentBack() const { consumer_changes_[3]->Add(); }

void AddStateGauges(Metrics* metrics, std::function<RelayState()> state) {
  metrics->AddGauge("outbox_relay_in_flight", "Events sent, not yet answered.",
                    [state] { return static_cast<double>(state().in_flight); });
  metrics->AddGauge(
      "outbox_relay_partitions_owned", "Partitions this replica streams.",
      [state] { return static_cast<double>(state().partitions_owned.size()); });
  metrics->AddGauge(
      "outbox_relay_consumer_reachable",
      "0 while the consumer has not answered for --consumer_unready_after "
      "(readiness NOT_SERVING, partitions given up), else 1.",
      [state] { return state().consumer_unreachable.empty() ? 1.0 : 0.0; });
  metrics->AddGauge("outbox_relay_stream_connected",
                    "1 while every delivery stream (--streams) is open.",
                    [state] { return state().stream_connected ? 1.0 : 0.0; });
  metrics->AddGauge(
      "outbox_relay_paused",
      "1 while this replica holds claimed events back (a replication fence "
      "waiting for standbys); the reason is in its log and GetStats.",
      [state] { return state().paused_reason.empty() ? 0.0 : 1.0; });
}

}  // namespace outbox::relay
