#pragma once
// The relay: delivers committed outbox rows to the consumer at least once and
// in per-aggregate order.
//
// One worker thread owns one database connection, on which it renews the
// leases of the partitions it owns (relay/leases.h), claims pending rows of
// those partitions in seq order (the claim itself checks the lease), and
// marks rows after the consumer's answer (never before: a crash anywhere
// means redelivery), each mark naming the event by seq and event_id, so
// that no answer ever touches another event. Rows stream over long-lived
// EventSink.Deliver streams, bounded by a credit window. Replicas count
// each other through membership leases and each takes
// ceil(partitions / replicas); a replica that dies or freezes loses its
// leases when they expire, and the others take its partitions over.
//
// Either database may fail over or be restored under it. A change of the
// outbox database's identity (common/db_identity.h) drops everything in
// flight and requests a heal; so does a change of the consumer's database
// (each answer names it), and a HELD answer for an event whose predecessor
// the consumer had answered before re-owes the events it lacks at once. A
// heal (relay/heal.h) compares the consumer's cursors with what was
// delivered, delivers again what the consumer lost, and records as
// diverged what only an operator can decide. A DIVERGED answer parks the
// event and its aggregate for that operator (no attempt is counted).
//
// Beside the worker, a listener thread holds a LISTEN connection (NOTIFY
// wakes the worker; while every stream awaits an answer there is nothing
// to wake it for, and under steady load the listener stops listening
// until the worker wants wakes again, relay/listener.h) and housekeeping a
// third connection for the backlog figures, the retention deletes, heals
// and the delivery table's vacuum, so that none of them ever holds up a
// claim or a mark (relay/housekeeping.h).
//
// A REJECTED answer counts an attempt and reschedules the row with backoff;
// after max_attempts the row is a dead letter. Later rows of that aggregate
// wait behind it (and only those). Transport failures never count.

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <pqxx/pqxx>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/db.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/tls.h"
#include "common/watchdog.h"
#include "outbox/v1/relay.pb.h"
#include "outbox/v1/sink.grpc.pb.h"
#include "relay/batch_builder.h"
#include "relay/claim.h"
#include "relay/consumer_link.h"
#include "relay/consumer_watch.h"
#include "relay/delivery_store.h"
#include "relay/delivery_stream.h"
#include "relay/fence.h"
#include "relay/housekeeping.h"
#include "relay/lane.h"
#include "relay/listener.h"
#include "relay/log_feed.h"
#include "relay/marks.h"
#include "relay/outbox_row.h"
#include "relay/ownership.h"
#include "relay/policy.h"
#include "relay/relay_metrics.h"
#include "relay/rows_claim.h"
#include "relay/settlement.h"
#include "relay/subscribe.h"
#include "relay/subscriptions.h"

namespace outbox::relay {

struct RelayOptions {
  std::string db_url;
  // The subscription this relay delivers (created on first use, see
  // StartFrom); replicas of one subscription share its partitions.
  std::string subscription = "billing";
  // The name events of this outbox carry (Event.source), recorded in the
  // outbox by the first relay; "" takes what is recorded, or records a
  // default (the database's name and a random suffix).
  std::string source;
  StartFrom start_from = StartFrom::kOldest;
  // Make the subscription anew (per start_from) even if an operator dropped
  // it; otherwise a dropped subscription is refused, loudly.
  bool resubscribe = false;
  // Move the subscription onto the outbox log (docs/log-delivery.md) if it
  // is not: from then on the producer's transactions write nothing for it
  // and delivering an event writes nothing per event. A subscription on
  // the log is delivered from it whatever this says; one an operator moved
  // off the log stays off (RelayAdmin.MoveSubscriptionToRows). False: a
  // new subscription is delivered by rows (one per event).
  bool log_delivery = true;
  DbSession session;     // limits of every database session
  std::string consumer;  // host:port of EventSink
  // Where batches go instead of `consumer` (a JetStreamSink), started and
  // stopped by the relay. Null: the consumer over gRPC.
  std::shared_ptr<Sink> sink;
  ClientTlsFiles consumer_tls;  // none: plaintext
  int max_attempts = 5;
  int batch_size = 512;  // events per DeliverRequest
  int window = 2048;     // events in flight at most
  // Batches in flight at most, per lane, while there is a backlog (each
  // batch in flight was full); otherwise one. Two keep the consumer busy
  // while an answer travels back; more would only split the backlog into
  // smaller batches (one commit each) instead of letting a batch fill up.
  int pipeline_depth = 2;
  // Delivery streams. While there is a backlog, each open stream carries
  // its own share of the partitions and the consumer applies their batches
  // in parallel; otherwise the first open stream carries them all, so that
  // the small batches of a moderate rate reach the consumer one at a time
  // and grow while it applies the one before (fewer, larger transactions).
  // Order does not depend on the stream: an aggregate's next event is
  // claimed only once the one before it is marked.
  int lanes = 2;
  absl::Duration poll_interval = absl::Milliseconds(500);
  absl::Duration ack_timeout = absl::Seconds(15);
  absl::Duration rebalance_interval = absl::Seconds(1);
  // How often the backlog figures are read (they also are whenever the
  // owned partitions change).
  absl::Duration backlog_refresh = absl::Seconds(15);
  absl::Duration retry_initial = absl::Milliseconds(100);  // transport backoff
  absl::Duration retry_max = absl::Seconds(5);
  absl::Duration reject_backoff = absl::Milliseconds(500);  // first REJECTED
  absl::Duration reject_backoff_max = absl::Seconds(60);
  // Delivered rows older than this are deleted in small batches by the
  // replica that owns partition 0, so the outbox does not grow forever.
  // Zero keeps every row.
  absl::Duration retention;
  // How long retention rests once it has caught up before it looks again.
  absl::Duration retention_interval = absl::Minutes(1);
  // How long a partition lease lasts without renewal (renewed every
  // rebalance_interval): a replica that dies or freezes keeps its
  // partitions this long at most.
  absl::Duration lease_ttl = absl::Seconds(5);
  // A relay whose consumer has not answered for this long (neither a batch
  // nor a health check of outbox.v1.EventSink, tried every second) turns
  // readiness NOT_SERVING and gives its partitions (and its membership) to
  // the replicas that reach the consumer, until it answers again. Zero
  // disables.
  absl::Duration consumer_unready_after = absl::Seconds(15);
  // Where the listener LISTENs; empty: db_url. Behind a transaction pooler
  // LISTEN cannot work: give a direct URL, or the relay polls every
  // fast_poll_interval instead.
  std::string notify_url;
  absl::Duration fast_poll_interval = absl::Milliseconds(25);
  // Deliver only what enough standbys flushed (relay/fence.h).
  FenceOptions fence;
  // For tests: runs on the worker right after each claim statement, with
  // the number of rows it returned.
  std::function<void(size_t rows)> after_claim;
  // For tests: runs on the listener thread each time it begins (true) or
  // stops (false) listening for NOTIFYs.
  std::function<void(bool listening)> on_listening;
};

class Relay {
 public:
  // `metrics` must outlive the relay; so must `watchdog` (may be null),
  // which hears whether each round of claims and marks succeeded.
  Relay(RelayOptions options, Metrics* metrics, Watchdog* watchdog = nullptr);
  ~Relay();  // Stop(0) if still running

  void Start();
  // Stops claiming, waits up to `drain` for answers to what is in flight,
  // marks what was answered, releases partitions. Unanswered rows stay
  // pending. Idempotent.
  void Stop(absl::Duration drain);

  RelayState State() const;

  // Why this relay is not ready (its consumer does not answer: see
  // RelayOptions::consumer_unready_after), or nothing. Thread-safe.
  std::optional<std::string> Unready() const;

  const std::string& subscription() const { return options_.subscription; }
  // The name this outbox's events carry (Event.source); "" until the
  // relay first reached its database.
  std::string source() const;
  absl::Duration retention() const { return options_.retention; }

  // application_name of the relay's database session, unique to it.
  const std::string& session_name() const { return session_name_; }

  // Its name among the subscription's replicas (partition leases).
  const std::string& member() const { return ownership_.member(); }

  // The channel to the consumer, with the relay's identity, for calls of
  // the admin service (EventSink.Rewind). Thread-safe.
  // The consumer's EventSink; null when the sink is not a consumer.
  v1::EventSink::Stub* consumer_stub() const { return sink_->consumer(); }

 private:
  // The worker's loop, and its steps that do not touch the database.
  void Run();
  // Takes every lane's answers, drops streams that broke or overran
  // --ack_timeout.
  void TakeAnswers();
  // Gives up the partitions while the consumer answers nothing, takes a
  // share again once it does (RelayOptions::consumer_unready_after).
  void FollowConsumer();
  // The serving lanes' claims and log reads of one round, then the marks
  // they left and the fenced batches that may go; `*all_held`: every
  // serving lane waits for answers. An error: the database is lost (as in
  // each step below that returns a status).
  absl::Status DeliverRound(bool* all_held);
  // Every lane has its stream.
  bool AllConnected() const;
  // How long the loop may sleep unless woken.
  absl::Duration NextWait(bool stopping) const;
  // The worker's state as State() reports it.
  void PublishState() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drained (or out of time): closes the streams, writes the last marks
  // and positions, releases the partitions.
  void Finish();
  void Wake();
  // Connects and takes up the subscription, unless connected; until the
  // next attempt is due, the error of the last one.
  absl::Status EnsureConnection();
  absl::Status Rebalance();
  // Logs that `step` failed with `status`, and returns it.
  static absl::Status Failed(absl::string_view step, absl::Status status);
  // What one cycle's claims found (for choosing the lanes of the next).
  struct ClaimRound {
    bool ran = false;   // a claim ran (it was not held back by the window)
    bool full = false;  // one of them filled its batch: a backlog
  };
  // Events `lane`'s next claim may ask for (ClaimLimit); 0: it waits for
  // answers.
  int LaneLimit(const Lane& lane) const;
  // Claims rows (RowsClaim) for the partitions of slot `slot` of `slots`
  // and sends them on `lane`.
  absl::Status Claim(Lane& lane, int slot, int slots, ClaimRound* round);
  // The same from the outbox log (on_log_): reads the next events of those
  // partitions and sends them on `lane`.
  absl::Status SendFromLog(Lane& lane, int slot, int slots, ClaimRound* round);
  // A built batch's events out (the settlement's, the lane's cursor), and
  // its batch, if any, sent on `lane` (`full`: it took all the lane
  // allowed), or held until the standbys flushed WAL position `lsn` (the
  // fence).
  void Send(Lane& lane, BuiltBatch& built, bool full, const std::string& lsn,
            ClaimRound* round);
  // A claim of rows, or a read of the log, found `rows` in `took`.
  void ObserveClaim(size_t rows, absl::Duration took);
  // Stores the log positions that answers moved (written marks only), at
  // most every LogFeedOptions::flush_interval unless `now`.
  absl::Status FlushLog(bool now);
  // The subscription is on the log (`on_log`) or off it now, as another
  // replica, an operator or a rebase left it: the log is read afresh.
  void FollowLogMove(bool on_log);
  // The outbox's transaction ids went behind the log's (a dump restored
  // into another cluster): owes what the log had not delivered and
  // restarts it (RebaseLog).
  absl::Status Rebase();
  // The lanes that claim this cycle: every open one while spread_ (a
  // backlog), else the first open one; updates `serving_`.
  std::vector<Lane*> ServingLanes();
  // Writes the settlement's marks in a statement of their own (a
  // transaction when some are rejections).
  absl::Status FlushMarks();
  // After the marks were written: counts them and lets the log's
  // positions pass those from the log.
  void Settle(const Settled& settled);
  // What answers taught that the database must know: the consumer's
  // database identity (a change requests a heal) and the events a HELD
  // answer showed the consumer lacks (owed again at once).
  absl::Status WriteRepairs();
  // Everything in flight and answered is dropped (the outbox database
  // failed over: its rows may be other events now); a heal is requested.
  void DropEverything(const std::string& why);
  // Sends the fenced batches that the standbys have flushed (one read of
  // their positions for every lane).
  absl::Status ReleaseFenced();
  // A lane holds a fenced batch.
  bool AnyHeld() const;
  void HandleResponses(Lane& lane);
  void DropStream(Lane& lane, const std::string& why);
  int64_t InFlightEvents() const;

  const RelayOptions options_;
  const std::string replica_id_;
  // application_name of the worker's session: unique to this process, so a
  // reconnect can end its own stale session (and free its locks).
  const std::string session_name_;
  Watchdog* const watchdog_;
  const RelayCounters counters_;

  // Where batches go and whether it answers (made by the constructor: the
  // streams, heals and the admin service use it).
  std::shared_ptr<Sink> sink_;

  // The outbox database's identity, as every session of this relay sees it
  // (a change sets own_db_changed_, which the worker handles).
  std::unique_ptr<IdentityWatch> own_watch_;
  DbSession session_;  // options_.session, with own_watch_
  std::atomic<bool> own_db_changed_{false};
  absl::Mutex change_mu_;
  std::string own_db_change_ ABSL_GUARDED_BY(change_mu_);
  std::unique_ptr<ReplicationFence> fence_;  // null: no fence

  // Worker-thread state.
  std::unique_ptr<Connection> conn_;
  PartitionOwnership ownership_;
  // Gone, paused, on the log: read every rebalance round.
  SubscriptionWatch subscription_watch_;
  int subscription_id_ = 0;
  // Events whose prev_seq is below this are the first of their chain for
  // this subscription (their predecessor was never owed to it).
  int64_t chain_from_ = 0;
  // The subscription is delivered from the outbox log (it has a start
  // tick), by log_ beside the claims of its exceptions.
  bool on_log_ = false;
  LogFeed log_;
  // --log_delivery did not move it onto the log (an operator moved it off
  // it), as last logged.
  bool log_refused_ = false;

  // The session's attempts, backing off after a failure.
  SessionAttempts attempts_;
  std::string source_;  // state_.source is the copy for other threads
  std::vector<Lane> lanes_;
  absl::Time next_rebalance_ = absl::InfinitePast();
  uint64_t next_batch_id_ = 1;

  // Aggregates with events in flight or answered and not yet marked (not
  // claimed again until marked), and the answers' marks.
  Settlement settlement_;
  // What answers taught of the consumer's database, until WriteRepairs.
  ConsumerWatch consumer_;
  RowsClaim rows_;  // after settlement_ and ownership_, which it uses
  // A backlog was seen and not yet worked off: the partitions are spread
  // over every open lane (see RelayOptions::lanes).
  bool spread_ = false;
  std::vector<int> serving_;  // indexes of the lanes ServingLanes last chose

  mutable absl::Mutex mu_;
  bool woken_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time drain_deadline_ ABSL_GUARDED_BY(mu_);
  RelayState state_ ABSL_GUARDED_BY(mu_);  // copy for State()

  std::thread worker_;
  // Made by Start(), before the worker's thread, which uses it.
  std::unique_ptr<CommitListener> listener_;
  // The backlog figures, retention, heals and vacuum, on a thread and a
  // connection of their own (made by the constructor, started by Start).
  std::unique_ptr<Housekeeping> housekeeping_;

  // The consumer has not answered for consumer_unready_after: the worker
  // gave up its partitions for it (worker thread).
  bool unlinked_ = false;
};

}  // namespace outbox::relay
