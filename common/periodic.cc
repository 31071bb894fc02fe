#include "common/periodic.h"

namespace outbox {

PeriodicTask::PeriodicTask(absl::Duration interval, std::function<bool()> fn)
    : interval_(interval), fn_(std::move(fn)) {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      const bool again = fn_();
      lock.lock();
      if (again) continue;
      cv_.wait_for(lock, absl::ToChronoMilliseconds(interval_),
                   [this] { return stop_; });
    }
  });
}

PeriodicTask::~PeriodicTask() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

}  // namespace outbox
