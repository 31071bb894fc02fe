#pragma once
// EventSink.Deliver, the relay's stream into the inbox engine. It
// translates only; the rules are the engine's.

#include "common/identity.h"
#include "inbox/engine.h"
#include "outbox/v1/sink.grpc.pb.h"

namespace outbox::inbox {

// Largest batch one DeliverRequest may carry.
inline constexpr int kMaxBatchEvents = 1000;

class EventSinkImpl final : public v1::EventSink::Service {
 public:
  // `engine` and `check` (may be null: every caller admitted) must outlive
  // the service.
  explicit EventSinkImpl(Engine* engine, const CallerCheck* check = nullptr);

  // Reads batches, applies each in one transaction, answers after commit.
  // Ends the stream with the database's status (e.g. UNAVAILABLE) when a
  // batch cannot be committed, so the relay retries it elsewhere or later.
  grpc::Status Deliver(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DeliverResponse, v1::DeliverRequest>* stream)
      override;

 private:
  Engine* const engine_;
  const CallerCheck* const check_;
};

}  // namespace outbox::inbox
