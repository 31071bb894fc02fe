// Fuzzes the decoding of an outbox row's payload (arbitrary bytes in the
// payload column, as a corrupt or foreign row would hold). Properties:
// - the envelope always comes from the columns, whatever the bytes;
// - bytes that parse as an outbox.v1.Event decode to that event: its
//   payload (the Any, or a legacy row's fields 10-12, kept as unknown
//   fields), occurred_at and every byte the relay does not own survive
//   byte for byte, so what the consumer gets is what the writer stored;
//   and decoding what the relay would send again gives the same event;
// - the billing handler accepts an event only if its order payload decodes
//   to the message its event_type names, about its own aggregate; and
//   neither its nor the inbox's checks fail in any other way than
//   INVALID_ARGUMENT.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "consumer/billing.h"
#include "inbox/envelope.h"
#include "relay/outbox_row.h"

namespace {

// Fails the run, saying which property broke.
#define Require(cond)                                                   \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "%s:%d: violated: %s\n", __FILE__, __LINE__, \
                   #cond);                                              \
      std::abort();                                                     \
    }                                                                   \
  } while (0)

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  outbox::relay::EnvelopeColumns c;
  c.seq = 42;
  c.prev_seq = 7;
  c.event_id = "6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e";
  c.aggregate_type = "order";
  c.aggregate_id = "0b9f6f1e-1111-4222-8333-444455556666";
  c.event_type = "OrderPaid";
  c.schema_version = 1;
  c.trace_parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  outbox::v1::Event e;
  const bool parsed = outbox::relay::DecodeEvent(c, bytes, &e);
  Require(e.seq() == c.seq && e.prev_seq() == c.prev_seq);
  Require(e.event_id() == c.event_id && e.aggregate_id() == c.aggregate_id);
  Require(e.aggregate_type() == c.aggregate_type);
  Require(e.event_type() == c.event_type && e.schema_version() == 1);
  Require(e.trace_parent() == c.trace_parent);

  outbox::v1::Event stored;
  Require(parsed == stored.ParseFromArray(data, static_cast<int>(size)));
  if (parsed) {
    // What the writer stored reaches the consumer unchanged.
    Require(e.payload().SerializeAsString() ==
            stored.payload().SerializeAsString());
    Require(e.occurred_at().SerializeAsString() ==
            stored.occurred_at().SerializeAsString());
    std::string kept_e, kept_stored;
    e.GetReflection()->GetUnknownFields(e).SerializeToString(&kept_e);
    stored.GetReflection()->GetUnknownFields(stored).SerializeToString(
        &kept_stored);
    Require(kept_e == kept_stored);
    // Sent, stored and read again: the same event.
    outbox::v1::Event again;
    const std::string sent = e.SerializeAsString();
    Require(outbox::relay::DecodeEvent(c, sent, &again));
    Require(again.SerializeAsString() == sent);
  } else {
    Require(!e.has_payload() && !e.has_occurred_at());
  }

  absl::Status s = outbox::inbox::ValidateEnvelope(e);
  Require(s.ok() || s.code() == absl::StatusCode::kInvalidArgument);
  s = outbox::consumer::BillingHandler().Validate(e);
  Require(s.ok() || s.code() == absl::StatusCode::kInvalidArgument);
  if (s.ok()) {
    // Accepted: its payload is an OrderPaid (the event_type) about this
    // order, so applying it can charge the right order.
    absl::StatusOr<outbox::v1::LegacyOrderPayload> p =
        outbox::consumer::DecodeOrderPayload(e);
    Require(p.ok() && p->has_order_paid());
    Require(p->order_paid().order_id() == c.aggregate_id);
    Require(p->order_paid().amount_cents() >= 0);
  }
  return 0;
}
