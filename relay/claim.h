#pragma once
// The claim of a delivery stream: the pending deliveries of partitions this
// replica leases, read in seq order into the candidates of a batch
// (relay/batch_builder.h), optionally deleting in the same statement the
// deliveries answered since the claim before. One statement, one round
// trip; it checks the lease itself, so a replica that lost a partition
// while frozen claims nothing of it.
//
// Example:
//   auto tx = OpenUnit(conn);
//   Claimed c = ClaimPending(*tx, {.subscription = "billing",
//                                  .partitions = {0, 1}, .limit = 256,
//                                  .member = ownership.member()});
//   tx->commit();
//   BuiltBatch built = BuildBatch(std::move(c.candidates), rules);

#include <cstdint>
#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "relay/batch_builder.h"

namespace outbox::relay {

// The claim's statement (claim.cc has its parameters, columns and the
// query plans they keep); `mark` also deletes the rows answered since the
// claim before, `lsn` adds the primary's WAL position (relay/fence.h).
std::string ClaimSql(bool mark, bool lsn);
inline const std::string kClaimSql = ClaimSql(false, false);
inline const std::string kMarkAndClaimSql = ClaimSql(true, false);

struct ClaimQuery {
  std::string subscription;
  std::vector<int> partitions;
  // Aggregate ids left out (their chains have events in flight or answered
  // and not yet marked).
  std::vector<std::string> excluded_ids;
  int limit = 0;      // rows at most (and at most kMaxDeliveryBatchBytes)
  int64_t after = 0;  // only seqs above it
  // Deliveries answered and not yet deleted, with the event each must
  // hold: taken as gone; with `mark` they are deleted by this statement.
  std::vector<int64_t> delivered;
  std::vector<std::string> delivered_ids;
  bool mark = false;
  std::string member;  // this replica, whose leases the claim checks
  bool lsn = false;    // read the primary's WAL insert position too
};

struct Claimed {
  // In seq order; `goes` says whether its predecessor is no longer owed.
  std::vector<Candidate> candidates;
  int64_t last_seq = 0;  // the highest seq read (0: none)
  std::string lsn;       // with ClaimQuery::lsn and rows: past their commits
};

// Runs the claim in `tx`, prepared on its connection unless it is pooled.
// Throws as libpqxx does.
Claimed ClaimPending(pqxx::transaction_base& tx, const ClaimQuery& query);

}  // namespace outbox::relay
