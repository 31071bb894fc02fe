// Fuzzes the decoding of an outbox row's payload (arbitrary bytes in the
// payload column, as a corrupt or foreign row would hold): the envelope
// always comes from the columns, a payload that parses survives a round
// trip, and neither the inbox's envelope checks nor the billing handler's
// validation (which also decodes the order payload, current or legacy)
// ever crashes on the result.

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
  outbox::v1::Event e;
  const bool parsed = outbox::relay::DecodeEvent(
      c, absl::string_view(reinterpret_cast<const char*>(data), size), &e);
  Require(e.seq() == c.seq && e.prev_seq() == c.prev_seq);
  Require(e.event_id() == c.event_id && e.aggregate_id() == c.aggregate_id);
  Require(e.event_type() == c.event_type && e.schema_version() == 1);
  if (parsed) {
    outbox::v1::Event again;
    Require(again.ParseFromString(e.SerializeAsString()));
    Require(again.SerializeAsString() == e.SerializeAsString());
  }
  absl::Status s = outbox::inbox::ValidateEnvelope(e);
  Require(s.ok() || s.code() == absl::StatusCode::kInvalidArgument);
  s = outbox::consumer::BillingHandler().Validate(e);
  Require(s.ok() || s.code() == absl::StatusCode::kInvalidArgument);
  return 0;
}
