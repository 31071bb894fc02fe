#include "common/periodic.h"

namespace outbox {

PeriodicTask::PeriodicTask(absl::Duration interval, std::function<bool()> fn,
                           absl::Duration busy_pause)
    : interval_(interval), busy_pause_(busy_pause), fn_(std::move(fn)) {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      const bool again = fn_();
      lock.lock();
      if (again && busy_pause_ <= absl::ZeroDuration()) continue;
      cv_.wait_for(lock,
                   absl::ToChronoMilliseconds(again ? busy_pause_ : interval_),
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
