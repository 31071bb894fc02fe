#pragma once
// The consumer's rules without I/O: which events are acceptable at all, and
// what to do with an acceptable event given its aggregate's cursor.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "outbox/v1/event.pb.h"

namespace outbox::consumer {

inline constexpr int kSupportedSchemaVersion = 1;

// InvalidArgument with the reason an event can never be applied: missing or
// malformed ids, seq/prev_seq out of range, an unknown event type, a wrong
// schema version, or a payload that does not match the type.
absl::Status ValidateEvent(const v1::Event& event);

enum class Decision {
  kApply,      // prev_seq == cursor: the next event of the aggregate
  kDuplicate,  // seq <= cursor: applied before
  kHold,       // prev_seq > cursor: its predecessor has not been applied
  kReject,     // prev_seq < cursor < seq: the chain is broken
};

// What to do with a valid event when its aggregate's cursor (the seq of the
// last applied event, 0 if none) is `cursor`.
Decision Decide(int64_t seq, int64_t prev_seq, int64_t cursor);

const char* DecisionName(Decision d);

}  // namespace outbox::consumer
