#pragma once
// The relay's JetStream sink: each event is published to its aggregate's
// subject (jetstream_subject.h) of one stream, with Nats-Msg-Id = event_id
// and Nats-Expected-Last-Subject-Sequence = the stream sequence of the
// aggregate's newest message, so that the broker itself stores an
// aggregate's events only as one chain, in order, whichever relay
// publishes. The publish acknowledgement (after the stream's replicas have
// the message) is what the relay marks as delivered.
//
// What a message carries: the Event (outbox/v1/event.proto) in binary as
// its data, and headers
//   Nats-Msg-Id              the event_id (the broker drops a repeat)
//   Outbox-Seq               the event's seq
//   Outbox-Prev-Seq          its aggregate's previous event's seq (0: none)
//   Outbox-Prev-Stream-Seq   that previous event's stream sequence
//   Outbox-Event-Type, Outbox-Source, Outbox-Subscription
//   Content-Type             application/protobuf; messageType=outbox.v1.Event
//
// A batch is published in rounds: each round publishes the next event of
// every aggregate in it at once and waits for their acks together.
// Before publishing, the aggregate's newest message (its tip, read once
// per stream and then remembered; an aggregate's first event is published
// expecting an empty subject, unread, and a refusal reads it) says where
// the event belongs (Place):
//   - the tip is the event's predecessor: publish, expecting the tip;
//   - the tip is the event itself: DUPLICATE (a publish whose ack was lost,
//     or a redelivery);
//   - the tip is later: the chain is walked back through
//     Outbox-Prev-Stream-Seq to the event's position; the event there is
//     DUPLICATE, another event or none is DIVERGED;
//   - the tip is before the event's predecessor, or the subject is empty
//     while the event has one: REJECTED (the predecessor is not in the
//     stream: dead-lettered, or the stream lost it), so the event backs off
//     and, after --max_attempts, waits as a dead letter for a requeue;
//   - the tip is another event between the predecessor and the event: the
//     stream holds another history of the aggregate (a failover of the
//     outbox database lost commits the stream has): DIVERGED.
// A refused expectation (another relay published first) reads the tip
// again and decides anew. A timeout, a lost connection or a stream without
// quorum breaks the stream and answers nothing of the batch: its rows stay
// pending and go again, and the tip check makes that safe.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/jetstream.h"
#include "outbox/v1/event.pb.h"
#include "relay/sink.h"

namespace outbox::relay {

struct JetStreamSinkOptions {
  jetstream::ConnectOptions connect;  // servers, credentials, TLS
  std::string stream = "OUTBOX";
  // Subjects are "<prefix>.<aggregate type>.<aggregate id>", escaped.
  std::string subject_prefix = "outbox";
  // The relay creates the stream (or updates it to these settings) once
  // connected; false: it must exist, made by an operator, and bind every
  // subject under the prefix (the sink is not ready until it does, and
  // says which subjects it binds).
  bool ensure_stream = true;
  int replicas = 3;
  absl::Duration duplicate_window = absl::Minutes(2);
  // Events kept per aggregate (the oldest go first, never the newest, which
  // the chain check needs); 0: every one.
  int64_t max_per_aggregate = 0;
  std::string subscription;  // the Outbox-Subscription header
  // No publish acknowledged and no stream info read for this long:
  // unreachable (the relay turns NOT_SERVING). Zero: never.
  absl::Duration unready_after = absl::Seconds(15);
  // Steps of a walk back along an aggregate's chain, at most.
  int max_walk = 10000;
};

// An aggregate subject's newest message, as far as placing goes.
struct SubjectTip {
  uint64_t stream_seq = 0;  // 0: the subject has no message
  int64_t outbox_seq = 0;
  std::string event_id;
  uint64_t prev_stream_seq = 0;  // its predecessor's message; 0: none
};

struct Placement {
  enum Kind {
    kPublish,        // expecting `expected` as the last subject sequence
    kDuplicate,      // the tip is this event
    kWalkBack,       // the tip is later: find the event's position
    kNoPredecessor,  // REJECTED: the predecessor is not in the stream
    kDiverged,       // another history
  };
  Kind kind = kPublish;
  uint64_t expected = 0;
  std::string reason;  // for kNoPredecessor and kDiverged
};

// Where `event` goes given its subject's `tip`. Pure.
Placement Place(const SubjectTip& tip, const v1::Event& event);

// The tip a stored message stands for; InvalidArgument if it lacks the
// relay's headers (something else published on the subject).
absl::StatusOr<SubjectTip> TipOf(const jetstream::StoredMessage& message);

// Publishes that no server took ("no responders") in a row, while the
// stream's info still answers with a leader: the server this connection
// reached has not learnt the leader's interest in the stream's subjects
// (nats-server 2.9 can lose it when a whole cluster restarts and its
// routes form anew; the broker does not mend it), or the stream's subjects
// do not cover the relay's. Only a connection to another server gets past
// the first. One per connection: written by its streams' threads, read by
// the sink's watcher.
class UntakenPublishes {
 public:
  // In a row, over at least this long: the server will not learn it.
  static constexpr int kInARow = 3;
  static constexpr absl::Duration kFor = absl::Seconds(5);

  void Taken() { in_a_row_ = 0; }  // a publish acknowledged
  void Untaken(absl::Time now);    // one found no responder
  bool Persistent(absl::Time now) const;

 private:
  std::atomic<int> in_a_row_{0};
  std::atomic<int64_t> first_ns_{0};
};

class JetStreamSink : public Sink {
 public:
  // InvalidArgument for a bad prefix, stream name or replica count.
  static absl::StatusOr<std::unique_ptr<JetStreamSink>> Create(
      JetStreamSinkOptions options);
  ~JetStreamSink() override;  // Stop()

  // Starts connecting (and ensuring the stream) on a thread of its own,
  // which then checks the stream every second. Again: nothing.
  void Start() override;
  void Stop() override;
  std::string name() const override;
  Readiness readiness() override;
  std::unique_ptr<BatchStream> Open(std::function<void()> wake) override;
  void Answered() override { answered_ns_ = absl::ToUnixNanos(absl::Now()); }
  std::optional<std::string> Unreachable() const override;
  v1::EventSink::Stub* consumer() const override { return nullptr; }

  // Connections made so far (the client's own reconnects to the same
  // connection not counted).
  int64_t connections() const { return connections_; }

 private:
  explicit JetStreamSink(JetStreamSinkOptions options);
  void Watch();
  // With ensure_stream false: OK when the operator's stream exists and
  // binds every subject the relay publishes to (FailedPrecondition
  // naming its subjects when not).
  absl::Status OperatorsStreamTakesEvents(jetstream::Connection& conn) const;

  const JetStreamSinkOptions options_;
  std::atomic<int64_t> answered_ns_{0};
  std::atomic<int64_t> connections_{0};
  mutable absl::Mutex mu_;
  std::shared_ptr<jetstream::Connection> conn_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<UntakenPublishes> untaken_ ABSL_GUARDED_BY(mu_);  // conn_'s
  bool stream_ready_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watcher_;
};

}  // namespace outbox::relay
