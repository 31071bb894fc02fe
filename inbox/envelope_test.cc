#include "inbox/envelope.h"

#include <gtest/gtest.h>

#include "google/protobuf/wrappers.pb.h"

namespace outbox::inbox {
namespace {

v1::Event WellFormed() {
  v1::Event e;
  e.set_event_id("6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e");
  e.set_aggregate_type("account");
  e.set_aggregate_id("a-1");
  e.set_seq(10);
  e.set_prev_seq(4);
  e.set_event_type("Deposited");
  e.set_schema_version(1);
  google::protobuf::Int64Value v;
  v.set_value(5);
  e.mutable_payload()->PackFrom(v);
  return e;
}

std::string Reason(void (*mutate)(v1::Event&)) {
  v1::Event e = WellFormed();
  mutate(e);
  absl::Status s = ValidateEnvelope(e);
  return s.ok() ? "ok" : std::string(s.message());
}

TEST(ValidateEnvelope, AcceptsAWellFormedEventOfAnyDomain) {
  EXPECT_EQ(Reason([](v1::Event&) {}), "ok");
  EXPECT_EQ(Reason([](v1::Event& e) { e.clear_payload(); }), "ok");
  EXPECT_EQ(Reason([](v1::Event& e) { e.set_prev_seq(0); }), "ok");
}

TEST(ValidateEnvelope, RejectsNamingTheField) {
  EXPECT_EQ(Reason([](auto& e) { e.clear_event_id(); }),
            "event_id: must be a UUID");
  EXPECT_EQ(Reason([](auto& e) { e.set_event_id("6f1c2b1e"); }),
            "event_id: must be a UUID");
  EXPECT_EQ(Reason([](auto& e) { e.clear_aggregate_type(); }),
            "aggregate_type: must be 1-64 bytes");
  EXPECT_EQ(Reason([](auto& e) { e.clear_aggregate_id(); }),
            "aggregate_id: must be 1-128 bytes");
  EXPECT_EQ(Reason([](auto& e) { e.set_aggregate_id(std::string(129, 'a')); }),
            "aggregate_id: must be 1-128 bytes");
  EXPECT_EQ(Reason([](auto& e) { e.set_seq(0); }),
            "seq: must be positive, got 0");
  EXPECT_EQ(Reason([](auto& e) { e.set_prev_seq(10); }),
            "prev_seq: must be in [0, seq), got 10 with seq 10");
  EXPECT_EQ(Reason([](auto& e) { e.set_prev_seq(-1); }).substr(0, 9),
            "prev_seq:");
  EXPECT_EQ(Reason([](auto& e) { e.clear_event_type(); }),
            "event_type: must be 1-128 bytes");
}

}  // namespace
}  // namespace outbox::inbox
