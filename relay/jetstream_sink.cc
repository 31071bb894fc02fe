#include "relay/jetstream_sink.h"

#include <algorithm>
#include <deque>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/jetstream_subject.h"
#include "relay/policy.h"
#include "spdlog/spdlog.h"

namespace outbox::relay {
namespace {

constexpr char kSeqHeader[] = "Outbox-Seq";
constexpr char kPrevSeqHeader[] = "Outbox-Prev-Seq";
constexpr char kPrevStreamSeqHeader[] = "Outbox-Prev-Stream-Seq";
constexpr char kMsgIdHeader[] = "Nats-Msg-Id";
constexpr char kContentType[] =
    "application/protobuf; messageType=outbox.v1.Event";
// Tips remembered per stream before the memory starts afresh.
constexpr size_t kMaxTips = 200000;

Placement Diverged(std::string reason) {
  return {.kind = Placement::kDiverged, .reason = std::move(reason)};
}

// What the stream's threads and its owner share: the owner may go (Cancel,
// destruction) while a publish still waits on the broker, so the thread
// holds this, and the wake callback is dropped before the owner goes.
struct Shared {
  absl::Mutex mu;
  absl::CondVar cv;
  std::deque<v1::DeliverRequest> queue ABSL_GUARDED_BY(mu);
  std::vector<v1::DeliverResponse> responses ABSL_GUARDED_BY(mu);
  bool close_send ABSL_GUARDED_BY(mu) = false;
  std::string error ABSL_GUARDED_BY(mu);
  std::atomic<bool> broken{false};
  absl::Mutex wake_mu;
  std::function<void()> wake ABSL_GUARDED_BY(wake_mu);

  void Wake() {
    absl::MutexLock lock(&wake_mu);
    if (wake) wake();
  }
  void Break(const std::string& why) {
    {
      absl::MutexLock lock(&mu);
      if (error.empty()) error = why;
      broken = true;
      cv.SignalAll();
    }
    Wake();
  }
};

// Publishes the batches of one stream, in order, on a thread of its own.
class Publisher {
 public:
  Publisher(std::shared_ptr<jetstream::Connection> conn,
            const JetStreamSinkOptions& options, std::shared_ptr<Shared> shared,
            std::shared_ptr<UntakenPublishes> untaken)
      : conn_(std::move(conn)),
        options_(options),
        shared_(std::move(shared)),
        untaken_(std::move(untaken)) {}

  void Run() {
    for (;;) {
      v1::DeliverRequest request;
      bool all_answered = false;  // close_send with nothing left
      {
        absl::MutexLock lock(&shared_->mu);
        while (!shared_->broken && shared_->queue.empty() &&
               !shared_->close_send) {
          shared_->cv.Wait(&shared_->mu);
        }
        if (shared_->broken) return;
        if (shared_->queue.empty()) {
          all_answered = true;
        } else {
          request = std::move(shared_->queue.front());
          shared_->queue.pop_front();
        }
      }
      if (all_answered) {
        shared_->Break("closed after its batches were answered");
        return;
      }
      absl::StatusOr<v1::DeliverResponse> response = PublishBatch(request);
      if (!response.ok()) {
        shared_->Break(std::string(response.status().message()));
        return;
      }
      {
        absl::MutexLock lock(&shared_->mu);
        if (shared_->broken) return;
        shared_->responses.push_back(*std::move(response));
      }
      shared_->Wake();
    }
  }

 private:
  // Every event answered, or the world's fault (nothing answered). The
  // batch goes in rounds: each round publishes the next event of every
  // aggregate at once (one round trip for their acks), since an event's
  // expectation is its predecessor's stream sequence, known once that one
  // is acknowledged.
  absl::StatusOr<v1::DeliverResponse> PublishBatch(
      const v1::DeliverRequest& request) {
    const int n = request.events_size();
    v1::DeliverResponse response;
    response.set_batch_id(request.batch_id());
    std::vector<std::string> subjects(n);
    // Each aggregate's events, in batch order, not yet answered.
    absl::flat_hash_map<std::string, std::deque<int>> open;
    std::vector<std::string> order;  // aggregates, first seen first
    for (int i = 0; i < n; ++i) {
      const v1::Event& e = request.events(i);
      v1::EventResult* r = response.add_results();
      r->set_event_id(e.event_id());
      r->set_seq(e.seq());
      absl::StatusOr<std::string> subject = jetstream::EventSubject(
          options_.subject_prefix, e.aggregate_type(), e.aggregate_id());
      if (!subject.ok()) return subject.status();  // checked by Create
      subjects[i] = *subject;
      auto [it, fresh] = open.try_emplace(*subject);
      if (fresh) order.push_back(*subject);
      it->second.push_back(i);
    }
    std::vector<int> refusals(n, 0);
    // An event not published: the events behind it wait (DEFERRED), as
    // sink.proto asks.
    auto stop = [&](const std::string& subject) {
      std::deque<int>& q = open[subject];
      const int64_t at = request.events(q.front()).seq();
      q.pop_front();
      for (int j : q) {
        v1::EventResult* r = response.mutable_results(j);
        r->set_outcome(v1::DEFERRED);
        r->set_reason(absl::StrCat("behind seq ", at,
                                   " of its aggregate, not published"));
      }
      q.clear();
    };
    for (;;) {
      if (shared_->broken) return absl::CancelledError("cancelled");
      std::vector<int> round;
      std::vector<jetstream::OutgoingMessage> messages;
      bool any = false;
      for (const std::string& subject : order) {
        std::deque<int>& q = open[subject];
        if (q.empty()) continue;
        any = true;
        const int i = q.front();
        const v1::Event& e = request.events(i);
        v1::EventResult* r = response.mutable_results(i);
        absl::StatusOr<Placement> place = PlaceEvent(e, subject, refusals[i]);
        if (!place.ok()) return place.status();
        switch (place->kind) {
          case Placement::kDuplicate:
            r->set_outcome(v1::DUPLICATE);
            q.pop_front();
            continue;
          case Placement::kDiverged:
            r->set_outcome(v1::DIVERGED);
            r->set_reason(place->reason);
            r->set_applied_seq(TipSeq(subject));
            stop(subject);
            continue;
          case Placement::kNoPredecessor:
            r->set_outcome(v1::REJECTED);
            r->set_reason(place->reason);
            stop(subject);
            continue;
          case Placement::kWalkBack:
          case Placement::kPublish:
            break;
        }
        round.push_back(i);
        messages.push_back(Message(e, subject, place->expected));
      }
      if (!any) return response;
      if (round.empty()) continue;
      std::vector<absl::StatusOr<jetstream::PublishAck>> acks =
          conn_->PublishAll(messages);
      if (std::any_of(acks.begin(), acks.end(),
                      [](const auto& ack) { return ack.ok(); })) {
        untaken_->Taken();
      } else if (jetstream::IsNoResponders(acks.front().status())) {
        untaken_->Untaken(absl::Now());
      }
      absl::Status world;
      for (size_t k = 0; k < round.size(); ++k) {
        const int i = round[k];
        const std::string& subject = subjects[i];
        const v1::Event& e = request.events(i);
        v1::EventResult* r = response.mutable_results(i);
        const absl::StatusOr<jetstream::PublishAck>& ack = acks[k];
        if (ack.ok()) {
          Remember(subject,
                   {.stream_seq = ack->sequence,
                    .outbox_seq = e.seq(),
                    .event_id = e.event_id(),
                    .prev_stream_seq = *messages[k].expected_last_subject_seq});
          r->set_outcome(ack->duplicate ? v1::DUPLICATE : v1::APPLIED);
          open[subject].pop_front();
          continue;
        }
        tips_.erase(subject);
        if (jetstream::IsWrongLastSequence(ack.status())) {
          // Moved on (another relay), or a guess that the aggregate was
          // new: read its tip and decide again.
          if (++refusals[i] > 3) {
            r->set_outcome(v1::DEFERRED);
            r->set_reason(
                "the aggregate's last subject sequence moved on every try "
                "(another relay publishes it)");
            stop(subject);
          }
          continue;
        }
        if (ack.status().code() == absl::StatusCode::kInvalidArgument) {
          // The broker will never take it (above the stream's size limit).
          r->set_outcome(v1::REJECTED);
          r->set_reason(std::string(ack.status().message()));
          stop(subject);
          continue;
        }
        if (world.ok()) world = ack.status();
      }
      if (!world.ok()) return world;  // the world's: the batch goes again
    }
  }

  // Where `event` goes. An aggregate's first event (prev_seq 0) whose tip
  // is not known is guessed new, without a read: the broker refuses the
  // guess if the subject has a message, and the tip is read then.
  absl::StatusOr<Placement> PlaceEvent(const v1::Event& event,
                                       const std::string& subject,
                                       int refusals) {
    if (event.prev_seq() == 0 && refusals == 0 && !tips_.contains(subject)) {
      return Placement{.kind = Placement::kPublish, .expected = 0};
    }
    absl::StatusOr<SubjectTip> tip = Tip(subject);
    if (!tip.ok()) return tip.status();
    Placement place = Place(*tip, event);
    if (place.kind == Placement::kWalkBack) return WalkBack(*tip, event);
    return place;
  }

  int64_t TipSeq(const std::string& subject) const {
    auto it = tips_.find(subject);
    return it == tips_.end() ? 0 : std::max<int64_t>(0, it->second.outbox_seq);
  }

  jetstream::OutgoingMessage Message(const v1::Event& event,
                                     const std::string& subject,
                                     uint64_t expected) const {
    jetstream::OutgoingMessage m;
    m.subject = subject;
    m.data = event.SerializeAsString();
    m.msg_id = event.event_id();
    m.expected_last_subject_seq = expected;
    m.headers = {{kSeqHeader, absl::StrCat(event.seq())},
                 {kPrevSeqHeader, absl::StrCat(event.prev_seq())},
                 {kPrevStreamSeqHeader, absl::StrCat(expected)},
                 {"Outbox-Event-Type", event.event_type()},
                 {"Outbox-Source", event.source()},
                 {"Outbox-Subscription", options_.subscription},
                 {"Content-Type", kContentType}};
    // A header value is one line: drop what would break it.
    for (auto& [key, value] : m.headers) {
      for (char& c : value) {
        if (c == '\r' || c == '\n') c = ' ';
      }
    }
    return m;
  }

  void Remember(const std::string& subject, SubjectTip tip) {
    if (tips_.size() >= kMaxTips) tips_.clear();
    tips_[subject] = std::move(tip);
  }

  absl::StatusOr<SubjectTip> Tip(const std::string& subject) {
    if (auto it = tips_.find(subject); it != tips_.end()) return it->second;
    absl::StatusOr<jetstream::StoredMessage> last =
        conn_->LastOnSubject(options_.stream, subject);
    SubjectTip tip;
    if (last.ok()) {
      absl::StatusOr<SubjectTip> t = TipOf(*last);
      if (!t.ok()) {
        // Not the relay's message: never publish on top of it.
        tip = {.stream_seq = last->sequence, .outbox_seq = -1};
        return tip;
      }
      tip = *std::move(t);
    } else if (last.status().code() != absl::StatusCode::kNotFound) {
      return last.status();
    }
    Remember(subject, tip);
    return tip;
  }

  absl::StatusOr<Placement> WalkBack(const SubjectTip& tip,
                                     const v1::Event& event) {
    SubjectTip at = tip;
    for (int step = 0; step <= options_.max_walk; ++step) {
      if (at.outbox_seq == event.seq()) {
        if (at.event_id == event.event_id()) {
          return Placement{.kind = Placement::kDuplicate};
        }
        return Diverged(absl::StrCat("another event (", at.event_id,
                                     ") holds seq ", at.outbox_seq,
                                     " of this aggregate in the stream"));
      }
      if (at.outbox_seq < event.seq()) {
        return Diverged(absl::StrCat(
            "the stream's history of this aggregate goes from seq ",
            at.outbox_seq, " to a later one without this event"));
      }
      if (at.prev_stream_seq == 0) {
        return Diverged(absl::StrCat(
            "the stream's history of this aggregate begins at seq ",
            at.outbox_seq, ", after this event"));
      }
      absl::StatusOr<jetstream::StoredMessage> m =
          conn_->GetMessage(options_.stream, at.prev_stream_seq);
      if (m.status().code() == absl::StatusCode::kNotFound) {
        return Diverged(absl::StrCat(
            "its position is older than the stream keeps (message ",
            at.prev_stream_seq, " is gone)"));
      }
      if (!m.ok()) return m.status();
      absl::StatusOr<SubjectTip> prev = TipOf(*m);
      if (!prev.ok()) return Diverged(std::string(prev.status().message()));
      at = *std::move(prev);
    }
    return Diverged(absl::StrCat("its position is more than ",
                                 options_.max_walk,
                                 " messages behind the aggregate's newest"));
  }

  const std::shared_ptr<jetstream::Connection> conn_;
  const JetStreamSinkOptions options_;
  const std::shared_ptr<Shared> shared_;
  const std::shared_ptr<UntakenPublishes> untaken_;
  absl::flat_hash_map<std::string, SubjectTip> tips_;
};

class JetStreamBatches : public BatchStream {
 public:
  JetStreamBatches(std::shared_ptr<jetstream::Connection> conn,
                   const JetStreamSinkOptions& options,
                   std::shared_ptr<UntakenPublishes> untaken,
                   std::function<void()> wake)
      : shared_(std::make_shared<Shared>()) {
    {
      absl::MutexLock lock(&shared_->wake_mu);
      shared_->wake = std::move(wake);
    }
    if (conn == nullptr) {
      shared_->Break("not connected to JetStream");
      return;
    }
    // Detached: a publish waiting on a silent broker must not hold up the
    // relay's loop when it drops this stream; the thread ends at its next
    // step (at most the request timeout) and owns what it uses.
    std::thread([p = std::make_shared<Publisher>(std::move(conn), options,
                                                 shared_, std::move(untaken))] {
      p->Run();
    }).detach();
  }
  ~JetStreamBatches() override {
    Cancel();
    absl::MutexLock lock(&shared_->wake_mu);
    shared_->wake = nullptr;
  }

  void Send(v1::DeliverRequest request) override {
    absl::MutexLock lock(&shared_->mu);
    shared_->queue.push_back(std::move(request));
    shared_->cv.SignalAll();
  }
  std::vector<v1::DeliverResponse> TakeResponses() override {
    absl::MutexLock lock(&shared_->mu);
    std::vector<v1::DeliverResponse> out;
    out.swap(shared_->responses);
    return out;
  }
  bool broken() const override { return shared_->broken; }
  std::string error() const override {
    absl::MutexLock lock(&shared_->mu);
    return shared_->error;
  }
  void Cancel() override { shared_->Break("cancelled by the relay"); }
  void CloseSend() override {
    absl::MutexLock lock(&shared_->mu);
    shared_->close_send = true;
    shared_->cv.SignalAll();
  }

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace

Placement Place(const SubjectTip& tip, const v1::Event& event) {
  if (tip.stream_seq == 0) {
    if (event.prev_seq() == 0) return {.kind = Placement::kPublish};
    return {.kind = Placement::kNoPredecessor,
            .reason = absl::StrCat("its predecessor (seq ", event.prev_seq(),
                                   ") is not in the stream: the aggregate "
                                   "has no message there")};
  }
  if (tip.outbox_seq < 0) {
    return Diverged(absl::StrCat("message ", tip.stream_seq,
                                 " on the aggregate's subject was not "
                                 "published by a relay"));
  }
  if (tip.outbox_seq == event.seq()) {
    if (tip.event_id == event.event_id()) {
      return {.kind = Placement::kDuplicate};
    }
    return Diverged(absl::StrCat("another event (", tip.event_id,
                                 ") holds seq ", tip.outbox_seq,
                                 " of this aggregate in the stream"));
  }
  if (tip.outbox_seq == event.prev_seq()) {
    return {.kind = Placement::kPublish, .expected = tip.stream_seq};
  }
  if (tip.outbox_seq > event.seq()) return {.kind = Placement::kWalkBack};
  if (tip.outbox_seq < event.prev_seq()) {
    return {.kind = Placement::kNoPredecessor,
            .reason = absl::StrCat("its predecessor (seq ", event.prev_seq(),
                                   ") is not in the stream: the aggregate's "
                                   "newest message there is seq ",
                                   tip.outbox_seq)};
  }
  return Diverged(absl::StrCat("the stream has seq ", tip.outbox_seq,
                               " of this aggregate after its predecessor (seq ",
                               event.prev_seq(), "): another history"));
}

absl::StatusOr<SubjectTip> TipOf(const jetstream::StoredMessage& message) {
  SubjectTip tip{.stream_seq = message.sequence,
                 .event_id = message.Header(kMsgIdHeader)};
  if (!absl::SimpleAtoi(message.Header(kSeqHeader), &tip.outbox_seq) ||
      tip.outbox_seq <= 0 || tip.event_id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "message ", message.sequence, " on ", message.subject,
        " lacks the relay's ", kSeqHeader, " or ", kMsgIdHeader, " header"));
  }
  const std::string prev = message.Header(kPrevStreamSeqHeader);
  if (!prev.empty() && !absl::SimpleAtoi(prev, &tip.prev_stream_seq)) {
    return absl::InvalidArgumentError(
        absl::StrCat("message ", message.sequence, " on ", message.subject,
                     " has a bad ", kPrevStreamSeqHeader, " header"));
  }
  return tip;
}

absl::StatusOr<std::unique_ptr<JetStreamSink>> JetStreamSink::Create(
    JetStreamSinkOptions options) {
  if (options.connect.servers.empty()) {
    return absl::InvalidArgumentError("jetstream: no server URL given");
  }
  if (!jetstream::IsValidPrefix(options.subject_prefix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("jetstream subject prefix \"", options.subject_prefix,
                     "\": dot-separated tokens of A-Z a-z 0-9 - _ only"));
  }
  // A stream's name also names its directory in the broker's file store.
  if (!jetstream::IsValidName(options.stream) ||
      options.stream.find_first_of("/\\") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "jetstream stream name \"", options.stream,
        "\": must be non-empty, without . * > / \\ or whitespace"));
  }
  if (options.max_per_aggregate < 0) {
    return absl::InvalidArgumentError(
        "jetstream events kept per aggregate: must be 0 (all) or more");
  }
  if (options.replicas < 1 || options.replicas > 5) {
    return absl::InvalidArgumentError(
        absl::StrCat("jetstream replicas ", options.replicas, ": must be 1-5"));
  }
  return std::unique_ptr<JetStreamSink>(new JetStreamSink(std::move(options)));
}

void UntakenPublishes::Untaken(absl::Time now) {
  if (in_a_row_.fetch_add(1) == 0) first_ns_ = absl::ToUnixNanos(now);
}

bool UntakenPublishes::Persistent(absl::Time now) const {
  return in_a_row_ >= kInARow && now - absl::FromUnixNanos(first_ns_) >= kFor;
}

JetStreamSink::JetStreamSink(JetStreamSinkOptions options)
    : options_(std::move(options)) {}

JetStreamSink::~JetStreamSink() { Stop(); }

void JetStreamSink::Start() {
  if (watcher_.joinable()) return;  // started already
  Answered();
  watcher_ = std::thread([this] { Watch(); });
}

void JetStreamSink::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (watcher_.joinable()) watcher_.join();
}

std::string JetStreamSink::name() const {
  return absl::StrCat("JetStream stream ", options_.stream, " at ",
                      absl::StrJoin(options_.connect.servers, ","));
}

Sink::Readiness JetStreamSink::readiness() {
  absl::MutexLock lock(&mu_);
  if (conn_ != nullptr && stream_ready_ && !conn_->ConnectedUrl().empty()) {
    return Readiness::kReady;
  }
  return last_error_.empty() ? Readiness::kConnecting : Readiness::kFailing;
}

std::unique_ptr<BatchStream> JetStreamSink::Open(std::function<void()> wake) {
  std::shared_ptr<jetstream::Connection> conn;
  std::shared_ptr<UntakenPublishes> untaken;
  {
    absl::MutexLock lock(&mu_);
    conn = conn_;
    untaken = untaken_;
  }
  return std::make_unique<JetStreamBatches>(
      std::move(conn), options_, std::move(untaken), std::move(wake));
}

std::optional<std::string> JetStreamSink::Unreachable() const {
  if (options_.unready_after <= absl::ZeroDuration()) return std::nullopt;
  const absl::Duration since =
      absl::Now() - absl::FromUnixNanos(answered_ns_.load());
  if (since < options_.unready_after) return std::nullopt;
  absl::MutexLock lock(&mu_);
  return absl::StrCat(
      name(), " has not answered for ",
      absl::FormatDuration(absl::Trunc(since, absl::Seconds(1))),
      last_error_.empty() ? "" : ": ", last_error_);
}

absl::Status JetStreamSink::OperatorsStreamTakesEvents(
    jetstream::Connection& conn) const {
  absl::StatusOr<jetstream::StreamInfo> info =
      conn.GetStreamInfo(options_.stream);
  if (!info.ok()) return info.status();
  if (jetstream::StoresEventsUnder(info->subjects, options_.subject_prefix)) {
    return absl::OkStatus();
  }
  // Its publishes would find no stream ("no responders"), which looks
  // like a server that has not learnt the stream's subjects: say which.
  return absl::FailedPreconditionError(absl::StrCat(
      "stream ", options_.stream, " binds ",
      info->subjects.empty() ? "no subject"
                             : absl::StrJoin(info->subjects, ", "),
      ", not every event subject under the prefix ", options_.subject_prefix,
      " (", options_.subject_prefix, ".<aggregate type>.<aggregate id>): add ",
      jetstream::AllEventsUnder(options_.subject_prefix),
      " to its subjects, or set the relay's subject prefix to one it binds; "
      "nothing is sent until then"));
}

void JetStreamSink::Watch() {
  Backoff backoff(absl::Milliseconds(250), absl::Seconds(5));
  std::shared_ptr<jetstream::Connection> conn;
  // The publishes through `conn` that no server took: each connection
  // counts its own, so a stream of an earlier one counts for nothing.
  std::shared_ptr<UntakenPublishes> untaken;
  bool ready = false;
  for (;;) {
    absl::Status status;
    if (conn != nullptr && conn->closed()) {
      // Given up by the client: streams on it break, new ones get the next.
      spdlog::warn("relay: {}: the connection was closed; connecting anew",
                   name());
      conn.reset();
      ready = false;
    }
    if (conn == nullptr) {
      absl::StatusOr<std::unique_ptr<jetstream::Connection>> c =
          jetstream::Connection::Connect(options_.connect);
      if (c.ok()) {
        conn = std::shared_ptr<jetstream::Connection>(*std::move(c));
        untaken = std::make_shared<UntakenPublishes>();
        ++connections_;
      }
      status = c.status();
    }
    if (conn != nullptr && !ready) {
      status = options_.ensure_stream
                   ? conn->EnsureStream(
                         {.name = options_.stream,
                          .subjects = {jetstream::AllEventsUnder(
                              options_.subject_prefix)},
                          .replicas = options_.replicas,
                          .duplicate_window = options_.duplicate_window,
                          .max_msgs_per_subject = options_.max_per_aggregate})
                   : OperatorsStreamTakesEvents(*conn);
      if (status.ok()) {
        ready = true;
        Answered();
        spdlog::info("relay: {} ready ({} replicas, subjects {}.>)", name(),
                     options_.replicas, options_.subject_prefix);
      }
    } else if (conn != nullptr) {
      absl::StatusOr<jetstream::StreamInfo> info =
          conn->GetStreamInfo(options_.stream);
      status = info.status();
      if (info.ok() && info->leader.empty() && options_.replicas > 1) {
        status = absl::UnavailableError(
            absl::StrCat("stream ", options_.stream, " has no leader"));
      }
      if (status.ok() && untaken->Persistent(absl::Now())) {
        status = absl::UnavailableError(absl::StrCat(
            "publishes through ", conn->ConnectedUrl(),
            " find no responder while stream ", options_.stream, " has leader ",
            info->leader,
            ": that server has not learnt the leader's subjects, or the "
            "stream's subjects do not cover ",
            jetstream::AllEventsUnder(options_.subject_prefix),
            "; connecting anew"));
        conn.reset();
        ready = false;
      }
      if (status.ok()) Answered();
      // Deleted under us: make it again (or wait for the operator's).
      if (status.code() == absl::StatusCode::kNotFound) ready = false;
    }
    absl::Duration wait = absl::Seconds(1);
    {
      absl::MutexLock lock(&mu_);
      conn_ = conn;
      untaken_ = untaken;
      stream_ready_ = ready;
      if (!status.ok()) {
        if (last_error_ != status.message()) {
          spdlog::warn("relay: {}: {}", name(), std::string(status.message()));
        }
        last_error_ = std::string(status.message());
      } else {
        last_error_.clear();
      }
    }
    if (!status.ok() && !ready) {
      wait = backoff.Next();
    } else {
      backoff.Reset();
    }
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait)) return;
  }
}

}  // namespace outbox::relay
