#pragma once
// EventSink.Deliver, the relay's stream into the inbox engine. It
// translates only; the rules are the engine's.

#include "common/identity.h"
#include "inbox/engine.h"
#include "inbox/repair.h"
#include "outbox/v1/sink.grpc.pb.h"

namespace outbox::inbox {

// Largest batch one DeliverRequest may carry.
inline constexpr int kMaxBatchEvents = 1000;

// The delivery protocol a relay speaks, from its request metadata
// "outbox-protocol": 1 (none given) or 2 (it understands DIVERGED).
inline constexpr char kProtocolHeader[] = "outbox-protocol";
inline constexpr int kProtocolVersion = 2;

class EventSinkImpl final : public v1::EventSink::Service {
 public:
  // `engine`, `repair` (may be null: GetCursors and Rewind answer
  // UNIMPLEMENTED) and `check` (may be null: every caller admitted) must
  // outlive the service.
  explicit EventSinkImpl(Engine* engine, const CallerCheck* check = nullptr,
                         InboxRepair* repair = nullptr);

  // Reads batches, applies each in one transaction, answers after commit.
  // Ends the stream with the database's status (e.g. UNAVAILABLE) when a
  // batch cannot be committed, so the relay retries it elsewhere or later.
  grpc::Status Deliver(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DeliverResponse, v1::DeliverRequest>* stream)
      override;

  // The relay's own calls (the delivery identity, as Deliver).
  grpc::Status GetCursors(grpc::ServerContext* ctx,
                          const v1::GetCursorsRequest* req,
                          v1::GetCursorsResponse* resp) override;
  grpc::Status Rewind(grpc::ServerContext* ctx, const v1::RewindRequest* req,
                      v1::RewindResponse* resp) override;

 private:
  Engine* const engine_;
  const CallerCheck* const check_;
  InboxRepair* const repair_;
};

}  // namespace outbox::inbox
