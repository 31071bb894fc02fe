#pragma once
// What a consumer's database holds now, as gauges: held events and the age
// of the oldest, those whose effect failed as they drained, the oldest gap
// (by its aggregate and the position missing), and the aggregates it
// tracks. Read every `interval` on a
// thread of its own with cheap queries (an index's minimum, the statistics'
// live row count), never on a scrape.

#include <atomic>
#include <string>

#include "absl/synchronization/mutex.h"
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
  std::atomic<double> held_{0}, oldest_held_seconds_{0}, aggregates_{0},
      held_failed_{0};
  absl::Mutex gap_mu_;
  // The oldest gap: an aggregate holding events while the one after its
  // cursor has not arrived. Empty aggregate: none.
  std::string gap_aggregate_ ABSL_GUARDED_BY(gap_mu_);
  std::string gap_type_ ABSL_GUARDED_BY(gap_mu_);
  std::string gap_source_ ABSL_GUARDED_BY(gap_mu_);
  int64_t gap_after_seq_ ABSL_GUARDED_BY(gap_mu_) = 0;
  double gap_seconds_ ABSL_GUARDED_BY(gap_mu_) = 0;
  PeriodicTask task_;  // last: starts after the members it uses
};

}  // namespace outbox::inbox
