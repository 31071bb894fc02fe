#include "common/watchdog.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace outbox {

Watchdog::Watchdog(std::string what, absl::Duration stall_timeout)
    : what_(std::move(what)), stall_timeout_(stall_timeout) {}

void Watchdog::Working(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (!busy_) {
    busy_ = true;
    since_ = now;
  }
}

void Watchdog::Progress(absl::Time now) {
  absl::MutexLock lock(&mu_);
  busy_ = true;
  since_ = now;
  last_error_.clear();
}

void Watchdog::Done(absl::Time) {
  absl::MutexLock lock(&mu_);
  busy_ = false;
  last_error_.clear();
}

void Watchdog::Failed(const absl::Status& why, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (!busy_) {
    busy_ = true;
    since_ = now;
  }
  last_error_ = std::string(why.message());
}

std::optional<std::string> Watchdog::Stalled(absl::Time now) const {
  if (stall_timeout_ <= absl::ZeroDuration()) return std::nullopt;
  absl::MutexLock lock(&mu_);
  if (!busy_ || now - since_ <= stall_timeout_) return std::nullopt;
  return absl::StrCat(
      what_, " made no progress for ",
      absl::FormatDuration(absl::Trunc(now - since_, absl::Seconds(1))),
      " while it had work",
      last_error_.empty() ? "" : "; last error: ", last_error_);
}

}  // namespace outbox
