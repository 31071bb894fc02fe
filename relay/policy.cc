#include "relay/policy.h"

#include <algorithm>

#include "absl/random/random.h"

namespace outbox::relay {

absl::Duration RetryDelay(absl::Duration initial, absl::Duration max,
                          int failures, double jitter) {
  max = std::max(initial, max);
  absl::Duration base = initial;
  for (int i = 1; i < failures && base < max; ++i) base *= 2;
  return std::min(base, max) * jitter;
}

std::vector<absl::Duration> RetryDelays(absl::Duration initial,
                                        absl::Duration max, int count,
                                        const std::function<double()>& jitter) {
  std::vector<absl::Duration> out;
  out.reserve(std::max(0, count));
  for (int n = 1; n <= count; ++n) {
    out.push_back(RetryDelay(initial, max, n, jitter()));
  }
  return out;
}

double RandomJitter() {
  thread_local absl::BitGen gen;
  return absl::Uniform(gen, 0.5, 1.0);
}

Backoff::Backoff(absl::Duration initial, absl::Duration max,
                 std::function<double()> jitter)
    : initial_(initial), max_(max), jitter_(std::move(jitter)) {
  if (!jitter_) jitter_ = RandomJitter;
}

absl::Duration Backoff::Next() {
  if (failures_ < kMaxCountedFailures) ++failures_;
  return RetryDelay(initial_, max_, failures_, jitter_());
}

size_t PartitionTarget(int partitions, int members) {
  members = std::max(1, members);
  return static_cast<size_t>((std::max(0, partitions) + members - 1) / members);
}

std::set<int> PartitionsToRelease(const std::set<int>& owned, size_t target) {
  std::set<int> out;
  size_t extra = owned.size() > target ? owned.size() - target : 0;
  for (auto it = owned.rbegin(); it != owned.rend() && extra > 0;
       ++it, --extra) {
    out.insert(*it);
  }
  return out;
}

std::vector<int> AcquireOrder(int partitions, int member_key) {
  std::vector<int> out;
  if (partitions <= 0) return out;
  const int start = ((member_key % partitions) + partitions) % partitions;
  for (int i = 0; i < partitions; ++i) out.push_back((start + i) % partitions);
  return out;
}

std::vector<int> LanePartitions(const std::set<int>& owned,
                                const std::set<int>& releasing, int lane,
                                int lanes) {
  std::vector<int> out;
  lanes = std::max(1, lanes);
  for (int p : owned) {
    if (!releasing.count(p) && p % lanes == lane) out.push_back(p);
  }
  return out;
}

int ClaimLimit(int batch_size, int window, int pipeline_depth,
               int in_flight_events, int in_flight_batches,
               bool in_flight_full) {
  if (in_flight_events >= window ||
      in_flight_batches >= (in_flight_full ? pipeline_depth : 1)) {
    return 0;
  }
  return std::max(0, std::min(batch_size, window - in_flight_events));
}

bool ClaimAboveSent(const ClaimStart& c) {
  return c.outstanding >= c.batch_size && c.sent_through > 0 &&
         !c.full_claim_due && !(c.passed_over && c.freed_since);
}

}  // namespace outbox::relay
