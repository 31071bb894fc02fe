#pragma once
// What moves events from the outbox to the sink and answers back into the
// outbox, for one relay's worker: each round it claims the exceptions and
// rows it owes (RowsClaim) and reads the log (LogFeed) for the lanes that
// serve, builds batches and sends them; it takes the lanes' answers into
// the settlement, writes their marks and the log's positions, records what
// answers showed of the consumer (ConsumerWatch) and lets the fence's held
// batches go. The relay's worker owns it and its database session, and
// says when the session, the partitions or the subscription changed.
//
// Example (one pass of the worker, `conn` its session):
//   dispatcher.TakeAnswers();
//   dispatcher.FlushMarks(conn);  dispatcher.FlushLog(conn, false);
//   dispatcher.WriteRepairs(conn, &consumer_database);
//   dispatcher.lanes().Open(sink, wake, absl::Now());
//   dispatcher.Round(conn, ownership, listener, paused, &all_held);
//
// Nothing is marked before its answer (a crash anywhere means the event
// goes again), and an aggregate's next event goes only once the one before
// is settled (Settlement). Errors are the database's: the worker drops
// its session and the dispatcher's reads start afresh (Reset).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/db.h"
#include "relay/batch_builder.h"
#include "relay/consumer_watch.h"
#include "relay/fence.h"
#include "relay/lanes.h"
#include "relay/listener.h"
#include "relay/log_feed.h"
#include "relay/ownership.h"
#include "relay/relay_metrics.h"
#include "relay/relay_options.h"
#include "relay/rows_claim.h"
#include "relay/settlement.h"
#include "relay/sink.h"
#include "relay/subscribe.h"

namespace outbox::relay {

class Dispatcher {
 public:
  // `options`, `counters` and `sink` must outlive it; `member` names the
  // relay among its replicas; `deleted` hears how many delivery rows the
  // marks deleted (for retention's figures).
  Dispatcher(const RelayOptions& options, const std::string& member,
             const RelayCounters* counters, Sink* sink,
             std::function<void(int64_t rows)> deleted);

  // A new session took the subscription up (`up`): where chains begin,
  // the source events carry, whether it is on the log, what the outbox
  // recorded of the consumer. The log's positions are read again.
  void TakeUp(const TakenUp& up);
  // The subscription is on the log (`on_log`) or off it now, as another
  // replica, an operator or a rebase left it: the log is read afresh.
  void FollowLogMove(bool on_log);
  // The session was lost: the log's positions are read again in the next.
  void Reset();
  // These partitions are no longer this relay's: their reads end.
  void Forget(const std::vector<int>& partitions);
  // Everything in flight and answered is dropped (the outbox database
  // failed over or was replaced: its rows may be other events now).
  void DropEverything(const std::string& why);
  // Drops every lane's stream (what is in flight stays owed).
  void DropStreams(const std::string& why);

  // Takes every lane's answers, drops streams that broke or overran
  // --ack_timeout.
  void TakeAnswers();
  // The serving lanes' claims and log reads of one round, for the
  // partitions `ownership` gives this relay (none while `paused`), then
  // the marks they left and the fenced batches that may go; `*all_held`:
  // every serving lane waits for answers. An error: the database is lost
  // (as in each step below that returns a status).
  absl::Status Round(Connection& conn, const PartitionOwnership& ownership,
                     CommitListener& listener, bool paused, bool* all_held);
  // Writes the settlement's marks in a statement of their own (a
  // transaction when some are rejections).
  absl::Status FlushMarks(Connection& conn);
  // Stores the log positions that answers moved (written marks only), at
  // most every LogFeedOptions::flush_interval unless `now`.
  absl::Status FlushLog(Connection& conn, bool now);
  // What answers taught that the database must know: the consumer's
  // database identity (a change requests a heal; `*consumer_database` is
  // set to it when recorded) and the events a HELD answer showed the
  // consumer lacks (owed again at once).
  absl::Status WriteRepairs(Connection& conn,
                            std::optional<std::string>* consumer_database);

  // The marks may ride with the round's first claim (rows only).
  bool marks_ride_with_claim() const {
    return !on_log_ && settlement_.RideWithClaim();
  }
  // Nothing in flight, nothing answered and unmarked.
  bool settled() const {
    return lanes_.events_in_flight() == 0 && settlement_.settled();
  }
  // How long the worker may sleep before the log's refused tick is due,
  // or before a held batch is looked at again (at most `wait`).
  absl::Duration Wait(absl::Duration wait) const;
  // Why the fence holds delivery, or "".
  std::string fence_waiting() const;

  Lanes& lanes() { return lanes_; }
  const Lanes& lanes() const { return lanes_; }
  const std::string& source() const { return source_; }

 private:
  // What one round's claims found (for choosing the lanes of the next).
  struct ClaimRound {
    bool ran = false;   // a claim ran (it was not held back by the window)
    bool full = false;  // one of them filled its batch: a backlog
  };
  // Claims rows (RowsClaim) of `partitions` and sends them on `lane`.
  absl::Status Claim(Connection& conn, Lane& lane, std::vector<int> partitions,
                     ClaimRound* round);
  // The same from the outbox log (on_log_): reads the next events of
  // `partitions` and sends them on `lane`.
  absl::Status SendFromLog(Connection& conn, CommitListener& listener,
                           Lane& lane, const std::vector<int>& partitions,
                           ClaimRound* round);
  // A built batch's events out (the settlement's, the lane's cursor), and
  // its batch, if any, sent on `lane` (`full`: it took all the lane
  // allowed), or held until the standbys flushed WAL position `lsn` (the
  // fence).
  void Send(Lane& lane, BuiltBatch& built, bool full, const std::string& lsn,
            ClaimRound* round);
  // A claim of rows, or a read of the log, found `rows` in `took`.
  void ObserveClaim(size_t rows, absl::Duration took);
  // The outbox's transaction ids went behind the log's (a dump restored
  // into another cluster): owes what the log had not delivered and
  // restarts it (RebaseLog).
  absl::Status Rebase(Connection& conn);
  // After the marks were written: counts them and lets the log's
  // positions pass those from the log.
  void Settle(const Settled& settled);
  // Sends the fenced batches that the standbys have flushed (one read of
  // their positions for every lane).
  absl::Status ReleaseFenced(Connection& conn);
  void HandleResponses(Lane& lane);
  void DropStream(Lane& lane, const std::string& why);

  const RelayOptions& options_;
  const std::string member_;
  const RelayCounters* const counters_;
  Sink* const sink_;
  const std::function<void(int64_t)> deleted_;
  std::unique_ptr<ReplicationFence> fence_;  // null: no fence

  // Where chains begin for this subscription (events whose prev_seq is
  // below it are the first of their chain: their predecessor was never
  // owed to it), and the source events carry.
  int64_t chain_from_ = 0;
  std::string source_;
  // The subscription is delivered from the outbox log (it has a start
  // tick), by log_ beside the claims of its exceptions.
  bool on_log_ = false;
  LogFeed log_;
  Lanes lanes_;
  uint64_t next_batch_id_ = 1;
  // Aggregates with events in flight or answered and not yet marked (not
  // claimed again until marked), and the answers' marks.
  Settlement settlement_;
  // What answers taught of the consumer's database, until WriteRepairs.
  ConsumerWatch consumer_;
  RowsClaim rows_;  // after settlement_, which it uses
};

}  // namespace outbox::relay
