#include "relay/ownership.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "absl/random/random.h"
#include "common/db.h"
#include "relay/policy.h"

namespace outbox::relay {
namespace {

int NewMemberKey() {
  thread_local absl::BitGen gen;
  return absl::Uniform<int>(gen, 1, 1 << 30);
}

}  // namespace

PartitionOwnership::PartitionOwnership(std::string subscription,
                                       std::string member, absl::Duration ttl,
                                       int partitions)
    : leases_(std::move(subscription), std::move(member), ttl),
      partitions_(partitions),
      preference_(AcquireOrder(partitions, NewMemberKey())) {}

OwnershipRound PartitionOwnership::Balance(
    pqxx::transaction_base& tx, const std::function<bool(int)>& busy) {
  const LeaseRound leases = leases_.Heartbeat(tx, owned_, partitions_);
  OwnershipRound round{.members = leases.members, .lost = leases.lost};
  std::set<int> owned = leases.owned;
  std::set<int> releasing;
  const size_t target = PartitionTarget(partitions_, leases.members);
  // Give up the highest partitions beyond the share, each once nothing of
  // it is in flight; one given up earlier stays given up.
  const std::set<int> surplus = PartitionsToRelease(owned, target);
  if (!surplus.empty()) {
    for (int p : releasing_) {
      if (owned.count(p)) releasing.insert(p);
    }
    releasing.insert(surplus.begin(), surplus.end());
  }
  for (int p : releasing) {
    if (!busy(p)) round.released.insert(p);
  }
  leases_.Release(tx, round.released);
  for (int p : round.released) {
    owned.erase(p);
    releasing.erase(p);
  }
  if (owned.size() < target) {
    round.acquired = leases_.Acquire(tx, preference_, target - owned.size());
    owned.insert(round.acquired.begin(), round.acquired.end());
  }
  owned_ = std::move(owned);
  releasing_ = std::move(releasing);
  return round;
}

std::vector<int> PartitionOwnership::Round(
    pqxx::transaction_base& tx, bool unlinked,
    const std::function<bool(int)>& busy) {
  const std::set<int> before = owned_;
  if (unlinked) {
    // Nothing is in flight (the streams were dropped) and the marks were
    // written before this round.
    ReleaseAll(tx);
    if (!before.empty()) {
      spdlog::warn(
          "relay {}: gave up its {} partitions: its consumer does not answer",
          member(), before.size());
    }
    return {before.begin(), before.end()};
  }
  const OwnershipRound round = Balance(tx, busy);
  for (int p : round.lost) {
    spdlog::warn(
        "relay {}: the lease of partition {} was taken over (this relay "
        "did not renew it within --lease_ttl); it stops claiming it",
        member(), p);
  }
  if (owned_.size() != before.size()) {
    spdlog::info("relay {}: owns {} of {} partitions ({} replicas)", member(),
                 owned_.size(), partitions_, round.members);
  }
  // Those released had their positions stored before this round (the
  // worker flushes them first); those lost are another replica's now.
  std::set<int> gone = round.lost;
  gone.insert(round.released.begin(), round.released.end());
  return {gone.begin(), gone.end()};
}

void PartitionOwnership::ReleaseAll(pqxx::transaction_base& tx) {
  leases_.ReleaseAll(tx);
  Forget();
}

absl::Status PartitionOwnership::ReleaseAll(pqxx::connection_base& conn) {
  return InUnit(conn, [this](pqxx::transaction_base& tx) { ReleaseAll(tx); });
}

void PartitionOwnership::Forget() {
  owned_.clear();
  releasing_.clear();
}

std::vector<int> PartitionOwnership::ForSlot(int slot, int slots) const {
  return LanePartitions(owned_, releasing_, slot, slots);
}

}  // namespace outbox::relay
