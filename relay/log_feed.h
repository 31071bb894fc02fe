#pragma once
// How a relay's worker drives the outbox log of its subscription
// (docs/log-delivery.md): the session's LogReader, and when each statement
// that costs is due: a read that must show newer commits (one that may ask
// for a new tick), the claim of the subscription's exceptions, the store
// of positions, and the retry of a tick that was refused as too early.
//
// Example (one round of the worker, on its connection):
//   const bool claims = feed.BeginRound(absl::Now(), listener.TakeHeard());
//   if (claims) ...claim the exceptions (relay/claim.h)...
//   absl::StatusOr<LogSend> read = feed.Read(conn, partitions, limit,
//                                            listener_hears_commits);
//   ...send read->events; each answer written: feed.Settle(seq)...
//   feed.EndRound();
//   if (feed.FlushDue(absl::Now(), stopping)) feed.Flush(conn);
//   sleep at most feed.RetryWait(absl::Now());
//
// Not thread-safe: the worker alone calls it.

#include <cstdint>
#include <memory>
#include <optional>
#include <pqxx/pqxx>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "relay/log_reader.h"

namespace outbox::relay {

struct LogFeedOptions {
  LogReaderOptions reader;
  // A fresh read, and a claim of exceptions, at least this often whatever
  // was heard (rows an operator or a heal wrote make no NOTIFY).
  absl::Duration poll_interval = absl::Milliseconds(500);
  // Positions are stored at most this often unless asked to (before
  // partitions are given up, when stopping): a position stored late only
  // means events read again after a crash and answered DUPLICATE, and
  // every statement less counts at a high rate.
  absl::Duration flush_interval = absl::Milliseconds(200);
  // A read that found events also reads the WAL position past their
  // commits (LogSend::lsn), which the replication fence holds them to.
  bool fenced = false;
};

class LogFeed {
 public:
  explicit LogFeed(LogFeedOptions options);

  // A round of the worker begins; `heard`: when the newest NOTIFY since
  // the last round arrived (its commit and every one before must be read).
  // Returns whether this round claims the subscription's exceptions:
  // while the reads may have left some, and once per poll_interval.
  bool BeginRound(absl::Time now, std::optional<absl::Time> heard);
  // A lane read nothing this round (its credit was spent): whether its
  // partitions have exceptions is unknown, so the next round claims.
  void Skipped() { exceptions_round_ = true; }
  // Every read of the round succeeded: what they saw of exceptions
  // decides whether the next rounds claim them.
  void EndRound() { exceptions_ = exceptions_round_; }
  // An exception was written (an answer, a repair, a dropped flight): the
  // next rounds claim until a read finds none (one written during a round
  // outlives its EndRound).
  void Owed();

  // Which commits a read at `now` must show (LogReader::Next's
  // must_show): those a NOTIFY announced and no read has shown yet, and
  // every one before `now` when no NOTIFY could be heard (`listening`
  // false), the last read found events (more are likely, and their
  // NOTIFYs may lag them on a busy machine), or a poll is due (which this
  // starts anew). InfinitePast: none, the reader reads on to the tick it
  // has and asks for none.
  absl::Time MustShow(absl::Time now, bool listening);
  // What a read returned at `now`, for the next MustShow and RetryWait.
  void Observe(const LogSend& read, absl::Time now);

  // Reads up to `limit` events of `partitions` (LogReader::Next), showing
  // what MustShow says, and observes the result. A status with SQLSTATE
  // 55000 means the database's transaction ids went behind the log's:
  // nothing may be read until it is rebased (RebaseLog), then Reset. When
  // fenced and the position cannot be read, what was read is read again
  // (Rewind) and the error returned.
  absl::StatusOr<LogSend> Read(pqxx::connection& conn,
                               const std::vector<int>& partitions, int limit,
                               bool listening);

  // The database's transaction ids went behind the log's (a dump restored
  // into another cluster; Read's SQLSTATE 55000): rebases the log
  // (RebaseLog) in a transaction of its own, logs what that owed, and
  // reads every position again, claiming what became exceptions. What is
  // in flight is to be dropped by the caller: its answers settle nothing.
  absl::Status Rebase(pqxx::connection_base& conn);

  // Whether positions moved and are to be stored now: `force`, or
  // flush_interval since the last store. Starts the interval anew.
  bool FlushDue(absl::Time now, bool force);
  // Stores the positions that moved (LogReader::Flush): the partitions
  // whose stored position another relay moved are returned, forgotten.
  absl::StatusOr<std::vector<int>> Flush(pqxx::connection& conn);

  // How long the worker may sleep before a refused tick is due again;
  // infinite when none is.
  absl::Duration RetryWait(absl::Time now) const;

  // An event read was answered, or is owed as an exception (committed).
  void Settle(int64_t seq);
  // What is in flight is read again: its answers will not come.
  void Rewind();
  // The partitions are another relay's now.
  void Forget(const std::vector<int>& partitions);
  // A new session, or positions moved under this relay (a rebase, a
  // failover, the subscription moved): every position is read again.
  void Reset() { reader_.reset(); }

 private:
  const LogFeedOptions options_;
  std::unique_ptr<LogReader> reader_;  // made by the first read
  // Commits before this are to be read (InfinitePast: none is owed).
  absl::Time must_show_ = absl::InfinitePast();
  bool active_ = false;  // the last read found events
  absl::Time retry_at_ = absl::InfiniteFuture();
  absl::Time next_poll_ = absl::InfinitePast();
  absl::Time next_flush_ = absl::InfinitePast();
  bool exceptions_ = true;
  bool exceptions_round_ = false;
  absl::Time next_exception_claim_ = absl::InfinitePast();
};

}  // namespace outbox::relay
