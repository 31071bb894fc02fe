#pragma once
// Replication-fenced delivery: a relay sends an event only once enough
// standbys of the outbox database have flushed its commit, as Kafka's
// consumers read only up to the high watermark. Then a failover to any of
// those standbys can never leave a consumer with the effect of an event
// the new primary lacks. The relay notes the primary's WAL position when
// it claims a batch (every event it read had committed before it), and
// holds the batch until the standbys' flush positions (pg_stat_replication,
// readable with the pg_monitor role) pass it. That position is WAL's insert
// position, never its write position (WalPastVisibleCommits).
//
// Example:
//   ReplicationFence fence({.standbys = 1});
//   FenceState state = fence.Read(tx);
//   if (state.flushed >= batch_lsn) Send(batch);
//   if (fence.Note(state, batches still held, absl::Now())) warn of
//   fence.waiting();

#include <cstdint>
#include <optional>
#include <pqxx/pqxx>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace outbox::relay {

struct FenceOptions {
  // Standbys that must have flushed an event before it goes; 0: no fence.
  int standbys = 0;
  // Only these standbys count (their application_name); empty: any.
  std::set<std::string> names;
  bool enabled() const { return standbys > 0; }
};

// One standby as pg_stat_replication shows it.
struct StandbyPosition {
  std::string name;                 // application_name
  std::optional<uint64_t> flushed;  // none: not known
  bool streaming = false;
  bool hidden = false;  // its state and positions are hidden (privilege)
};

struct FenceState {
  uint64_t flushed = 0;  // what `standbys` eligible standbys all flushed
  int eligible = 0;      // streaming standbys that count
  bool readable = true;  // false: the positions are hidden (privilege)
  // Why delivery waits ("" when it need not): too few standbys, or the
  // positions cannot be read.
  std::string why_waiting;
};

// The primary's WAL position past the commit of every transaction `tx`
// can see, as "X/Y": a batch read before it goes once the standbys flushed
// it. Its insert position: the write position (pg_current_wal_lsn) lags
// the commit records of asynchronous-commit transactions
// (synchronous_commit = off), which are visible before their WAL is
// written. Throws as libpqxx does.
std::string WalPastVisibleCommits(pqxx::transaction_base& tx);

// The WAL position "X/Y" as a number; nothing for anything else.
std::optional<uint64_t> ParseLsn(absl::string_view lsn);

// What the standbys allow: the `options.standbys`-th highest flush
// position among the eligible ones (0 when there are too few). Pure.
FenceState FenceOf(const std::vector<StandbyPosition>& standbys,
                   const FenceOptions& options);

class ReplicationFence {
 public:
  explicit ReplicationFence(FenceOptions options) : options_(options) {}

  // Reads pg_stat_replication. Throws as libpqxx does.
  FenceState Read(pqxx::transaction_base& tx) const;
  // Read in a unit of its own on `conn`; a failure is returned.
  absl::StatusOr<FenceState> Read(pqxx::connection_base& conn) const;

  const FenceOptions& options() const { return options_; }

  // After a Read (`state`) and the releases it allowed: whether batches
  // are still held. Returns true when a warning is due: the fence itself
  // holds them back (state.why_waiting: too few standbys, hidden
  // positions), and that reason is new or was last warned of 10 s ago.
  // Pure.
  bool Note(const FenceState& state, bool holding, absl::Time now);
  // Why held batches wait, as last noted; "" when none is held.
  const std::string& waiting() const { return waiting_; }

 private:
  const FenceOptions options_;
  std::string waiting_;
  absl::Time next_warning_ = absl::InfinitePast();
};

}  // namespace outbox::relay
