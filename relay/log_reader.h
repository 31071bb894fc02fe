#pragma once
// Delivery of one subscription from the outbox log (relay/outbox_log.h),
// as the relay that leases some of its partitions drives it: what to send
// next, what the answers settle, and the positions they let it store.
//
// Partitions that stand at the same position are read together, one
// statement for all of them (with one relay owning all 32, the steady
// state is one group); a partition's position never moves past an event
// that was not settled, and a position the relay did not read (another
// relay moved it, or the lease was lost) is never overwritten.
//
// Example (on the relay's worker thread and connection):
//   LogReader reader({.subscription = "billing", .member = leases.member()});
//   absl::StatusOr<LogSend> next = reader.Next(conn, owned, 256);
//   ... send next->events; for each answer:
//   APPLIED, DUPLICATE, HELD: reader.Settle(seq);
//   anything else:            OweExceptions(tx, ...) committed, then
//                             reader.Settle(seq);
//   reader.Flush(conn);  // stores the positions that moved
//   A stream that broke: reader.Rewind() (its events are read again).
//
// Not thread-safe: one thread calls it.

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <pqxx/pqxx>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "relay/log_plan.h"
#include "relay/outbox_log.h"

namespace outbox::relay {

struct LogReaderOptions {
  std::string subscription;
  std::string member;  // the leases' owner name (relay/leases.h)
  int64_t payload_budget = 4ll << 20;  // per read, bytes (relay/outbox_row.h)
  // A new tick at most this often, whoever makes it (outbox_tick_since):
  // a read that must show newer commits than the tick it holds asks for
  // one, and gets the newest instead when that is younger; while the tick
  // it holds is younger, it does not ask at all.
  absl::Duration tick_interval = absl::Milliseconds(1);
  // Ranges of one group read while earlier ones wait for answers: a read
  // need not wait for the round trip of the one before (1: it does).
  int max_ranges = 8;
};

struct LogSend {
  std::vector<LogEvent> events;  // to send, each in flight until settled
  // Events read and owed as exceptions instead (their chain has one).
  int64_t diverted = 0;
  // A read stopped at its limit: more events are ready.
  bool more = false;
  // With LogFeedOptions::fenced and events: a WAL position past their
  // commits (WalPastVisibleCommits), for the replication fence.
  std::string lsn;
  // The read was to show commits that the ticks it has may not, and the
  // newest tick was too young to make another: read again after this.
  absl::Duration retry_in;
  // Every transaction that committed before this moment (the relay's
  // clock) is in the ticks the reader has: reading on reaches its events
  // without a new tick. InfinitePast before the first tick.
  absl::Time shows_before = absl::InfinitePast();
  // The subscription may have exceptions in these partitions (false only
  // when a statement since the last ExceptionsOwed saw that it had none):
  // their claim is due.
  bool exceptions = true;
};

class LogReader {
 public:
  explicit LogReader(LogReaderOptions options);

  // Reads up to `limit` events of `partitions` (leased by the member):
  // positions not known yet are read first; a partition whose range is
  // done reads on to the newest tick the reader has. When that tick may
  // not show every transaction that committed before `must_show` (a
  // NOTIFY's arrival, a poll; InfiniteFuture: this call), the reader asks
  // the database for a newer one (TickSince), unless the one it has is
  // younger than tick_interval: then it asks after retry_in. A read with
  // nothing to show (InfinitePast) makes no statement for its tick, so an
  // answer's wake-up costs the database nothing. The events of chains that have
  // exceptions are owed as exceptions before anything counts as read. A
  // partition whose events are in flight keeps reading within its range,
  // and once a range is read to its end, the next one is read while its
  // answers come (up to max_ranges), except when another group is about
  // to reach the same tick: both wait for their answers and then read
  // as one. On an error nothing read counts (read again next time).
  absl::StatusOr<LogSend> Next(pqxx::connection& conn,
                               const std::vector<int>& partitions, int limit,
                               absl::Time must_show = absl::InfiniteFuture());

  // An event that Next returned was answered (applied, duplicate or held),
  // or is owed as an exception now (committed). False if it was not in
  // flight (settled already, or read before a Rewind or Forget).
  bool Settle(int64_t seq);

  // Stores every position that moved, in one transaction. Returns the
  // partitions whose stored position was not as read (another relay moved
  // it, or the member's lease is gone): they are forgotten.
  absl::StatusOr<std::vector<int>> Flush(pqxx::connection& conn);

  // Everything in flight is read again (its answers will not come).
  void Rewind();
  // The partitions are not this relay's any more: their state goes (their
  // group's events in flight are read again).
  void Forget(const std::vector<int>& partitions);

  // The relay wrote an exception (relay/outbox_log.h OweExceptions, or a
  // rejected answer): what the reads saw of exceptions is void until a
  // statement looks again.
  void ExceptionsOwed() { clear_.clear(); }

  // Some position moved since it was last stored (Flush has work).
  bool moved() const;
  // Events read and not settled.
  size_t in_flight() const { return seq_group_.size(); }
  // Partitions whose position is known (read or stored by this reader).
  std::vector<int> known() const;
  // The position of `partition` as this reader would store it now.
  std::optional<LogPosition> position(int partition) const;

 private:
  // One range of a group, being read or waiting for answers.
  struct Span {
    int64_t id = 0;  // unique in the reader
    RangeToRead range;
    RangeProgress progress;
  };
  // Partitions at one position, read together. Ranges pipeline: the next
  // one is read while the answers of earlier ones are still coming, and
  // only the newest may be unread in part.
  struct Group {
    std::set<int> partitions;
    LogPosition at;          // where the first span starts (or the position)
    std::deque<Span> spans;  // ascending by tick, contiguous from `at`
    // The position the events settled so far allow: every span done from
    // the front, and what is settled of the first that is not.
    LogPosition Position() const;
    // Where the group's next range starts (none yet: its position).
    LogPosition End() const;
    bool idle() const;
    Span* Find(int64_t span);
  };

  // Idle groups start over at their position, regrouped so that each lies
  // wholly inside `wanted` or outside it.
  void Regroup(const std::set<int>& wanted);
  absl::StatusOr<Tick> TickOf(pqxx::transaction_base& tx, int64_t id);
  // The newest tick to read on to, asked of the database only when the
  // one held may not show `must_show` and is old enough to replace
  // (Next). Sets out->retry_in, out->shows_before, and out->exceptions
  // when it asked.
  absl::StatusOr<Tick> NewestTick(pqxx::connection& conn,
                                  const std::vector<int>& partitions,
                                  absl::Time must_show, LogSend* out);
  // Whether every partition of `partitions` is in clear_.
  bool Clear(const std::vector<int>& partitions) const;
  void SawExceptions(const std::vector<int>& partitions, bool any);
  void DropGroupFlight(int group);
  // Spans done at the front of `g` become its position.
  static void Compact(Group& g);

  const LogReaderOptions options_;
  std::map<int, Group> groups_;
  int next_group_ = 1;
  std::map<int, int> partition_group_;
  std::map<int, LogPosition> stored_;  // as in the database, per partition
  int64_t next_span_ = 1;
  // Events in flight: seq -> (group, span).
  std::map<int64_t, std::pair<int, int64_t>> seq_group_;
  std::map<int64_t, Tick> ticks_;  // of ranges being read
  // The newest tick asked of the database, and a moment (the relay's
  // clock) no later than its snapshot: every commit before it shows.
  struct HeldTick {
    Tick tick;
    absl::Time shows_before;
  };
  std::optional<HeldTick> newest_;
  // Partitions a statement saw without exceptions (since ExceptionsOwed).
  std::set<int> clear_;
};

}  // namespace outbox::relay
