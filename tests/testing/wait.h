#pragma once
// Waiting in tests for an outcome, never for a fixed time.

#include <functional>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace outbox::testing {

// Polls `done` every 20 ms until it holds or `limit` passed; the last
// answer of `done`. The limit is generous: on a slow machine it is only
// how long a failing test takes to say so.
inline bool WaitFor(const std::function<bool()>& done,
                    absl::Duration limit = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return done();
}

}  // namespace outbox::testing
