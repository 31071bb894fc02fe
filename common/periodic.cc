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
      mu_.AwaitWithTimeout(absl::Condition(&stop_),
                           again ? busy_pause_ : interval_);
    }
  });
}

PeriodicTask::~PeriodicTask() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;  // wakes the wait: Await watches the flag
  }
  thread_.join();
}

}  // namespace outbox
