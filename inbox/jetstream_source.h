#pragma once
// The inbox engine fed from JetStream instead of a relay's gRPC stream: a
// durable pull consumer of the stream the relay's JetStream sink publishes
// to (relay/jetstream_sink.h), whose messages are applied in batches by the
// same Engine, with the same handlers, and acknowledged only after their
// inbox transaction committed.
//
// What each answer of the engine does to its message:
//   APPLIED, DUPLICATE, HELD  acknowledged (HELD is parked durably in
//                             held_events and drains with its predecessor)
//   REJECTED                  not acknowledged: redelivered after a backoff
//                             that grows with each delivery, and counted in
//                             outbox_consumer_jetstream_redeliveries_total;
//                             refused on park_after deliveries, it is parked
//                             in the inbox as a failed held event (its
//                             aggregate waits behind it; `outboxctl held
//                             --failed`, then release or skip) and then
//                             acknowledged: the consumer's dead letter
//   DIVERGED                  not acknowledged, redelivered with the same
//                             backoff until an operator rewinds the
//                             aggregate (EventSink.Rewind)
//   DEFERRED                  redelivered after a second (behind a rejected
//                             event of its batch; it comes back HELD)
// A batch the database did not take (Unavailable) is redelivered after a
// second, and the source backs off; a message that is not an outbox Event
// is acknowledged and counted as unreadable (it can never apply).
// A crash between the commit and the ack redelivers: DUPLICATE.
//
// Order: a stream delivers an aggregate's messages in the order the relay
// published them, which the broker held to one chain; the engine holds an
// event whose predecessor has not applied (a redelivery overtaken).

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/jetstream.h"
#include "common/metrics.h"
#include "inbox/engine.h"

namespace outbox::inbox {

struct JetStreamSourceOptions {
  jetstream::ConnectOptions connect;
  std::string stream = "OUTBOX_BILLING";
  std::string durable = "outbox-consumer";  // shared by the replicas
  std::string filter_subject;               // empty: the whole stream
  int batch = 256;                          // messages per fetch, 1-1000
  // Unacknowledged this long: delivered again (to any replica).
  absl::Duration ack_wait = absl::Seconds(30);
  int64_t max_ack_pending = 4096;
  // The backoff of a REJECTED or DIVERGED event: initial * 2^(n-1) after
  // its n-th delivery, at most max.
  absl::Duration reject_backoff = absl::Milliseconds(500);
  absl::Duration reject_backoff_max = absl::Seconds(60);
  // Deliveries of an event refused on each before it is parked.
  int64_t park_after = 5;
};

class JetStreamSource {
 public:
  // `engine` and `metrics` must outlive this.
  JetStreamSource(JetStreamSourceOptions options, Engine* engine,
                  Metrics* metrics);
  ~JetStreamSource();  // Stop()

  // Connects, binds the durable consumer and applies, on a thread of its
  // own, retrying whatever fails.
  void Start();
  // Lets the batch in progress commit and acknowledge, then stops.
  void Stop();

  // Registers the source's counters (at 0): a consumer exports them
  // whether it reads JetStream or not, so that its alerts always have
  // their series. The constructor does it too.
  static void RegisterMetrics(Metrics* metrics);

  // Messages acknowledged so far (tests and logs).
  int64_t acknowledged() const { return acked_; }

 private:
  void Run();
  // One fetch and its batch; false when the source should back off.
  bool Step(jetstream::PullConsumer& consumer);
  bool Sleep(absl::Duration d);  // false when stopping

  const JetStreamSourceOptions options_;
  Engine* const engine_;
  Counter* const applied_;
  Counter* const redelivered_;
  Counter* const unreadable_;
  Counter* const parked_;
  Counter* const failures_;
  std::atomic<int64_t> acked_{0};
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace outbox::inbox
