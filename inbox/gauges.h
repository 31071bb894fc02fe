#pragma once
// What a consumer's database holds now, as gauges: held events and the age
// of the oldest, and the aggregates it tracks. Read every `interval` on a
// thread of its own with cheap queries (an index's minimum, the statistics'
// live row count), never on a scrape.

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/time/time.h"
#include "common/db.h"
#include "common/metrics.h"

namespace outbox::inbox {

class InboxGauges {
 public:
  InboxGauges(Database* db, Metrics* metrics,
              absl::Duration interval = absl::Seconds(15));
  ~InboxGauges();  // stops and joins
  InboxGauges(const InboxGauges&) = delete;
  InboxGauges& operator=(const InboxGauges&) = delete;

 private:
  void Loop();

  Database* const db_;
  const absl::Duration interval_;
  std::atomic<double> held_{0}, oldest_held_seconds_{0}, aggregates_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace outbox::inbox
