#pragma once
// Which events the consumer can accept at all; what to do with an
// acceptable one is the batch planner's (consumer/batch_plan.h).

#include "absl/status/status.h"
#include "outbox/v1/event.pb.h"

namespace outbox::consumer {

inline constexpr int kSupportedSchemaVersion = 1;

// InvalidArgument with the reason an event can never be applied: missing or
// malformed ids, seq/prev_seq out of range, an unknown event type, a wrong
// schema version, or a payload that does not match the type.
absl::Status ValidateEvent(const v1::Event& event);

}  // namespace outbox::consumer
