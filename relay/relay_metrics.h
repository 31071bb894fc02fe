#pragma once
// The relay's own counters and histograms, named and explained in one
// place (the backlog's gauges are housekeeping's: relay/housekeeping.h;
// the README's Metrics section lists them all), and its state, which
// gauges and the admin API show.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/db_identity.h"
#include "common/metrics.h"

namespace outbox::relay {

// A consistent copy of the relay's own state, for stats.
struct RelayState {
  std::vector<int> partitions_owned;
  int64_t in_flight = 0;
  bool stream_connected = false;
  std::string replica_id;
  int64_t delivered = 0;          // rows this process marked delivered
  int64_t rejected = 0;           // REJECTED answers this process recorded
  std::string paused_reason;      // why it does not deliver now, or ""
  std::string consumer_database;  // its identity as last seen
  std::string source;             // what its events carry (Event.source)
  // Why the consumer counts as unreachable (consumer_unready_after), or "".
  std::string consumer_unreachable;
};

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
