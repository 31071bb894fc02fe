#pragma once
// The relay's link to its consumer: the gRPC channel (keepalives, a short
// reconnect backoff) and stub to EventSink, and whether the consumer
// answers. An answer to a batch counts (Answered); so does a health check
// of outbox.v1.EventSink, which a thread of its own tries every second once
// no batch was answered for a second. A consumer that has answered neither
// for unready_after is unreachable: the relay turns readiness NOT_SERVING
// and gives its partitions to the replicas that reach it.
//
// Example:
//   ConsumerLink link({.target = "127.0.0.1:50052",
//                      .unready_after = absl::Seconds(15)});
//   link.Start();
//   if (link.readiness() == Sink::Readiness::kReady) stream = link.Open(wake);
//   ... an answer: link.Answered();
//   if (std::optional<std::string> why = link.Unreachable()) ...

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/periodic.h"
#include "common/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "outbox/v1/sink.grpc.pb.h"
#include "relay/sink.h"

namespace outbox::relay {

class ConsumerLink : public Sink {
 public:
  struct Options {
    std::string target;  // host:port of EventSink
    ClientTlsFiles tls;  // none: plaintext
    // gRPC's reconnect backoff stays within [100 ms, min(this, 1 s)], so
    // that a consumer restarting every few seconds is still connected to.
    absl::Duration retry_max = absl::Seconds(5);
    // Zero: never unreachable, and no health checks.
    absl::Duration unready_after = absl::Seconds(15);
  };

  explicit ConsumerLink(Options options);
  ~ConsumerLink() override;  // Stop()
  ConsumerLink(const ConsumerLink&) = delete;
  ConsumerLink& operator=(const ConsumerLink&) = delete;

  // The consumer has unready_after from now to answer; starts the health
  // checks. At most once.
  void Start() override;
  // Stops the health checks (waits for one in progress, 2 s at most).
  // Idempotent.
  void Stop() override;

  // The stub for calls and streams; lives as long as this. Thread-safe.
  v1::EventSink::Stub* stub() const { return stub_.get(); }
  // The channel's state, asking it to connect when idle: open a stream
  // only on GRPC_CHANNEL_READY, so that opening never waits on the
  // network.
  grpc_connectivity_state State() { return channel_->GetState(true); }

  // Sink: the target; READY is kReady, TRANSIENT_FAILURE kFailing.
  std::string name() const override { return options_.target; }
  Readiness readiness() override;
  // A DeliveryStream on the stub.
  std::unique_ptr<BatchStream> Open(std::function<void()> wake) override;
  v1::EventSink::Stub* consumer() const override { return stub_.get(); }

  // A batch was answered. Thread-safe.
  void Answered() override { answered_ns_ = absl::ToUnixNanos(absl::Now()); }
  // Why the consumer counts as unreachable (it answered neither a batch
  // nor a health check for unready_after, and what its last health check
  // said), or nothing. Thread-safe.
  std::optional<std::string> Unreachable() const override;

 private:
  void Probe();

  const Options options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::EventSink::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  std::atomic<int64_t> answered_ns_{0};
  mutable absl::Mutex mu_;
  std::string probe_error_ ABSL_GUARDED_BY(mu_);  // the last check's, or ""
  std::unique_ptr<PeriodicTask> prober_;
};

}  // namespace outbox::relay
