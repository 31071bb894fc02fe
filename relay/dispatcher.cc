#include "relay/dispatcher.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fault.h"
#include "common/limits.h"
#include "relay/claim.h"
#include "relay/marks.h"

namespace outbox::relay {
namespace {

// Logs that `step` failed with `status`, and returns it.
absl::Status Failed(absl::string_view step, absl::Status status) {
  spdlog::warn("relay: {}: {}", std::string(step),
               std::string(status.message()));
  return status;
}

}  // namespace

Dispatcher::Dispatcher(const RelayOptions& options, const std::string& member,
                       const RelayCounters* counters, Sink* sink,
                       std::function<void(int64_t rows)> deleted)
    : options_(options),
      member_(member),
      counters_(counters),
      sink_(sink),
      deleted_(std::move(deleted)),
      log_({.reader = {.subscription = options.subscription,
                       .member = member,
                       .payload_budget = kMaxDeliveryBatchBytes},
            .poll_interval = options.poll_interval,
            .fenced = options.fence.enabled()}),
      lanes_(options.lanes, Backoff(options.retry_initial, options.retry_max),
             {.batch_size = options.batch_size,
              .window = options.window,
              .pipeline_depth = options.pipeline_depth}),
      consumer_(options.subscription, counters),
      rows_(
          {.subscription = options.subscription,
           .member = member,
           .batch_size = options.batch_size,
           .poll_interval = options.poll_interval,
           .fenced = options.fence.enabled(),
           .claimed = [this](size_t rows,
                             absl::Duration took) { ObserveClaim(rows, took); },
           .settled = [this](const Settled& s) { Settle(s); }},
          &settlement_) {
  if (options.fence.enabled()) {
    fence_ = std::make_unique<ReplicationFence>(options.fence);
  }
}

void Dispatcher::TakeUp(const TakenUp& up) {
  chain_from_ = up.subscription.chain_from;
  if (source_ != up.subscription.source) {
    spdlog::info("relay: events carry source {}", up.subscription.source);
    source_ = up.subscription.source;
  }
  FollowLogMove(up.start_tick.has_value());
  consumer_.Stored(up.consumer);
  log_.Reset();  // positions are read again in this session
}

void Dispatcher::FollowLogMove(bool on_log) {
  if (on_log == on_log_) return;
  spdlog::info(
      "relay {}: subscription {} is {}delivered from the outbox log now",
      member_, options_.subscription, on_log ? "" : "not ");
  on_log_ = on_log;
  log_.Reset();
  log_.Owed();  // off the log, what it owed is rows; on it, exceptions
}

void Dispatcher::Reset() { log_.Reset(); }

void Dispatcher::Forget(const std::vector<int>& partitions) {
  log_.Forget(partitions);
}

void Dispatcher::DropEverything(const std::string& why) {
  DropStreams(why);
  lanes_.RestartClaims();
  settlement_.Clear();
  consumer_.DropLacking();
  log_.Reset();  // positions are read again
  log_.Owed();
}

void Dispatcher::DropStreams(const std::string& why) {
  for (Lane& lane : lanes_) {
    if (lane.has_stream()) DropStream(lane, why);
  }
}

void Dispatcher::TakeAnswers() {
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

absl::Status Dispatcher::Round(Connection& conn,
                               const PartitionOwnership& ownership,
                               CommitListener& listener, bool paused,
                               bool* all_held) {
  absl::Status db;
  // Paused: what is in flight is answered, nothing more is claimed.
  const std::vector<Lane*> serving =
      paused ? std::vector<Lane*>{} : lanes_.Serving();
  const int slots = static_cast<int>(serving.size());
  ClaimRound round;
  // The claims below see every row notified so far.
  const std::optional<absl::Time> heard = listener.TakeHeard();
  // On the log, the claims are of exceptions only (LogFeed::BeginRound).
  const bool claims = !on_log_ || log_.BeginRound(absl::Now(), heard);
  for (int i = 0; db.ok() && i < slots; ++i) {
    // A rebase this round dropped every stream: the rest of it waits.
    if (!serving[i]->connected()) continue;
    std::vector<int> partitions = ownership.ForSlot(i, slots);
    if (partitions.empty()) continue;
    if (claims) db = Claim(conn, *serving[i], partitions, &round);
    if (db.ok() && on_log_) {
      db = SendFromLog(conn, listener, *serving[i], partitions, &round);
    }
  }
  if (on_log_ && db.ok()) log_.EndRound();
  if (db.ok()) db = FlushMarks(conn);  // no claim ran to write them
  if (db.ok()) db = ReleaseFenced(conn);
  const bool spread_changed = lanes_.EndRound(round.ran, round.full);
  // After the claims: a lane that has just sent its batch waits for its
  // answer as much as one that could not claim at all. (Lanes that
  // begin or stop serving next time claim then.)
  *all_held = db.ok() && !spread_changed && lanes_.AllWait(serving);
  return db;
}

absl::Status Dispatcher::Claim(Connection& conn, Lane& lane,
                               std::vector<int> partitions, ClaimRound* round) {
  const absl::Status s = rows_.Round(
      conn,
      {.partitions = std::move(partitions),
       .cursor = &lane.cursor,
       .in_flight = lanes_.events_in_flight(),
       .limit = [&] { return lanes_.Limit(lane); },
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

absl::Status Dispatcher::SendFromLog(Connection& conn, CommitListener& listener,
                                     Lane& lane,
                                     const std::vector<int>& partitions,
                                     ClaimRound* round) {
  const int limit = lanes_.Limit(lane);
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
  absl::StatusOr<LogSend> read = log_.Read(
      conn, partitions, limit, listener.hearing() && listener.wants_wakes());
  if (!read.ok() && SqlStateOf(read.status()) == "55000") {
    // The database's transaction ids went back (a dump restored into
    // another cluster): nothing the log read may be trusted until it is
    // rebased.
    return Rebase(conn);
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

void Dispatcher::ObserveClaim(size_t rows, absl::Duration took) {
  counters_->claim_seconds->Observe(absl::ToDoubleSeconds(took));
  if (options_.after_claim) options_.after_claim(rows);
  if (spdlog::should_log(spdlog::level::debug)) {
    spdlog::debug("relay: claimed {} rows in {}", rows,
                  absl::FormatDuration(took));
  }
}

void Dispatcher::Send(Lane& lane, BuiltBatch& built, bool full,
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
  counters_->batch_events->Observe(static_cast<double>(req.events_size()));
  batch.inbox_high_at_send = consumer_.inbox_high();
  if (fence_ != nullptr) {
    // Every event read had committed before this position: the batch goes
    // once the standbys flushed it (ReleaseFenced).
    lane.Send(std::move(batch), std::move(req), ParseLsn(lsn).value_or(~0ull),
              absl::Now());
  } else {
    lane.Send(std::move(batch), std::move(req), std::nullopt, absl::Now());
    counters_->batches->Add();
  }
}

absl::Status Dispatcher::FlushLog(Connection& conn, bool now) {
  if (!log_.FlushDue(absl::Now(), now)) return absl::OkStatus();
  // The positions are the log's marks: answered, not yet recorded (a crash
  // means those events are read and sent again).
  MaybeCrash("relay.before_mark_commit");
  absl::StatusOr<std::vector<int>> lost = log_.Flush(conn);
  if (lost.ok()) MaybeCrash("relay.after_mark_commit");
  if (!lost.ok()) return Failed("storing log positions", lost.status());
  for (int p : *lost) {
    spdlog::warn(
        "relay {}: the log position of partition {} was not as this relay "
        "left it (its lease was taken over, or the subscription left the "
        "log); it stops reading it",
        member_, p);
  }
  return absl::OkStatus();
}

absl::Status Dispatcher::Rebase(Connection& conn) {
  if (absl::Status s = log_.Rebase(conn); !s.ok()) {
    return Failed("rebasing the outbox log", s);
  }
  DropStreams("the outbox log was rebased");
  return absl::OkStatus();
}

void Dispatcher::HandleResponses(Lane& lane) {
  while (std::optional<Lane::Answered> answered = lane.NextAnswer()) {
    sink_->Answered();
    const v1::DeliverResponse& resp = answered->response;
    if (!answered->batch.has_value()) {
      spdlog::warn("relay: answer for unknown batch {}", resp.batch_id());
      continue;
    }
    const InFlight& batch = *answered->batch;
    counters_->answer_seconds->Observe(
        absl::ToDoubleSeconds(absl::Now() - batch.sent_at));
    if (consumer_.Observe(resp, batch.inbox_high_at_send)) {
      lanes_.ForgetInboxHigh();
    }
    Answer answer = AnswerOf(batch, resp);
    consumer_.Lacks(answer.reowe);
    settlement_.Answered(std::move(answer));
  }
}

absl::Status Dispatcher::FlushMarks(Connection& conn) {
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
      StoreMarks(conn, options_.subscription, marks, plan,
                 {.max_attempts = options_.max_attempts,
                  .backoff = options_.reject_backoff,
                  .backoff_max = options_.reject_backoff_max});
  if (!written.ok()) {
    return Failed(absl::StrCat("marking ", marks.size(), " rows"),
                  written.status());
  }
  counters_->mark_seconds->Observe(absl::ToDoubleSeconds(absl::Now() - t0));
  Settle(settlement_.Written(*written));
  return absl::OkStatus();
}

void Dispatcher::Settle(const Settled& settled) {
  for (int64_t seq : settled.from_log) log_.Settle(seq);
  counters_->delivered->Add(settled.tally.delivered);
  deleted_(settled.tally.rows_deleted);
  counters_->rejected->Add(settled.tally.rejected);
  counters_->dead->Add(settled.written.dead);
  counters_->diverged->Add(settled.written.diverged);
}

absl::Status Dispatcher::WriteRepairs(
    Connection& conn, std::optional<std::string>* consumer_database) {
  absl::StatusOr<ConsumerWatch::Recorded> recorded = consumer_.Record(conn);
  if (!recorded.ok()) {
    return Failed("recording what the consumer's answers showed",
                  recorded.status());
  }
  if (recorded->owed) log_.Owed();
  *consumer_database = recorded->consumer_database;
  return absl::OkStatus();
}

absl::Status Dispatcher::ReleaseFenced(Connection& conn) {
  if (fence_ == nullptr) return absl::OkStatus();
  FenceState state;
  if (lanes_.holding()) {
    absl::StatusOr<FenceState> read = fence_->Read(conn);
    if (!read.ok()) return read.status();
    state = *std::move(read);
    if (state.why_waiting.empty()) {
      counters_->batches->Add(lanes_.Release(state.flushed, absl::Now()));
    }
  }
  if (fence_->Note(state, lanes_.holding(), absl::Now())) {
    spdlog::warn("relay: delivery paused: {}", fence_->waiting());
  }
  return absl::OkStatus();
}

void Dispatcher::DropStream(Lane& lane, const std::string& why) {
  HandleResponses(lane);  // what was answered before the break still counts
  if (!lane.idle()) {
    spdlog::warn(
        "relay: delivery stream {} lost ({}); {} events in flight stay "
        "pending and will be resent",
        lane.index(), why, lane.events_in_flight());
  } else {
    spdlog::info("relay: delivery stream {} closed ({})", lane.index(), why);
  }
  counters_->stream_failures->Add();
  // Their answers will not come: the log reads them again (what other
  // lanes have in flight too, answered DUPLICATE the second time).
  if (lane.any_from_log()) log_.Rewind();
  for (const InFlight& batch : lane.Drop(absl::Now())) {
    settlement_.Dropped(batch);
  }
}

absl::Duration Dispatcher::Wait(absl::Duration wait) const {
  // Standbys flush within milliseconds; a held batch is looked at often.
  if (lanes_.holding()) wait = std::min(wait, absl::Milliseconds(2));
  // A tick refused as too early is asked for again when it is due.
  if (on_log_) wait = std::min(wait, log_.RetryWait(absl::Now()));
  return wait;
}

std::string Dispatcher::fence_waiting() const {
  return fence_ == nullptr ? std::string() : fence_->waiting();
}

}  // namespace outbox::relay
