#include "inbox/envelope.h"

#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace outbox::inbox {

absl::Status ValidateEnvelope(const v1::Event& e) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(parts...));
  };
  if (!IsUuid(e.event_id())) return bad("event_id: must be a UUID");
  if (e.aggregate_type().empty() || e.aggregate_type().size() > 64) {
    return bad("aggregate_type: must be 1-64 bytes");
  }
  if (e.aggregate_id().empty() || e.aggregate_id().size() > 128) {
    return bad("aggregate_id: must be 1-128 bytes");
  }
  if (!e.source().empty() && !IsSourceName(e.source())) {
    return bad("source: must be 1-64 bytes of letters, digits, '.', '_' and "
               "'-', or empty");
  }
  if (e.seq() <= 0) return bad("seq: must be positive, got ", e.seq());
  if (e.prev_seq() < 0 || e.prev_seq() >= e.seq()) {
    return bad("prev_seq: must be in [0, seq), got ", e.prev_seq(),
               " with seq ", e.seq());
  }
  if (e.event_type().empty() || e.event_type().size() > 128) {
    return bad("event_type: must be 1-128 bytes");
  }
  return absl::OkStatus();
}

}  // namespace outbox::inbox
