#pragma once
// Where a relay delivers. A Sink opens BatchStreams and says whether its
// far end answers; the relay's loop sees only these two faces, so that a
// consumer over gRPC (ConsumerLink, DeliveryStream) and a JetStream stream
// (JetStreamSink) are delivered to by the same claims, marks and order.
//
//   std::unique_ptr<Sink> sink = ...;
//   sink->Start();
//   if (sink->readiness() == Sink::Readiness::kReady)
//     stream = sink->Open([&] { Wake(); });
//   stream->Send(request);            // never blocks
//   for (auto& r : stream->TakeResponses()) { sink->Answered(); ... }
//
// A stream answers each batch with one DeliverResponse: every event
// APPLIED, DUPLICATE, HELD, REJECTED, DEFERRED or DIVERGED as sink.proto
// defines them, or the batch is not answered at all and the stream breaks
// (a fault of the world: the rows stay pending and go again).

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "outbox/v1/sink.grpc.pb.h"

namespace outbox::relay {

// One ordered channel of batches. Thread-safe: Send and TakeResponses on
// the relay's loop, the answers produced by the stream's own threads.
class BatchStream {
 public:
  virtual ~BatchStream() = default;
  // Queues a batch; never blocks.
  virtual void Send(v1::DeliverRequest request) = 0;
  // Answers received since the last call, in arrival order.
  virtual std::vector<v1::DeliverResponse> TakeResponses() = 0;
  // True once the stream can carry nothing more; `error()` says why.
  virtual bool broken() const = 0;
  virtual std::string error() const = 0;
  // Aborts (answers not yet received are lost; rows stay pending).
  virtual void Cancel() = 0;
  // Ends the stream after the queued batches are answered (graceful
  // shutdown): broken() turns true once they are.
  virtual void CloseSend() = 0;
};

class Sink {
 public:
  enum class Readiness {
    kReady,       // Open would not wait on the network
    kConnecting,  // ask again soon
    kFailing,     // the last attempt failed: back off
  };
  virtual ~Sink() = default;

  // Starts whatever watches the far end (health checks). At most once.
  virtual void Start() = 0;
  // Idempotent; waits for a check in progress, briefly.
  virtual void Stop() = 0;

  // For logs and the admin service: "host:port", or the JetStream stream.
  virtual std::string name() const = 0;
  virtual Readiness readiness() = 0;
  // A new stream; `wake` is called from its threads whenever an answer
  // arrives or it breaks.
  virtual std::unique_ptr<BatchStream> Open(std::function<void()> wake) = 0;

  // A batch was answered. Thread-safe.
  virtual void Answered() = 0;
  // Why the far end counts as unreachable (it answered nothing for the
  // configured while), or nothing. Thread-safe.
  virtual std::optional<std::string> Unreachable() const = 0;

  // The consumer's EventSink, for cursors (heals) and rewinds; null when
  // the sink is not a consumer service (a broker keeps no cursors).
  virtual v1::EventSink::Stub* consumer() const = 0;
};

}  // namespace outbox::relay
