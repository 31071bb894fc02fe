#include "inbox/sink_service.h"

#include <spdlog/spdlog.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/fault.h"
#include "common/ids.h"
#include "common/server.h"

namespace outbox::inbox {

EventSinkImpl::EventSinkImpl(Engine* engine, const CallerCheck* check,
                             InboxRepair* repair)
    : engine_(engine), check_(check), repair_(repair) {}

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
  // A relay of an earlier release knows no DIVERGED: it gets REJECTED.
  int protocol = 1;
  if (auto it = ctx->client_metadata().find(kProtocolHeader);
      it != ctx->client_metadata().end()) {
    protocol =
        std::atoi(std::string(it->second.data(), it->second.size()).c_str());
  }
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
    BatchOrigin origin;
    auto results = engine_->ApplyBatch(events, &origin);
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
    for (auto& r : *results) {
      if (r.outcome() == v1::DIVERGED && protocol < kProtocolVersion) {
        r.set_outcome(v1::REJECTED);
      }
      *resp.add_results() = std::move(r);
    }
    if (origin.inbox.known()) ToProto(origin.inbox, resp.mutable_inbox());
    resp.set_applied_from(origin.apply_from);
    resp.set_applied_through(origin.apply_through);
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

grpc::Status EventSinkImpl::GetCursors(grpc::ServerContext* ctx,
                                       const v1::GetCursorsRequest* req,
                                       v1::GetCursorsResponse* resp) {
  if (grpc::Status a =
          Admit(check_, ctx, Access::kDeliver, "EventSink.GetCursors");
      !a.ok()) {
    return a;
  }
  if (repair_ == nullptr) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "this consumer cannot list cursors");
  }
  CursorQuery q;
  q.source = req->source();
  q.after = req->after_aggregate_id();
  q.after_type = req->after_aggregate_type();
  q.limit = req->limit() == 0 ? 1000 : req->limit();
  q.only.assign(req->aggregate_ids().begin(), req->aggregate_ids().end());
  auto page = repair_->Cursors(q);
  if (!page.ok()) return ToGrpcStatus(page.status());
  for (const Cursor& c : page->cursors) {
    v1::AggregateCursor* out = resp->add_cursors();
    out->set_aggregate_id(c.aggregate_id);
    out->set_aggregate_type(c.aggregate_type);
    out->set_source(c.source);
    out->set_applied_seq(c.applied_seq);
    out->set_applied_event_id(c.applied_event_id);
    out->set_pruned_through(c.pruned_through);
    out->set_held(c.held);
  }
  resp->set_more(page->more);
  if (page->identity.known()) ToProto(page->identity, resp->mutable_inbox());
  return grpc::Status::OK;
}

grpc::Status EventSinkImpl::Rewind(grpc::ServerContext* ctx,
                                   const v1::RewindRequest* req,
                                   v1::RewindResponse* resp) {
  if (grpc::Status a = Admit(check_, ctx, Access::kDeliver, "EventSink.Rewind");
      !a.ok()) {
    return a;
  }
  if (repair_ == nullptr) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "this consumer cannot rewind");
  }
  RewindRequest r;
  r.aggregate_id = req->aggregate_id();
  r.aggregate_type = req->aggregate_type();
  r.source = req->source();
  r.shared_through_seq = req->shared_through_seq();
  r.keep_event_ids.assign(req->keep_event_ids().begin(),
                          req->keep_event_ids().end());
  r.reason = req->reason();
  r.operator_name = req->operator_();
  auto done = repair_->Rewind(r);
  if (!done.ok()) return ToGrpcStatus(done.status());
  resp->set_applied_seq(done->applied_seq);
  resp->set_held_dropped(done->held_dropped);
  for (const Superseded& e : done->superseded) {
    v1::SupersededEvent* out = resp->add_superseded();
    out->set_event_id(e.event_id);
    out->set_seq(e.seq);
    out->set_event_type(e.event_type);
    ToTimestamp(e.applied_at, out->mutable_applied_at());
  }
  return grpc::Status::OK;
}

}  // namespace outbox::inbox
