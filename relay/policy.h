#pragma once
// The relay's decisions, apart from its I/O (the SQL and the streams are
// elsewhere): how long to back off, how many partitions a replica should
// own and which to give up, which partitions a delivery stream claims
// for, and how many events a claim may ask for. Pure, so they are
// unit-tested without PostgreSQL (policy_test.cc).

#include <cstdint>
#include <functional>
#include <set>
#include <vector>

#include "absl/time/time.h"

namespace outbox::relay {

// The one backoff of the relay, for a stream or the database that failed
// and for an event its consumer rejected: after the n-th failure in a row
// (n >= 1), wait initial * 2^(n-1), at most `max` (never below `initial`),
// times `jitter`, a fraction in [0.5, 1) that spreads replicas apart.
absl::Duration RetryDelay(absl::Duration initial, absl::Duration max,
                          int failures, double jitter);

// Failures in a row that RetryDelay is asked about at most: the wait has
// reached its cap long before (2^63 times any initial wait).
inline constexpr int kMaxCountedFailures = 64;

// The waits after the 1st, 2nd, ... `count`-th failure, each with its own
// jitter: for a statement that backs off rows by their attempts counted in
// the database (the n-th element is the wait after the n-th failure).
std::vector<absl::Duration> RetryDelays(absl::Duration initial,
                                        absl::Duration max, int count,
                                        const std::function<double()>& jitter);

// A random jitter in [0.5, 1).
double RandomJitter();

// RetryDelay over a run of failures: Next() after each, Reset() after a
// success.
class Backoff {
 public:
  // `jitter` gives [0.5, 1) fractions: tests pass a fixed one.
  Backoff(absl::Duration initial, absl::Duration max,
          std::function<double()> jitter = {});

  // The wait before the next try.
  absl::Duration Next();
  void Reset() { failures_ = 0; }

 private:
  absl::Duration initial_, max_;
  int failures_ = 0;
  std::function<double()> jitter_;
};

// Partitions each of `members` replicas should own so that all
// `partitions` are owned: the ceiling of the share.
size_t PartitionTarget(int partitions, int members);

// Which owned partitions to give up to come down to `target`: the
// highest, so that replicas agree without talking. Empty when at or below.
std::set<int> PartitionsToRelease(const std::set<int>& owned, size_t target);

// The order in which a replica tries free partitions: starting at its own
// key, so that replicas starting together go for different ones.
std::vector<int> AcquireOrder(int partitions, int member_key);

// The partitions the `lane`-th of `lanes` streams claims for: owned, not
// being given up, and p % lanes == lane, so that the streams share them
// without overlap.
std::vector<int> LanePartitions(const std::set<int>& owned,
                                const std::set<int>& releasing, int lane,
                                int lanes);

// Events the next claim of a stream may ask for, with `in_flight_events`
// unanswered in `in_flight_batches` batches; 0: it must wait for answers.
// Up to `pipeline_depth` batches are in flight only behind full ones
// (`in_flight_full`: each was; a backlog), else one: the consumer applies
// a stream's batches in turn, so a small batch sent now would wait behind
// the one before, while the rows that arrive in the meantime go together,
// in one transaction, once that one is answered.
int ClaimLimit(int batch_size, int window, int pipeline_depth,
               int in_flight_events, int in_flight_batches,
               bool in_flight_full);

// Where a stream's claim starts: above the highest seq it sent (only rows
// newer than what is out) or from the start of its partitions (every ready
// row, and those that committed after a higher seq was sent, which a claim
// above misses).
struct ClaimStart {
  // Events in flight and answered but not marked, against the batch size:
  // with fewer, a claim from the start reads past them at little cost.
  int64_t outstanding = 0;
  int batch_size = 0;
  int64_t sent_through = 0;    // 0: nothing sent on this stream yet
  bool full_claim_due = true;  // a claim from the start is due (per poll)
  // The last claim above passed over busy aggregates' rows, and since
  // then an aggregate was freed (or the marks riding with this claim free
  // one): that row must not wait a poll for its predecessor's mark.
  bool passed_over = false;
  bool freed_since = false;
};
// True: above sent_through only.
bool ClaimAboveSent(const ClaimStart& c);

}  // namespace outbox::relay
