#include "inbox/sink_service.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "common/fault.h"
#include "common/server.h"

namespace outbox::inbox {

EventSinkImpl::EventSinkImpl(Engine* engine, const CallerCheck* check)
    : engine_(engine), check_(check) {}

grpc::Status EventSinkImpl::Deliver(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::DeliverResponse, v1::DeliverRequest>* stream) {
  // Only the relay may deliver: anyone else could forge effects or push a
  // cursor past real events.
  if (grpc::Status a =
          Admit(check_, ctx, Access::kDeliver, "EventSink.Deliver");
      !a.ok()) {
    return a;
  }
  spdlog::info("consumer: delivery stream opened by {}", ctx->peer());
  v1::DeliverRequest req;
  // Read returns false when the peer half-closes or the call is cancelled
  // (including by the server's shutdown deadline), so this loop never
  // blocks Shutdown forever.
  while (stream->Read(&req)) {
    if (req.events_size() > kMaxBatchEvents) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("events: a batch holds at most ", kMaxBatchEvents,
                       " events, got ", req.events_size()));
    }
    std::vector<const v1::Event*> events;
    events.reserve(req.events_size());
    for (const v1::Event& e : req.events()) events.push_back(&e);
    const absl::Time t0 = absl::Now();
    auto results = engine_->ApplyBatch(events);
    if (spdlog::should_log(spdlog::level::debug)) {
      spdlog::debug("consumer: batch {} of {} events in {}", req.batch_id(),
                    events.size(), absl::FormatDuration(absl::Now() - t0));
    }
    if (!results.ok()) {
      spdlog::warn("consumer: batch {} not applied: {}", req.batch_id(),
                   results.status().ToString());
      return ToGrpcStatus(results.status());
    }
    // Committed, not answered: the relay must redeliver and get DUPLICATE.
    MaybeCrash("consumer.after_commit_before_answer");
    v1::DeliverResponse resp;
    resp.set_batch_id(req.batch_id());
    for (auto& r : *results) *resp.add_results() = std::move(r);
    if (!stream->Write(resp)) {
      // Committed but unanswered: the relay redelivers and gets DUPLICATE.
      return grpc::Status(grpc::StatusCode::CANCELLED, "peer went away");
    }
  }
  if (ctx->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
  }
  return grpc::Status::OK;
}

}  // namespace outbox::inbox
