#pragma once
// The outbox read as a log. A tick records which transactions had
// committed at one moment (a pg_snapshot) and the highest seq visible
// then; the range (from, to] of two ticks is exactly the events whose
// transaction committed between them, whatever their seq, so reading
// range after range reads every event once even when one transaction
// draws its seq before another and commits after it (the trap of polling
// by "seq > the last one seen"). docs/log-delivery.md has the model.
//
// Example:
//   absl::StatusOr<Tick> to = MakeTick(tx);          // then, in any later
//   LogRead read{.from = last, .to = *to};            // statement:
//   absl::StatusOr<LogBatch> batch = ReadLog(tx, read);
//   ... deliver batch->events; read.after_seq = batch->last_seq; repeat
//   until batch->range_done, then last = *to.
//
// Each function runs in the caller's transaction, which must be READ
// COMMITTED, and turns libpqxx's exceptions into a status (SQLSTATE kept,
// common/db.h StatusFromException); after an error the transaction is
// aborted.

#include <cstdint>
#include <map>
#include <pqxx/pqxx>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "outbox/v1/event.pb.h"
#include "relay/log_plan.h"

namespace outbox::relay {

// A pg_snapshot in its parts ("xmin:xmax:xip,..." as PostgreSQL prints it).
struct Snapshot {
  uint64_t xmin = 0;
  uint64_t xmax = 0;
  std::vector<uint64_t> xip;  // ascending, each in [xmin, xmax)

  // InvalidArgument unless `text` is a pg_snapshot's text form.
  static absl::StatusOr<Snapshot> Parse(absl::string_view text);
  std::string ToString() const;
  // Whether transaction `xid` had ended when the snapshot was taken, as
  // pg_visible_in_snapshot decides.
  bool Shows(uint64_t xid) const;
};

// One cut of the log (a row of outbox_ticks).
struct Tick {
  int64_t id = 0;
  Snapshot snapshot;
  int64_t high_seq = 0;  // the highest seq visible in `snapshot`, 0 for none
  absl::Duration age;    // since it was made, when it was read
};

// Makes the next tick (outbox_tick(): ticks are numbered in the order of
// their snapshots). The events it shows are readable by any statement that
// follows it.
absl::StatusOr<Tick> MakeTick(pqxx::transaction_base& tx);

// The newest tick if it is younger than `min_age` (InfiniteDuration: the
// newest, whatever its age), else a new one (outbox_tick_since): ticks
// shared by every relay. In the same statement: whether `subscription`
// has exceptions (outbox_delivery rows) in `partitions`.
struct TickAndExceptions {
  Tick tick;
  bool made = false;  // by this statement: its snapshot is newer than it
  bool exceptions = false;
};
absl::StatusOr<TickAndExceptions> TickSince(pqxx::transaction_base& tx,
                                            absl::Duration min_age,
                                            const std::string& subscription,
                                            const std::vector<int>& partitions);

// The tick `id`; NotFound if there is none (pruned, or never made).
absl::StatusOr<Tick> ReadTick(pqxx::transaction_base& tx, int64_t id);

// The newest tick (a migrated outbox has one).
absl::StatusOr<Tick> LatestTick(pqxx::transaction_base& tx);

// A read of the range (from, to]: its events with seq > after_seq, of
// `partitions` (empty: every partition), in seq order.
struct LogRead {
  Tick from, to;
  int64_t after_seq = 0;  // 0 at the start of a range
  std::vector<int> partitions;
  int limit = 256;                     // events, at least 1
  int64_t payload_budget = 4ll << 20;  // bytes (relay/outbox_row.h)
};

struct LogEvent {
  v1::Event event;          // envelope from the columns, payload decoded
  bool payload_ok = false;  // false: the stored payload is not an Event
  int partition = 0;
  uint64_t xid = 0;
};

struct LogBatch {
  std::vector<LogEvent> events;  // ascending seq, all > after_seq
  // The read position after this batch: the last event's seq, or after_seq
  // when there were none.
  int64_t last_seq = 0;
  // Nothing of the range lies beyond last_seq (in `partitions`).
  bool range_done = false;
};

// Reads the next batch of `read`. InvalidArgument if the ticks are not
// from < to or the limit is below 1.
absl::StatusOr<LogBatch> ReadLog(pqxx::transaction_base& tx,
                                 const LogRead& read);

// The position of `subscription` on `partition` (relay/log_plan.h
// LogPosition); a partition read for the first time starts at the
// subscription's start tick. NotFound for an unknown subscription;
// NotOnLogError for one that has no start tick (the log does not deliver
// to it: never moved onto it, or moved off).
absl::StatusOr<LogPosition> ReadPosition(pqxx::transaction_base& tx,
                                         const std::string& subscription,
                                         int partition);

// FailedPrecondition that says `subscription` is not delivered from the
// log, marked so that IsNotOnLog tells it from a database's refusal mapped
// to the same code (StatusFromException).
absl::Status NotOnLogError(const std::string& subscription);
bool IsNotOnLog(const absl::Status& status);

// Moves the position from `from` to `to`, if `member` holds the
// partition's lease (relay/leases.h) and the position is still `from`:
// false, and nothing changes, when either is not so (the lease was lost,
// or another relay moved it). InvalidArgument if `to` does not move
// forward (MovesForward).
absl::StatusOr<bool> MovePosition(pqxx::transaction_base& tx,
                                  const std::string& subscription,
                                  int partition, const std::string& member,
                                  const LogPosition& from,
                                  const LogPosition& to);

// MovePosition for several partitions that stand at the same position, in
// one statement: the partitions moved (ascending); the others stay.
absl::StatusOr<std::vector<int>> MovePositions(
    pqxx::transaction_base& tx, const std::string& subscription,
    const std::vector<int>& partitions, const std::string& member,
    const LogPosition& from, const LogPosition& to);

// The chains (OutboxChain) of `partitions` that have exceptions for
// `subscription` (outbox_delivery rows of any status: backing off, dead,
// diverged, owed again): the log sends none of their events (PlanBatch).
absl::StatusOr<std::set<std::string>> ExceptedChains(
    pqxx::transaction_base& tx, const std::string& subscription,
    const std::vector<int>& partitions);

// Owes the events `seqs` to `subscription` as exceptions (pending
// outbox_delivery rows, delivered as every such row is); an event that has
// one already keeps it. Returns how many were written.
absl::StatusOr<int64_t> OweExceptions(pqxx::transaction_base& tx,
                                      const std::string& subscription,
                                      const std::vector<int64_t>& seqs);

// What the log still owes a subscription in one partition (its
// exceptions, outbox_delivery rows, not included).
struct LogOwed {
  int64_t events = 0;
  double oldest_seconds = 0;  // since the oldest of them was written
  int64_t lowest_seq = 0;
};

// Where the admin's counts of what the log owes stop.
inline constexpr int64_t kLogOwedCountCap = 100000;

// What the log owes `subscription` in each of `partitions` (empty: all)
// that it owes anything: the events that the oldest done tick of their
// positions (the start tick where a partition has none yet) does not show and
// that the log has not delivered, found by the xid index from that tick's xmin,
// at most `cap` of them (the counts stop there). Empty for a subscription on
// rows.
absl::StatusOr<std::map<int, LogOwed>> LogOwedBy(
    pqxx::transaction_base& tx, const std::string& subscription,
    const std::vector<int>& partitions, int64_t cap);

// What LogOwedBy found over all its partitions: their events summed, the
// oldest of them, the lowest seq (0: none).
LogOwed LogOwedTotal(const std::map<int, LogOwed>& owed);

// After a dump was restored into another cluster, whose transaction ids
// lie behind the last tick's (MakeTick then refuses): owes every event
// that the positions had not delivered to its subscription as an
// exception (an outbox_delivery row), so nothing is lost to the new ids,
// and restarts the log at a new tick with every position and start tick
// on it. Events written since the restore, before the rebase, are owed
// too (their new ids would read as delivered to the old snapshots), and
// one committing while the rebase runs is read from the log after the new
// tick. Events the new tick does not show come again from the log and
// are answered as duplicates. Does nothing when the ids are not behind.
struct Rebased {
  bool rebased = false;
  int64_t owed = 0;  // exception rows written
  int64_t tick = 0;  // the new tick
};
absl::StatusOr<Rebased> RebaseLog(pqxx::transaction_base& tx);

// Deletes the ticks that no position, subscription or later range needs:
// those below the lowest done tick of the subscriptions' positions and the
// start tick of any subscription with a partition not read yet, always
// keeping the newest. Returns how many went.
absl::StatusOr<int64_t> PruneTicks(pqxx::transaction_base& tx);

}  // namespace outbox::relay
