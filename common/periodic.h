#pragma once
// A background task on a thread of its own: runs `fn` at once, then again
// `interval` after each run, or after `busy_pause` while `fn` says there is
// more to do; the destructor stops it (waiting for a run in progress) and
// joins.

#include <functional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace outbox {

class PeriodicTask {
 public:
  // `fn` returns true to run again after `busy_pause` (e.g. a batch came
  // back full): a pause leaves the database to the work that matters.
  PeriodicTask(absl::Duration interval, std::function<bool()> fn,
               absl::Duration busy_pause = absl::ZeroDuration());
  ~PeriodicTask();
  PeriodicTask(const PeriodicTask&) = delete;
  PeriodicTask& operator=(const PeriodicTask&) = delete;

 private:
  const absl::Duration interval_, busy_pause_;
  const std::function<bool()> fn_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace outbox
