#include "common/periodic.h"

#include "absl/synchronization/mutex.h"

namespace outbox {

PeriodicTask::PeriodicTask(absl::Duration interval, std::function<bool()> fn,
                           absl::Duration busy_pause)
    : interval_(interval), busy_pause_(busy_pause), fn_(std::move(fn)) {
  thread_ = std::thread([this] {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
      }
      const bool again = fn_();
      if (again && busy_pause_ <= absl::ZeroDuration()) continue;
      absl::MutexLock lock(&mu_);
      const absl::Time until = absl::Now() + (again ? busy_pause_ : interval_);
      while (!stop_ && !cv_.WaitWithDeadline(&mu_, until)) {
      }
    }
  });
}

PeriodicTask::~PeriodicTask() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

}  // namespace outbox
