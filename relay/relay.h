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
// The worker's loop (this class) keeps the session, the leases, the
// subscription's state and the consumer's reachability; each pass it lets
// the Dispatcher (relay/dispatcher.h) take the answers, write the marks
// and run a round of claims, reads and sends over its Lanes
// (relay/lanes.h).
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
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/db.h"
#include "common/db_identity.h"
#include "common/metrics.h"
#include "common/watchdog.h"
#include "outbox/v1/sink.grpc.pb.h"
#include "relay/dispatcher.h"
#include "relay/housekeeping.h"
#include "relay/listener.h"
#include "relay/ownership.h"
#include "relay/relay_metrics.h"
#include "relay/relay_options.h"
#include "relay/sink.h"
#include "relay/subscribe.h"
#include "relay/subscriptions.h"

namespace outbox::relay {

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
  // The worker's loop: answers, the session, marks, ownership, a round of
  // the dispatcher's, then a wait unless woken.
  void Run();
  // Gives up the partitions while the consumer answers nothing, takes a
  // share again once it does (RelayOptions::consumer_unready_after).
  void FollowConsumer();
  // How long the loop may sleep unless woken.
  absl::Duration NextWait(bool stopping) const;
  // The worker's state as State() reports it.
  void PublishState() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drained (or out of time): closes the streams, writes the last marks
  // and positions, releases the partitions.
  void Finish();
  void Wake();
  // Connects and takes up the subscription, unless connected; until the
  // next attempt is due, the error of the last one. An error, here and
  // below: the database is lost.
  absl::Status EnsureConnection();
  // Renews and takes partition leases, and reads the subscription's state.
  absl::Status Rebalance();
  // The dispatcher's repairs; the consumer's database identity for State().
  absl::Status WriteRepairs();
  // Everything in flight and answered is dropped (the outbox database
  // failed over: its rows may be other events now); a heal is requested.
  void DropEverything(const std::string& why);

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

  // Worker-thread state.
  std::unique_ptr<Connection> conn_;
  PartitionOwnership ownership_;
  // Gone, paused, on the log: read every rebalance round.
  SubscriptionWatch subscription_watch_;
  // --log_delivery did not move it onto the log (an operator moved it off
  // it), as last logged.
  bool log_refused_ = false;

  // The session's attempts, backing off after a failure.
  SessionAttempts attempts_;
  absl::Time next_rebalance_ = absl::InfinitePast();
  // Claims, reads, sends, answers and marks (after sink_, counters_ and
  // ownership_, which it uses).
  Dispatcher dispatcher_;

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
