#pragma once
// One lane's claims of delivery rows in a round of the relay's worker: all
// of a subscription delivered by rows, and the exceptions of one on the
// outbox log. The first claim statement also deletes the deliveries
// answered since the last (Settlement::RideWithClaim); each leaves out the
// chains with an event outstanding; ClaimWalk says where each starts and
// when the lane's round is over. What a claim found goes to the caller,
// who sends it as a batch before the next claim asks how many more events
// the lane takes.
//
// Example (relay/dispatcher.cc):
//   RowsClaim rows({.subscription = "billing", .member = ownership.member(),
//                   .batch_size = 512, .poll_interval = absl::Seconds(1),
//                   .settled = [&](const Settled& s) { ...count s... }},
//                  &settlement);
//   bool ran = false;
//   absl::Status s = rows.Round(conn, {
//       .partitions = {0, 1}, .cursor = &lane.cursor, .in_flight = n,
//       .limit = [&] { return lane.Limit(512, 4096, 2); },
//       .send = [&](Claimed c, int limit) { ...build, send...; return cut; }},
//       &ran);
//
// Not thread-safe: the worker alone calls it.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "relay/claim.h"
#include "relay/claim_walk.h"
#include "relay/settlement.h"

namespace outbox::relay {

struct RowsClaimOptions {
  std::string subscription;
  // PartitionOwnership::member(): each claim checks that it still holds
  // the leases of the partitions it reads.
  std::string member;
  int batch_size = 512;  // ClaimWalk's
  // A claim from the start at least this often (ClaimWalk).
  absl::Duration poll_interval = absl::Milliseconds(500);
  // Each claim also reads the WAL position past its rows' commits
  // (Claimed::lsn), which the replication fence holds their batch to.
  bool fenced = false;
  // Each claim statement: the rows it found and how long it took.
  std::function<void(size_t rows, absl::Duration took)> claimed;
  // The deliveries a claim deleted (Settlement::Written), to be counted.
  std::function<void(const Settled&)> settled;
};

class RowsClaim {
 public:
  // `settlement` is the worker's, and must outlive this.
  RowsClaim(RowsClaimOptions options, Settlement* settlement);

  // One lane's part of a round.
  struct Lane {
    std::vector<int> partitions;  // its share of the leased partitions
    ClaimCursor* cursor = nullptr;
    int64_t in_flight = 0;  // events out on every lane
    // Events the lane takes now; 0 ends its round.
    std::function<int()> limit;
    // Sends what a claim asked for `limit` rows found (in seq order, as
    // candidates of BuildBatch). Returns whether its batch stopped at the
    // byte limit (BuiltBatch::cut_by_bytes): the rest is claimed again.
    std::function<bool(Claimed claimed, int limit)> send;
  };

  // Claims for `lane` until it takes no more or its walk is over; `*ran`
  // becomes true once a claim ran (the lane's window was open). libpqxx's
  // failures are returned as a status (StatusFromException); what a claim
  // before it sent stays sent, the deliveries it deleted settled.
  absl::Status Round(pqxx::connection_base& conn, const Lane& lane, bool* ran);

 private:
  const RowsClaimOptions options_;
  Settlement* const settlement_;
};

}  // namespace outbox::relay
