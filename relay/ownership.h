#pragma once
// Which partitions of its subscription a relay replica delivers, and how
// that share moves as replicas come and go. Each round, in a transaction
// on the relay's connection, it renews this replica's membership and
// leases (relay/leases.h), forgets the partitions another replica took
// over, gives up those beyond its share once nothing of them is in flight
// (never a partition with a batch awaiting its answer, which would let
// another replica claim behind it), and takes free ones up to its share.
// A partition being given up is claimed no more (ForSlot leaves it out).
//
// Not thread-safe: the relay's worker owns it.
//
// Example (each rebalance round):
//   PartitionOwnership ownership("billing", replica_id, absl::Seconds(5));
//   auto tx = OpenUnit(conn);
//   std::vector<int> gone = ownership.Round(*tx, consumer unreachable,
//       [&](int p) { return something of partition p is in flight; });
//   tx->commit();
//   forget the log positions of `gone`;
//   claim ownership.ForSlot(lane, lanes) on each lane.

#include <functional>
#include <pqxx/pqxx>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/ids.h"
#include "relay/leases.h"

namespace outbox::relay {

struct OwnershipRound {
  int members = 1;         // live replicas, this one too
  std::set<int> lost;      // taken over by another replica
  std::set<int> released;  // given up by this one, to share the work
  std::set<int> acquired;  // taken up
};

class PartitionOwnership {
 public:
  // `member` names this replica (unique among the live ones); `ttl` is how
  // long a lease lasts unrenewed; `partitions` how many there are.
  PartitionOwnership(std::string subscription, std::string member,
                     absl::Duration ttl, int partitions = kPartitionCount);

  // One round in `tx` (the caller commits; if it does not, Forget).
  // `busy(p)` says whether anything of partition p is in flight. Throws as
  // libpqxx does; what it holds is then as before the round.
  OwnershipRound Balance(pqxx::transaction_base& tx,
                         const std::function<bool(int)>& busy);

  // One rebalance round of a relay's worker, in `tx`: Balance, or, while
  // `unlinked` (its consumer does not answer: the replicas that reach it
  // share every partition), ReleaseAll. Logs what changed: partitions
  // another replica took over, all given up, the share it owns now.
  // Returns the partitions no longer its own (taken over or given up),
  // whose log positions are then another replica's. Throws as Balance.
  std::vector<int> Round(pqxx::transaction_base& tx, bool unlinked,
                         const std::function<bool(int)>& busy);
  // Gives up every partition and the membership in `tx`: the others take
  // them over at once instead of when the leases expire (a clean stop, or
  // a consumer this replica cannot reach).
  void ReleaseAll(pqxx::transaction_base& tx);
  // ReleaseAll in a unit of its own on `conn`, committed; a failure is
  // returned (the leases then expire by themselves).
  absl::Status ReleaseAll(pqxx::connection_base& conn);

  // Forgets what it holds without a word to the database (the session was
  // lost): the leases stay its own until they expire, and the next round
  // renews those still its own.
  void Forget();

  // The partitions it holds a lease on, ascending.
  const std::set<int>& owned() const { return owned_; }
  // Of those, the ones lane `slot` of `slots` claims: none being given up.
  std::vector<int> ForSlot(int slot, int slots) const;
  // How the claim names this replica in its lease fence.
  const std::string& member() const { return leases_.member(); }

 private:
  PartitionLeases leases_;
  const int partitions_;
  const std::vector<int> preference_;  // where its choice starts: random
  std::set<int> owned_;
  std::set<int> releasing_;  // beyond its share: no new claims
};

}  // namespace outbox::relay
