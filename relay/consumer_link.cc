#include "relay/consumer_link.h"

#include <algorithm>
#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "relay/delivery_stream.h"

namespace outbox::relay {

ConsumerLink::ConsumerLink(Options options) : options_(std::move(options)) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  // gRPC's own reconnect backoff decides how soon a restarted consumer is
  // seen again: keep it short (and no longer than --retry_max), or a
  // consumer that restarts every few seconds is never connected to.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::clamp<int64_t>(
                  absl::ToInt64Milliseconds(options_.retry_max), 100, 1000)));
  channel_ = grpc::CreateCustomChannel(
      options_.target, MakeChannelCredentials(options_.tls), args);
  stub_ = v1::EventSink::NewStub(channel_);
  health_ = grpc::health::v1::Health::NewStub(channel_);
}

ConsumerLink::~ConsumerLink() { Stop(); }

void ConsumerLink::Start() {
  Answered();
  if (options_.unready_after > absl::ZeroDuration()) {
    prober_ = std::make_unique<PeriodicTask>(absl::Seconds(1), [this] {
      Probe();
      return false;
    });
  }
}

void ConsumerLink::Stop() { prober_.reset(); }

Sink::Readiness ConsumerLink::readiness() {
  switch (State()) {
    case GRPC_CHANNEL_READY:
      return Readiness::kReady;
    case GRPC_CHANNEL_TRANSIENT_FAILURE:
      return Readiness::kFailing;
    default:
      return Readiness::kConnecting;
  }
}

std::unique_ptr<BatchStream> ConsumerLink::Open(std::function<void()> wake) {
  return std::make_unique<DeliveryStream>(stub_.get(), std::move(wake));
}

void ConsumerLink::Probe() {
  // A consumer that answered a batch within the last second needs no probe.
  if (absl::Now() - absl::FromUnixNanos(answered_ns_) < absl::Seconds(1)) {
    return;
  }
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(v1::EventSink::service_full_name());
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  const grpc::Status s = health_->Check(&ctx, req, &resp);
  absl::MutexLock lock(&mu_);
  if (s.ok() &&
      resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
    Answered();
    probe_error_.clear();
    return;
  }
  probe_error_ =
      s.ok() ? "its health check answers NOT_SERVING"
             : absl::StrCat("its health check failed: ",
                            absl::StatusCodeToString(
                                static_cast<absl::StatusCode>(s.error_code())),
                            ": ", s.error_message());
}

std::optional<std::string> ConsumerLink::Unreachable() const {
  const absl::Duration silent = absl::Now() - absl::FromUnixNanos(answered_ns_);
  if (options_.unready_after <= absl::ZeroDuration() ||
      silent <= options_.unready_after) {
    return std::nullopt;
  }
  absl::MutexLock lock(&mu_);
  return absl::StrCat(
      "the consumer ", options_.target, " has not answered for ",
      absl::FormatDuration(absl::Trunc(silent, absl::Seconds(1))),
      probe_error_.empty() ? "" : " (", probe_error_,
      probe_error_.empty() ? "" : ")");
}

}  // namespace outbox::relay
