#pragma once
// Test support for the inbox side: a consumer's EventSink driven as a relay
// drives it, and the inbox's own order checked.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <vector>

#include "outbox/v1/event.pb.h"
#include "outbox/v1/sink.grpc.pb.h"
#include "tests/testing/pg.h"

namespace outbox::testing {

// Sends `batches` over one EventSink.Deliver stream, each batch answered
// before the next goes (batch ids 1, 2, ...), and returns every result in
// order. `status`, if given, is how the stream ended.
std::vector<v1::EventResult> DeliverBatches(
    const std::shared_ptr<grpc::Channel>& channel,
    const std::vector<std::vector<v1::Event>>& batches,
    grpc::Status* status = nullptr);

// Inbox rows applied out of order: an aggregate's row whose seq is not
// above the one applied before it (by apply_id). 0 when in order.
int64_t InboxOutOfOrder(TestDatabase& db);

}  // namespace outbox::testing
