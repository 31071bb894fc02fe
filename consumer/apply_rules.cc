#include "consumer/apply_rules.h"

#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace outbox::consumer {

absl::Status ValidateEvent(const v1::Event& e) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(parts...));
  };
  if (!IsUuid(e.event_id())) return bad("event_id: must be a UUID");
  if (e.aggregate_id().empty() || e.aggregate_id().size() > 128) {
    return bad("aggregate_id: must be 1-128 bytes");
  }
  if (e.aggregate_type() != "order") {
    return bad("aggregate_type: \"", e.aggregate_type().substr(0, 32),
               "\" is not handled here (expected \"order\")");
  }
  if (e.seq() <= 0) return bad("seq: must be positive, got ", e.seq());
  if (e.prev_seq() < 0 || e.prev_seq() >= e.seq()) {
    return bad("prev_seq: must be in [0, seq), got ", e.prev_seq(), " with seq ",
               e.seq());
  }
  if (e.schema_version() != kSupportedSchemaVersion) {
    return bad("schema_version: ", e.schema_version(), " is not supported (",
               kSupportedSchemaVersion, " is)");
  }
  const std::string& type = e.event_type();
  std::string order_id;
  if (type == "OrderCreated") {
    if (!e.has_order_created()) return bad("payload: OrderCreated without its payload");
    const auto& p = e.order_created();
    if (p.total_cents() < 0) return bad("payload: negative total");
    if (p.currency().size() != 3) return bad("payload: bad currency");
    order_id = p.order_id();
  } else if (type == "OrderPaid") {
    if (!e.has_order_paid()) return bad("payload: OrderPaid without its payload");
    if (e.order_paid().amount_cents() < 0) return bad("payload: negative amount");
    order_id = e.order_paid().order_id();
  } else if (type == "OrderCancelled") {
    if (!e.has_order_cancelled()) {
      return bad("payload: OrderCancelled without its payload");
    }
    if (e.order_cancelled().refund_cents() < 0) return bad("payload: negative refund");
    order_id = e.order_cancelled().order_id();
  } else {
    return bad("event_type: unknown type \"", type.substr(0, 64), "\"");
  }
  if (order_id != e.aggregate_id()) {
    return bad("payload: order_id does not match aggregate_id");
  }
  return absl::OkStatus();
}

}  // namespace outbox::consumer
