#pragma once
// The relay's own counters and histograms, named and explained in one
// place (the backlog's gauges are housekeeping's: relay/housekeeping.h;
// the README's Metrics section lists them all), and the gauges that show
// its state.

#include <functional>

#include "common/db_identity.h"
#include "common/metrics.h"

namespace outbox::relay {

struct RelayState;

struct RelayCounters {
  explicit RelayCounters(Metrics* metrics);

  Counter* const delivered;
  Counter* const rejected;
  Counter* const dead;
  Counter* const stream_failures;
  Counter* const batches;
  Counter* const redelivered_held;
  Counter* const redelivered_heal;
  Counter* const diverged;
  Histogram* const claim_seconds;
  Histogram* const answer_seconds;
  Histogram* const mark_seconds;
  Histogram* const batch_events;

  // A change of the consumer's database identity (c.changed()), or
  // `went_back`: it went back in time under the same identity.
  void ConsumerChanged(const IdentityChange& c) const;
  void ConsumerWentBack() const;

 private:
  // By kind: failover, new_server, recreated, went_back.
  Counter* consumer_changes_[4];
};

// The gauges of what `state` (thread-safe) reports: in flight, partitions
// owned, the consumer reachable, the streams connected, paused.
void AddStateGauges(Metrics* metrics, std::function<RelayState()> state);

}  // namespace outbox::relay
