#pragma once
// Partition ownership by lease, for the replicas of one subscription: a
// row per partition (outbox_partition_leases) that a replica owns until
// its lease runs out, renewed every round, and a row per live replica
// (outbox_relay_members) whose count sets each one's share. Nothing lives
// in a database session, so it works behind a transaction pooler; a
// replica that dies or freezes loses its partitions when its leases expire
// (the database's clock decides), and the claim statement itself checks
// the lease, so a replica that wakes after losing one claims nothing of
// that partition.
//
// Example (each rebalance round, on the worker's connection):
//   PartitionLeases leases("billing", "host/123/ab12cd34", absl::Seconds(5));
//   auto unit = OpenUnit(conn);
//   LeaseRound round = leases.Heartbeat(*unit, owned);
//   size_t target = PartitionTarget(kPartitionCount, round.members);
//   if (round.owned.size() < target) {
//     leases.Acquire(*unit, AcquireOrder(kPartitionCount, key),
//                    target - round.owned.size());
//   }
//   unit->commit();

#include <pqxx/pqxx>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace outbox::relay {

struct LeaseRound {
  int members = 1;      // live replicas of the subscription, this one too
  std::set<int> owned;  // partitions this replica holds a lease on now
  std::set<int> lost;   // of those it thought it held, the ones taken over
};

class PartitionLeases {
 public:
  // `member` names this replica (unique among live ones); `ttl` is how
  // long a lease lasts without renewal.
  PartitionLeases(std::string subscription, std::string member,
                  absl::Duration ttl);

  // Renews this replica's membership and every lease it holds (a lease
  // whose time ran out stays its own until another replica takes it),
  // counts the live replicas, and makes the lease rows of `partitions`
  // partitions if missing. `owned` is what the caller thinks it holds.
  // Throws as libpqxx does.
  LeaseRound Heartbeat(pqxx::transaction_base& tx, const std::set<int>& owned,
                       int partitions);

  // Gives up the leases of `partitions`.
  void Release(pqxx::transaction_base& tx, const std::set<int>& partitions);

  // Takes up to `count` partitions whose lease is free or expired, in the
  // order of `preference`; returns those taken (each lease's token grows).
  std::set<int> Acquire(pqxx::transaction_base& tx,
                        const std::vector<int>& preference, size_t count);

  // Gives up every lease and the membership (a clean stop), so that the
  // others take over at once instead of after the ttl.
  void ReleaseAll(pqxx::transaction_base& tx);

  const std::string& member() const { return member_; }
  absl::Duration ttl() const { return ttl_; }

  // The condition a claim adds so that it reads only partitions whose
  // lease this replica still holds: $<param> is the member.
  static std::string ClaimFence(int param);

 private:
  const std::string subscription_;
  const std::string member_;
  const absl::Duration ttl_;
};

}  // namespace outbox::relay
