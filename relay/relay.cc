#include "relay/relay.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <pqxx/pqxx>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/db.h"
#include "common/db_identity.h"
#include "common/fault.h"
#include "common/ids.h"
#include "common/limits.h"
#include "common/schema.h"
#include "common/service.h"

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
      log_({.reader = {.subscription = options_.subscription,
                       .member = ownership_.member(),
                       .payload_budget = kMaxDeliveryBatchBytes},
            .poll_interval = options_.poll_interval,
            .fenced = options_.fence.enabled()}),
      attempts_(Backoff(options_.retry_initial, options_.retry_max)),
      consumer_(options_.subscription, &counters_),
      rows_(
          {.subscription = options_.subscription,
           .member = ownership_.member(),
           .batch_size = options_.batch_size,
           .poll_interval = options_.poll_interval,
           .fenced = options_.fence.enabled(),
           .claimed = [this](size_t rows,
                             absl::Duration took) { ObserveClaim(rows, took); },
           .settled = [this](const Settled& s) { Settle(s); }},
          &settlement_) {
  session_.identity_watch = own_watch_.get();
  if (options_.fence.enabled()) {
    fence_ = std::make_unique<ReplicationFence>(options_.fence);
  }
  const int lanes = std::max(1, options_.lanes);
  lanes_.reserve(lanes);
  for (int i = 0; i < lanes; ++i) {
    lanes_.emplace_back(i, Backoff(options_.retry_initial, options_.retry_max));
  }
  if (options_.sink != nullptr) {
    sink_ = options_.sink;
  } else {
    sink_ = std::make_shared<ConsumerLink>(ConsumerLink::Options{
        .target = options_.consumer,
        .tls = options_.consumer_tls,
        .retry_max = options_.retry_max,
        .unready_after = options_.consumer_unready_after});
  }
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
  subscription_id_ = up.subscription.id;
  chain_from_ = up.subscription.chain_from;
  if (source_ != up.subscription.source) {
    spdlog::info("relay: events carry source {}", up.subscription.source);
    source_ = up.subscription.source;
    absl::MutexLock lock(&mu_);
    state_.source = source_;
  }
  if (options_.log_delivery && !up.start_tick.has_value() && !log_refused_) {
    spdlog::warn(
        "relay: subscription {} stays on delivery rows: an operator moved "
        "it off the outbox log, which --log_delivery does not undo "
        "(outboxctl subscriptions log {} moves it back)",
        options_.subscription, options_.subscription);
  }
  log_refused_ = options_.log_delivery && !up.start_tick.has_value();
  FollowLogMove(up.start_tick.has_value());
  // The database's own record of its identity: a failover or restore while
  // this relay was down shows now.
  if (up.recorded.has_value()) own_watch_->ObserveRecorded(*up.recorded);
  consumer_.Stored(up.consumer);
  conn_ = std::move(opened->conn);
  log_.Reset();  // positions are read again in this session
  ownership_.Forget();
  next_rebalance_ = absl::InfinitePast();
  return absl::OkStatus();
}

absl::Status Relay::Failed(absl::string_view step, absl::Status status) {
  spdlog::warn("relay: {}: {}", std::string(step),
               std::string(status.message()));
  return status;
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
    FollowLogMove(sub->on_log);
    std::set<int> in_flight;  // partitions with a batch out
    for (const Lane& lane : lanes_) lane.PartitionsInFlight(&in_flight);
    log_.Forget(ownership_.Round(
        *tx, unlinked_, [&](int p) { return in_flight.count(p) > 0; }));
    tx->commit();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return Failed("rebalance", StatusFromException(e));
  }
}

std::vector<Lane*> Relay::ServingLanes() {
  std::vector<Lane*> open;
  std::vector<int> indexes;
  for (Lane& lane : lanes_) {
    if (!lane.connected()) continue;
    if (!spread_ && !serving_.empty() && lane.index() == serving_.front()) {
      // A light load stays on the lane that carries it while that lane is
      // connected: one that connects later (or again) does not send a
      // second batch beside the one awaiting its answer.
      open.assign(1, &lane);
      indexes.assign(1, lane.index());
      break;
    }
    if (!spread_ && !open.empty()) continue;
    open.push_back(&lane);
    indexes.push_back(lane.index());
  }
  if (indexes != serving_) {
    // Partitions moved between lanes: each lane's sent_through says nothing
    // about its new ones, so its next claim starts from the start.
    for (Lane& lane : lanes_)
      lane.cursor.next_full_claim = absl::InfinitePast();
    serving_ = std::move(indexes);
  }
  return open;
}

absl::Status Relay::Claim(Lane& lane, int slot, int slots, ClaimRound* round) {
  std::vector<int> partitions = ownership_.ForSlot(slot, slots);
  if (partitions.empty()) return absl::OkStatus();
  const absl::Status s = rows_.Round(
      *conn_,
      {.partitions = std::move(partitions),
       .cursor = &lane.cursor,
       .in_flight = InFlightEvents(),
       .limit = [&] { return LaneLimit(lane); },
       .send =
           [&](Claimed claimed, int limit) {
             const size_t rows = claimed.candidates.size();
             // A chain goes when its first row here is its first
             // undelivered event; then all its rows here go, in chain
             // order.
             BuiltBatch built =
                 BuildBatch(std::move(claimed.candidates),
                            {.batch_id = next_batch_id_++,
                             .source = source_,
                             .chain_from = chain_from_,
                             .max_bytes = kMaxDeliveryBatchBytes});
             const bool cut = built.cut_by_bytes;
             Send(lane, built, cut || static_cast<int>(rows) >= limit,
                  claimed.lsn, round);
             return cut;
           }},
      &round->ran);
  return s.ok() ? s : Failed("claim", s);
}

absl::Status Relay::SendFromLog(Lane& lane, int slot, int slots,
                                ClaimRound* round) {
  const std::vector<int> partitions = ownership_.ForSlot(slot, slots);
  if (partitions.empty()) return absl::OkStatus();
  const int limit = LaneLimit(lane);
  if (limit == 0) {
    log_.Skipped();
    return absl::OkStatus();
  }
  round->ran = true;
  const absl::Time t0 = absl::Now();
  // A new tick only when events may have committed since the one it has:
  // a NOTIFY says so, unless none can be heard, or the streams' credit
  // was spent (a NOTIFY may then lag the commits it announces by a busy
  // machine's scheduling delay, and every answer finds new events).
  absl::StatusOr<LogSend> read =
      log_.Read(*conn_, partitions, limit,
                listener_->hearing() && listener_->wants_wakes());
  if (!read.ok() && SqlStateOf(read.status()) == "55000") {
    // The database's transaction ids went back (a dump restored into
    // another cluster): nothing the log read may be trusted until it is
    // rebased.
    return Rebase();
  }
  if (IsNotOnLog(read.status())) {
    // An operator moved it off the log since the last rebalance round:
    // its rows are claimed from now on.
    FollowLogMove(false);
    return absl::OkStatus();
  }
  if (!read.ok()) return Failed("reading the outbox log", read.status());
  ObserveClaim(read->events.size(), absl::Now() - t0);
  if (read->diverted > 0) {
    spdlog::debug("relay: {} events of chains with exceptions join them",
                  read->diverted);
  }
  if (read->events.empty()) return absl::OkStatus();
  // Chains this batch must not send: one of their events is unanswered
  // in an earlier batch (or a claim of their exceptions), or one here
  // cannot be sent. Their events become exceptions, delivered in chain
  // order once the one before is answered, so that a rejected event's
  // successors wait at the relay, never at the consumer (I6).
  std::vector<Candidate> candidates;
  candidates.reserve(read->events.size());
  for (LogEvent& e : read->events) {
    candidates.push_back({.event = std::move(e.event),
                          .parsed = e.payload_ok,
                          .partition = e.partition});
  }
  BuiltBatch built = BuildBatch(std::move(candidates),
                                {.batch_id = next_batch_id_++,
                                 .from_log = true,
                                 .source = source_,
                                 .chain_from = chain_from_,
                                 .busy = [this](const std::string& chain) {
                                   return settlement_.busy().busy(chain);
                                 }});
  Send(lane, built, read->more, read->lsn, round);
  return absl::OkStatus();
}

void Relay::ObserveClaim(size_t rows, absl::Duration took) {
  counters_.claim_seconds->Observe(absl::ToDoubleSeconds(took));
  if (options_.after_claim) options_.after_claim(rows);
  if (spdlog::should_log(spdlog::level::debug)) {
    spdlog::debug("relay: claimed {} rows in {}", rows,
                  absl::FormatDuration(took));
  }
}

void Relay::Send(Lane& lane, BuiltBatch& built, bool full,
                 const std::string& lsn, ClaimRound* round) {
  // What it set aside (exceptions, chains that wait) counts even when
  // nothing of it goes.
  settlement_.Sent(built);
  if (!built.batch.from_log) {
    lane.cursor.sent_through =
        std::max(lane.cursor.sent_through, built.sent_through);
  }
  if (built.batch.seqs.empty()) return;
  MaybeCrash("relay.after_claim_before_send");
  InFlight batch = std::move(built.batch);
  v1::DeliverRequest req = std::move(built.request);
  batch.full = full;
  round->full |= full;
  counters_.batch_events->Observe(static_cast<double>(req.events_size()));
  batch.inbox_high_at_send = consumer_.inbox_high();
  if (fence_ != nullptr) {
    // Every event read had committed before this position: the batch goes
    // once the standbys flushed it (ReleaseFenced).
    lane.Send(std::move(batch), std::move(req), ParseLsn(lsn).value_or(~0ull),
              absl::Now());
  } else {
    lane.Send(std::move(batch), std::move(req), std::nullopt, absl::Now());
    counters_.batches->Add();
  }
}

absl::Status Relay::FlushLog(bool now) {
  if (!log_.FlushDue(absl::Now(), now)) return absl::OkStatus();
  // The positions are the log's marks: answered, not yet recorded (a crash
  // means those events are read and sent again).
  MaybeCrash("relay.before_mark_commit");
  absl::StatusOr<std::vector<int>> lost = log_.Flush(*conn_);
  if (lost.ok()) MaybeCrash("relay.after_mark_commit");
  if (!lost.ok()) return Failed("storing log positions", lost.status());
  for (int p : *lost) {
    spdlog::warn(
        "relay {}: the log position of partition {} was not as this relay "
        "left it (its lease was taken over, or the subscription left the "
        "log); it stops reading it",
        replica_id_, p);
  }
  return absl::OkStatus();
}

void Relay::FollowLogMove(bool on_log) {
  if (on_log == on_log_) return;
  spdlog::info(
      "relay {}: subscription {} is {}delivered from the outbox log now",
      replica_id_, options_.subscription, on_log ? "" : "not ");
  on_log_ = on_log;
  log_.Reset();
  log_.Owed();  // off the log, what it owed is rows; on it, exceptions
}

absl::Status Relay::Rebase() {
  if (absl::Status s = log_.Rebase(*conn_); !s.ok()) {
    return Failed("rebasing the outbox log", s);
  }
  for (Lane& lane : lanes_) {
    if (lane.has_stream()) DropStream(lane, "the outbox log was rebased");
  }
  return absl::OkStatus();
}

int Relay::LaneLimit(const Lane& lane) const {
  return lane.Limit(options_.batch_size, options_.window,
                    options_.pipeline_depth);
}

void Relay::HandleResponses(Lane& lane) {
  while (std::optional<Lane::Answered> answered = lane.NextAnswer()) {
    sink_->Answered();
    const v1::DeliverResponse& resp = answered->response;
    if (!answered->batch.has_value()) {
      spdlog::warn("relay: answer for unknown batch {}", resp.batch_id());
      continue;
    }
    const InFlight& batch = *answered->batch;
    counters_.answer_seconds->Observe(
        absl::ToDoubleSeconds(absl::Now() - batch.sent_at));
    if (consumer_.Observe(resp, batch.inbox_high_at_send)) {
      for (Lane& l : lanes_) {
        for (auto& [id, b] : l.batches()) b.inbox_high_at_send = 0;
      }
    }
    Answer answer = AnswerOf(batch, resp);
    consumer_.Lacks(answer.reowe);
    settlement_.Answered(std::move(answer));
  }
}

int64_t Relay::InFlightEvents() const {
  int64_t n = 0;
  for (const Lane& lane : lanes_) n += lane.events_in_flight();
  return n;
}

absl::Status Relay::FlushMarks() {
  const std::vector<Mark>& marks = settlement_.marks();
  if (marks.empty()) return absl::OkStatus();
  // Answered by the consumer, not yet marked: redelivery must follow.
  MaybeCrash("relay.after_send_before_mark");
  const MarkPlan plan = PlanMarks(marks);
  if (plan.nothing()) {
    Settle(settlement_.Written({}));  // from the log only: nothing to write
    return absl::OkStatus();
  }
  if (!plan.owed.empty()) log_.Owed();
  const absl::Time t0 = absl::Now();
  const absl::StatusOr<WrittenMarks> written =
      StoreMarks(*conn_, options_.subscription, marks, plan,
                 {.max_attempts = options_.max_attempts,
                  .backoff = options_.reject_backoff,
                  .backoff_max = options_.reject_backoff_max});
  if (!written.ok()) {
    return Failed(absl::StrCat("marking ", marks.size(), " rows"),
                  written.status());
  }
  counters_.mark_seconds->Observe(absl::ToDoubleSeconds(absl::Now() - t0));
  Settle(settlement_.Written(*written));
  return absl::OkStatus();
}

void Relay::Settle(const Settled& settled) {
  for (int64_t seq : settled.from_log) log_.Settle(seq);
  counters_.delivered->Add(settled.tally.delivered);
  housekeeping_->Deleted(settled.tally.rows_deleted);
  counters_.rejected->Add(settled.tally.rejected);
  counters_.dead->Add(settled.written.dead);
  counters_.diverged->Add(settled.written.diverged);
}

absl::Status Relay::WriteRepairs() {
  absl::StatusOr<ConsumerWatch::Recorded> recorded = consumer_.Record(*conn_);
  if (!recorded.ok()) {
    return Failed("recording what the consumer's answers showed",
                  recorded.status());
  }
  if (recorded->owed) log_.Owed();
  if (recorded->consumer_database.has_value()) {
    absl::MutexLock lock(&mu_);
    state_.consumer_database = *recorded->consumer_database;
  }
  return absl::OkStatus();
}

void Relay::DropEverything(const std::string& why) {
  spdlog::error(
      "relay {}: {}: every delivery in flight and every answer not yet "
      "recorded is dropped (their rows stay pending and go again); a heal "
      "will compare the consumer with what the outbox now holds",
      replica_id_, why);
  for (Lane& lane : lanes_) {
    if (lane.has_stream()) DropStream(lane, why);
    lane.cursor.sent_through = 0;
    lane.cursor.next_full_claim = absl::InfinitePast();
  }
  settlement_.Clear();
  consumer_.DropLacking();
  log_.Reset();  // positions are read again
  log_.Owed();
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

absl::Status Relay::ReleaseFenced() {
  if (fence_ == nullptr) return absl::OkStatus();
  FenceState state;
  if (AnyHeld()) {
    absl::StatusOr<FenceState> read = fence_->Read(*conn_);
    if (!read.ok()) return read.status();
    state = *std::move(read);
    if (state.why_waiting.empty()) {
      for (Lane& lane : lanes_) {
        counters_.batches->Add(lane.Release(state.flushed, absl::Now()));
      }
    }
  }
  if (fence_->Note(state, AnyHeld(), absl::Now())) {
    spdlog::warn("relay: delivery paused: {}", fence_->waiting());
  }
  return absl::OkStatus();
}

bool Relay::AnyHeld() const {
  return std::any_of(lanes_.begin(), lanes_.end(),
                     [](const Lane& lane) { return lane.holding(); });
}

void Relay::DropStream(Lane& lane, const std::string& why) {
  HandleResponses(lane);  // what was answered before the break still counts
  if (!lane.idle()) {
    spdlog::warn(
        "relay: delivery stream {} lost ({}); {} events in flight stay "
        "pending and will be resent",
        lane.index(), why, lane.events_in_flight());
  } else {
    spdlog::info("relay: delivery stream {} closed ({})", lane.index(), why);
  }
  counters_.stream_failures->Add();
  // Their answers will not come: the log reads them again (what other
  // lanes have in flight too, answered DUPLICATE the second time).
  if (lane.any_from_log()) log_.Rewind();
  for (const InFlight& batch : lane.Drop(absl::Now())) {
    settlement_.Dropped(batch);
  }
}

void Relay::TakeAnswers() {
  for (Lane& lane : lanes_) {
    HandleResponses(lane);
    if (lane.has_stream() && !lane.connected()) {
      DropStream(lane, lane.broken());
    }
    if (lane.has_stream() && lane.Overdue(absl::Now(), options_.ack_timeout)) {
      DropStream(lane, "no answer within --ack_timeout");
    }
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
  for (Lane& lane : lanes_) {
    if (lane.has_stream()) DropStream(lane, "the consumer does not answer");
  }
  spdlog::error(
      "relay {}: the consumer {} has not answered for {}: readiness "
      "NOT_SERVING; its partitions go to replicas that reach it",
      replica_id_, sink_->name(),
      absl::FormatDuration(options_.consumer_unready_after));
}

bool Relay::AllConnected() const {
  return std::all_of(lanes_.begin(), lanes_.end(),
                     [](const Lane& lane) { return lane.connected(); });
}

absl::Duration Relay::NextWait(bool stopping) const {
  absl::Duration wait = options_.poll_interval;
  if (stopping) wait = absl::Milliseconds(20);
  if (!AllConnected() || conn_ == nullptr) {
    wait = std::min(wait, absl::Milliseconds(100));
  }
  if (!listener_->works()) {
    wait = std::min(wait, options_.fast_poll_interval);
  }
  // Standbys flush within milliseconds; a held batch is looked at often.
  if (AnyHeld()) wait = std::min(wait, absl::Milliseconds(2));
  // A tick refused as too early is asked for again when it is due.
  if (on_log_) wait = std::min(wait, log_.RetryWait(absl::Now()));
  return wait;
}

void Relay::PublishState() {
  state_.partitions_owned.assign(ownership_.owned().begin(),
                                 ownership_.owned().end());
  state_.in_flight = InFlightEvents();
  state_.stream_connected = AllConnected();
  state_.paused_reason = subscription_watch_.paused();
  if (state_.paused_reason.empty() && fence_ != nullptr) {
    state_.paused_reason = fence_->waiting();
  }
  state_.consumer_unreachable.clear();
  if (std::optional<std::string> why;
      unlinked_ && (why = sink_->Unreachable()).has_value()) {
    state_.consumer_unreachable = absl::StrCat(
        *why, "; its partitions are left to replicas that reach it");
  }
}

void Relay::Finish() {
  for (Lane& lane : lanes_) {
    if (lane.has_stream() && !lane.idle()) {
      spdlog::warn("relay: {} events unanswered at shutdown stay pending",
                   lane.events_in_flight());
    }
    lane.Close(absl::Milliseconds(500));
  }
  if (conn_ != nullptr) {
    // A failure is logged; what it would have written is delivered again.
    if (FlushMarks().ok()) FlushLog(true).IgnoreError();
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

absl::Status Relay::DeliverRound(bool* all_held) {
  absl::Status db;
  // Paused: what is in flight is answered, nothing more is claimed.
  const std::vector<Lane*> serving = subscription_watch_.paused().empty()
                                         ? ServingLanes()
                                         : std::vector<Lane*>{};
  ClaimRound round;
  // The claims below see every row notified so far.
  const std::optional<absl::Time> heard = listener_->TakeHeard();
  // On the log, the claims are of exceptions only (LogFeed::BeginRound).
  const bool claims = !on_log_ || log_.BeginRound(absl::Now(), heard);
  for (size_t i = 0; db.ok() && i < serving.size(); ++i) {
    // A rebase this round dropped every stream: the rest of it waits.
    if (!serving[i]->connected()) continue;
    if (claims) {
      db = Claim(*serving[i], static_cast<int>(i),
                 static_cast<int>(serving.size()), &round);
    }
    if (db.ok() && on_log_) {
      db = SendFromLog(*serving[i], static_cast<int>(i),
                       static_cast<int>(serving.size()), &round);
    }
  }
  if (on_log_ && db.ok()) log_.EndRound();
  if (db.ok()) db = FlushMarks();  // no claim ran to write them
  if (db.ok()) db = ReleaseFenced();
  const bool spread_before = spread_;
  if (round.full) {
    spread_ = true;
  } else if (round.ran) {
    // Worked off once no claim fills a batch and no full one is out.
    spread_ = false;
    for (const Lane& lane : lanes_) spread_ |= lane.any_full();
  }
  // After the claims: a lane that has just sent its batch waits for its
  // answer as much as one that could not claim at all. (Lanes that
  // begin or stop serving next time claim then.)
  *all_held = db.ok() && !serving.empty() && spread_ == spread_before &&
              std::all_of(serving.begin(), serving.end(),
                          [&](const Lane* l) { return LaneLimit(*l) == 0; });
  return db;
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
    TakeAnswers();
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
    if (db.ok() && (stopping || rebalance_due || !settlement_.RideWithClaim() ||
                    on_log_)) {
      db = FlushMarks();
    }
    if (db.ok()) db = FlushLog(stopping || rebalance_due);
    if (db.ok()) db = WriteRepairs();
    if (stopping) {
      if ((InFlightEvents() == 0 && settlement_.settled()) ||
          absl::Now() >= deadline) {
        break;
      }
    } else if (db.ok()) {
      if (rebalance_due) {
        db = Rebalance();
        next_rebalance_ = absl::Now() + options_.rebalance_interval;
      }
      if (!unlinked_) {
        for (Lane& lane : lanes_) {
          lane.Open(
              *sink_, [this] { Wake(); }, absl::Now());
        }
      }
      if (db.ok()) db = DeliverRound(&all_held);
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
      log_.Reset();
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
