#pragma once
// What a consumer's database holds now, as gauges: held events and the age
// of the oldest, and the aggregates it tracks. Read every `interval` on a
// thread of its own with cheap queries (an index's minimum, the statistics'
// live row count), never on a scrape.

#include <atomic>

#include "absl/time/time.h"
#include "common/db.h"
#include "common/metrics.h"
#include "common/periodic.h"

namespace outbox::inbox {

class InboxGauges {
 public:
  InboxGauges(Database* db, Metrics* metrics,
              absl::Duration interval = absl::Seconds(15));
  // Destruction stops it, waiting for a refresh in progress.
  InboxGauges(const InboxGauges&) = delete;
  InboxGauges& operator=(const InboxGauges&) = delete;

 private:
  bool Refresh();

  Database* const db_;
  std::atomic<double> held_{0}, oldest_held_seconds_{0}, aggregates_{0};
  PeriodicTask task_;  // last: starts after the members it uses
};

}  // namespace outbox::inbox
