#pragma once
// A watchdog on a work loop, so that health tells the truth: a process whose
// loop is stuck (a lock it waits for, a database that fails every write)
// reports NOT_SERVING and a liveness probe restarts it, while an idle
// process stays SERVING. The loop says when it has work (Working), when the
// work moved (Progress) and when it has none left (Done); the server asks
// Stalled() twice a second (ServeUntilSignal in common/service.h).
//
// Example (the consumer's apply path):
//   watchdog.Working();
//   absl::Status s = ApplyBatch(...);
//   if (s.ok()) watchdog.Done(); else watchdog.Failed(s);
//
// Thread-safe.

#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace outbox {

class Watchdog {
 public:
  // `what` names the loop in messages ("relay claim/mark loop").
  Watchdog(std::string what, absl::Duration stall_timeout);

  // There is work; starts the stall clock unless it is running already.
  void Working(absl::Time now = absl::Now());
  // The work moved; the stall clock restarts, the loop still has work.
  void Progress(absl::Time now = absl::Now());
  // The work is done (or there was none); no stall until Working again.
  void Done(absl::Time now = absl::Now());
  // A step failed: the loop still has work, and `why` goes into the reason.
  void Failed(const absl::Status& why, absl::Time now = absl::Now());

  // Why the loop counts as stalled: it has had work for longer than the
  // stall timeout without progress. Nothing when it is healthy.
  std::optional<std::string> Stalled(absl::Time now = absl::Now()) const;

  const std::string& what() const { return what_; }

 private:
  const std::string what_;
  const absl::Duration stall_timeout_;
  mutable absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time since_ ABSL_GUARDED_BY(mu_);  // busy without progress since
  std::string last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace outbox
