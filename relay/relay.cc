#include "relay/relay.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <pqxx/pqxx>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/db.h"
#include "common/db_identity.h"
#include "common/ids.h"
#include "common/service.h"
#include "relay/consumer_link.h"

namespace outbox::relay {
Relay::Relay(RelayOptions options, Metrics* metrics, Watchdog* watchdog)
    : options_(std::move(options)),
      replica_id_([] {
        char host[256] = {0};
        gethostname(host, sizeof(host) - 1);
        return absl::StrCat(host, "/", getpid(), "/", NewUuid().substr(0, 8));
      }()),
      session_name_(absl::StrCat("outbox-relay ",
                                 replica_id_.substr(replica_id_.size() - 8))),
      watchdog_(watchdog),
      counters_(metrics),
      sink_(options_.sink != nullptr
                ? options_.sink
                : std::make_shared<ConsumerLink>(ConsumerLink::Options{
                      .target = options_.consumer,
                      .tls = options_.consumer_tls,
                      .retry_max = options_.retry_max,
                      .unready_after = options_.consumer_unready_after})),
      // Any session of this relay may be the first to see the outbox
      // database change (the worker's, the listener's, housekeeping's); the
      // worker acts on it.
      own_watch_(WatchDatabase("relay: the outbox database", "outbox", metrics,
                               [this](const IdentityChange& c) {
                                 {
                                   absl::MutexLock lock(&change_mu_);
                                   own_db_change_ = c.Describe();
                                 }
                                 own_db_changed_ = true;
                                 Wake();
                               })),
      session_(options_.session),
      ownership_(options_.subscription, replica_id_, options_.lease_ttl),
      subscription_watch_(options_.subscription, replica_id_),
      attempts_(Backoff(options_.retry_initial, options_.retry_max)),
      dispatcher_(options_, ownership_.member(), &counters_, sink_.get(),
                  [this](int64_t rows) { housekeeping_->Deleted(rows); }) {
  session_.identity_watch = own_watch_.get();
  housekeeping_ = std::make_unique<Housekeeping>(
      Housekeeping::Options{
          .db_url = options_.db_url,
          .subscription = options_.subscription,
          .session = session_,
          .retention = options_.retention,
          .retention_interval = options_.retention_interval,
          .backlog_refresh = options_.backlog_refresh,
          .owned = [this] { return State().partitions_owned; },
          .source = [this] { return source(); },
          .wake = [this] { Wake(); },
          .consumer = sink_->consumer(),
          .redelivered_heal = counters_.redelivered_heal,
          .diverged = counters_.diverged},
      metrics);
  AddStateGauges(metrics, [this] { return State(); });
  state_.replica_id = replica_id_;
}

Relay::~Relay() { Stop(absl::ZeroDuration()); }

void Relay::Start() {
  spdlog::info("relay {}: delivering to {}", replica_id_, sink_->name());
  // The consumer gets --consumer_unready_after from now to answer.
  sink_->Start();
  listener_ = std::make_unique<CommitListener>(CommitListener::Options{
      .url =
          options_.notify_url.empty() ? options_.db_url : options_.notify_url,
      .session = session_,
      .fast_poll_interval = options_.fast_poll_interval,
      .wake = [this] { Wake(); },
      .on_listening = options_.on_listening});
  worker_ = std::thread([this] { Run(); });
  housekeeping_->Start();
  listener_->Start();
}

std::optional<std::string> Relay::Unready() const {
  absl::MutexLock lock(&mu_);
  if (state_.consumer_unreachable.empty()) return std::nullopt;
  return state_.consumer_unreachable;
}

void Relay::Stop(absl::Duration drain) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    drain_deadline_ = absl::Now() + drain;
    woken_ = true;
  }
  if (worker_.joinable()) worker_.join();
  sink_->Stop();
  // A retention delete waiting on a lock, or a long vacuum, must not hold
  // up the shutdown.
  housekeeping_->Stop();
  if (listener_ != nullptr) listener_->Stop();
}

RelayState Relay::State() const {
  absl::MutexLock lock(&mu_);
  RelayState state = state_;
  state.delivered = counters_.delivered->value();
  state.rejected = counters_.rejected->value();
  return state;
}

void Relay::Wake() {
  absl::MutexLock lock(&mu_);
  woken_ = true;
}

std::string Relay::source() const {
  absl::MutexLock lock(&mu_);
  return state_.source;
}

absl::Status Relay::EnsureConnection() {
  if (conn_ != nullptr && conn_->is_open()) return absl::OkStatus();
  conn_.reset();
  absl::StatusOr<WorkerSession> opened = attempts_.Open(absl::Now(), [&] {
    return OpenWorkerSession(options_.db_url, session_name_, session_,
                             {.subscription = options_.subscription,
                              .source = options_.source,
                              .start_from = options_.start_from,
                              .resubscribe = options_.resubscribe,
                              .actor = replica_id_,
                              .stopping =
                                  [this] {
                                    absl::MutexLock lock(&mu_);
                                    return stopping_;
                                  }},
                             options_.log_delivery);
  });
  if (!opened.ok()) return opened.status();
  const TakenUp& up = opened->up;
  dispatcher_.TakeUp(up);
  {
    absl::MutexLock lock(&mu_);
    state_.source = dispatcher_.source();
  }
  if (options_.log_delivery && !up.start_tick.has_value() && !log_refused_) {
    spdlog::warn(
        "relay: subscription {} stays on delivery rows: an operator moved "
        "it off the outbox log, which --log_delivery does not undo "
        "(outboxctl subscriptions log {} moves it back)",
        options_.subscription, options_.subscription);
  }
  log_refused_ = options_.log_delivery && !up.start_tick.has_value();
  // The database's own record of its identity: a failover or restore while
  // this relay was down shows now.
  if (up.recorded.has_value()) own_watch_->ObserveRecorded(*up.recorded);
  conn_ = std::move(opened->conn);
  ownership_.Forget();
  next_rebalance_ = absl::InfinitePast();
  return absl::OkStatus();
}

absl::Status Relay::Rebalance() {
  try {
    auto tx = OpenUnit(*conn_);
    if (conn_->info().pooled) {
      // Behind a pooler a failover breaks no connection of ours: the
      // identity is read again each round.
      own_watch_->Observe(ReadIdentity(*tx));
    }
    const absl::StatusOr<SubscriptionState> sub = subscription_watch_.Read(*tx);
    if (!sub.ok()) return sub.status();
    // Another replica or an operator moved it onto the log or off it.
    dispatcher_.FollowLogMove(sub->on_log);
    std::set<int> in_flight;  // partitions with a batch out
    dispatcher_.lanes().PartitionsInFlight(&in_flight);
    dispatcher_.Forget(ownership_.Round(
        *tx, unlinked_, [&](int p) { return in_flight.count(p) > 0; }));
    tx->commit();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    const absl::Status s = StatusFromException(e);
    spdlog::warn("relay: rebalance: {}", std::string(s.message()));
    return s;
  }
}

absl::Status Relay::WriteRepairs() {
  std::optional<std::string> consumer_database;
  absl::Status s = dispatcher_.WriteRepairs(*conn_, &consumer_database);
  if (s.ok() && consumer_database.has_value()) {
    absl::MutexLock lock(&mu_);
    state_.consumer_database = *std::move(consumer_database);
  }
  return s;
}

void Relay::DropEverything(const std::string& why) {
  spdlog::error(
      "relay {}: {}: every delivery in flight and every answer not yet "
      "recorded is dropped (their rows stay pending and go again); a heal "
      "will compare the consumer with what the outbox now holds",
      replica_id_, why);
  dispatcher_.DropEverything(why);
  // Behind a pooler no new session took the identity up: recorded here,
  // the new one requests every subscription's heal
  // (outbox_identity_changed); this one's then says what this relay saw.
  if (absl::Status s = RecordIdentityAndRequestHeal(
          *conn_, own_watch_->current(), options_.subscription, why);
      !s.ok()) {
    // The next change of identity, or an operator's replay, heals then.
    spdlog::warn("relay: cannot request a heal: {}", std::string(s.message()));
  }
}

void Relay::FollowConsumer() {
  const bool unreachable = sink_->Unreachable().has_value();
  if (unreachable == unlinked_) return;
  unlinked_ = unreachable;
  next_rebalance_ = absl::InfinitePast();  // give up, or take a share
  if (!unlinked_) {
    spdlog::info(
        "relay {}: the consumer {} answers again: readiness SERVING; it "
        "takes a share of the partitions",
        replica_id_, sink_->name());
    return;
  }
  dispatcher_.DropStreams("the consumer does not answer");
  spdlog::error(
      "relay {}: the consumer {} has not answered for {}: readiness "
      "NOT_SERVING; its partitions go to replicas that reach it",
      replica_id_, sink_->name(),
      absl::FormatDuration(options_.consumer_unready_after));
}

absl::Duration Relay::NextWait(bool stopping) const {
  absl::Duration wait = options_.poll_interval;
  if (stopping) wait = absl::Milliseconds(20);
  if (!dispatcher_.lanes().connected() || conn_ == nullptr) {
    wait = std::min(wait, absl::Milliseconds(100));
  }
  if (!listener_->works()) {
    wait = std::min(wait, options_.fast_poll_interval);
  }
  return dispatcher_.Wait(wait);
}

void Relay::PublishState() {
  state_.partitions_owned.assign(ownership_.owned().begin(),
                                 ownership_.owned().end());
  state_.in_flight = dispatcher_.lanes().events_in_flight();
  state_.stream_connected = dispatcher_.lanes().connected();
  state_.paused_reason = subscription_watch_.paused();
  if (state_.paused_reason.empty()) {
    state_.paused_reason = dispatcher_.fence_waiting();
  }
  state_.consumer_unreachable.clear();
  if (std::optional<std::string> why;
      unlinked_ && (why = sink_->Unreachable()).has_value()) {
    state_.consumer_unreachable = absl::StrCat(
        *why, "; its partitions are left to replicas that reach it");
  }
}

void Relay::Finish() {
  if (const int64_t unanswered =
          dispatcher_.lanes().Close(absl::Milliseconds(500));
      unanswered > 0) {
    spdlog::warn("relay: {} events unanswered at shutdown stay pending",
                 unanswered);
  }
  if (conn_ != nullptr) {
    // A failure is logged; what it would have written is delivered again.
    if (dispatcher_.FlushMarks(*conn_).ok()) {
      dispatcher_.FlushLog(*conn_, true).IgnoreError();
    }
    // The others take the partitions over now, not when the leases would
    // expire.
    if (absl::Status s = ownership_.ReleaseAll(*conn_); !s.ok()) {
      spdlog::warn("relay: releasing its partitions: {}",
                   std::string(s.message()));
    }
  }
  conn_.reset();
  absl::MutexLock lock(&mu_);
  state_.partitions_owned.clear();
  state_.stream_connected = false;
}

void Relay::Run() {
  for (;;) {
    bool stopping;
    absl::Time deadline;
    {
      absl::MutexLock lock(&mu_);
      stopping = stopping_;
      deadline = drain_deadline_;
    }
    dispatcher_.TakeAnswers();
    // Not while stopping: the partitions go anyway, and the sink did not
    // come back.
    if (!stopping) FollowConsumer();
    // The stall clock runs while this pass talks to the database: a
    // statement that never returns (a hung server) shows as a stall.
    if (watchdog_ != nullptr && !stopping) watchdog_->Working();
    bool all_held = false;  // every serving lane waits for answers
    // The first step that failed this pass: the database is lost.
    absl::Status db = EnsureConnection();
    if (db.ok() && own_db_changed_.exchange(false)) {
      std::string why;
      {
        absl::MutexLock lock(&change_mu_);
        why = absl::StrCat("the outbox database ", own_db_change_);
      }
      DropEverything(why);
    }
    // Deliveries are written by the round's first claim, one statement
    // instead of two; before a rebalance (which gives up partitions only
    // once nothing of theirs is outstanding) and when stopping, on their
    // own, as are rejections. On the log, before the reads: an answered
    // event from the log is settled by its mark, and until it is, its
    // group of partitions can neither be split between the streams nor
    // read past its range (a claim of exceptions, which would carry the
    // marks, runs only now and then).
    const bool rebalance_due = absl::Now() >= next_rebalance_;
    if (db.ok() &&
        (stopping || rebalance_due || !dispatcher_.marks_ride_with_claim())) {
      db = dispatcher_.FlushMarks(*conn_);
    }
    if (db.ok()) db = dispatcher_.FlushLog(*conn_, stopping || rebalance_due);
    if (db.ok()) db = WriteRepairs();
    if (stopping) {
      if (dispatcher_.settled() || absl::Now() >= deadline) break;
    } else if (db.ok()) {
      if (rebalance_due) {
        db = Rebalance();
        next_rebalance_ = absl::Now() + options_.rebalance_interval;
      }
      if (!unlinked_) {
        dispatcher_.lanes().Open(
            *sink_, [this] { Wake(); }, absl::Now());
      }
      if (db.ok()) {
        db =
            dispatcher_.Round(*conn_, ownership_, *listener_,
                              !subscription_watch_.paused().empty(), &all_held);
      }
    }
    // New rows can go only after an answer, which wakes us anyway: a NOTIFY
    // meanwhile would only wake us for nothing, on the cores that the
    // consumer's transaction needs. One heard after the claims began and
    // before wakes were back on would be lost: it wakes us now.
    listener_->WantWakes(!all_held);
    if (!all_held && listener_->heard()) Wake();
    if (!db.ok() && conn_ != nullptr) {
      // Lost or broken. The leases stay ours until they expire; the next
      // session renews those still ours (Rebalance).
      conn_.reset();
      dispatcher_.Reset();
      ownership_.Forget();
    }
    if (watchdog_ != nullptr && !stopping) {
      if (!db.ok()) {
        watchdog_->Failed(db);
      } else {
        watchdog_->Done();
      }
    }
    const absl::Duration wait = NextWait(stopping);
    absl::MutexLock lock(&mu_);
    PublishState();
    mu_.AwaitWithTimeout(absl::Condition(&woken_), wait);
    woken_ = false;
  }
  Finish();
  spdlog::info("relay {}: stopped", replica_id_);
}

}  // namespace outbox::relay
