#pragma once
// The checks of an event's envelope that hold in every domain; the
// handler's Validate checks the rest (inbox/handler.h).

#include "absl/status/status.h"
#include "outbox/v1/event.pb.h"

namespace outbox::inbox {

// InvalidArgument naming the field when the envelope can never be applied:
// a malformed event_id, an aggregate_type or aggregate_id out of bounds,
// seq or prev_seq out of range, no event_type.
absl::Status ValidateEnvelope(const v1::Event& event);

}  // namespace outbox::inbox
