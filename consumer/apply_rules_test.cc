#include "consumer/apply_rules.h"

#include <gtest/gtest.h>

namespace outbox::consumer {
namespace {

v1::Event Paid() {
  v1::Event e;
  e.set_event_id("6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e");
  e.set_aggregate_type("order");
  e.set_aggregate_id("0b9f6f1e-1111-4222-8333-444455556666");
  e.set_seq(10);
  e.set_prev_seq(4);
  e.set_event_type("OrderPaid");
  e.set_schema_version(1);
  e.mutable_order_paid()->set_order_id(e.aggregate_id());
  e.mutable_order_paid()->set_amount_cents(100);
  return e;
}

std::string Reason(void (*mutate)(v1::Event&)) {
  v1::Event e = Paid();
  mutate(e);
  absl::Status s = ValidateEvent(e);
  return s.ok() ? "ok" : std::string(s.message());
}

TEST(ValidateEvent, AcceptsAWellFormedEvent) {
  EXPECT_EQ(Reason([](v1::Event&) {}), "ok");
}

TEST(ValidateEvent, RejectsWithAReason) {
  EXPECT_EQ(Reason([](auto& e) { e.clear_event_id(); }),
            "event_id: must be a UUID");
  EXPECT_EQ(Reason([](auto& e) { e.clear_aggregate_id(); }).substr(0, 13),
            "aggregate_id:");
  EXPECT_EQ(Reason([](auto& e) { e.set_seq(0); }).substr(0, 4), "seq:");
  EXPECT_EQ(Reason([](auto& e) { e.set_prev_seq(10); }).substr(0, 9),
            "prev_seq:");
  EXPECT_EQ(Reason([](auto& e) { e.set_schema_version(2); }).substr(0, 15),
            "schema_version:");
  EXPECT_EQ(Reason([](auto& e) { e.set_event_type("OrderShipped"); }),
            "event_type: unknown type \"OrderShipped\"");
  EXPECT_EQ(Reason([](auto& e) { e.clear_order_paid(); }),
            "payload: OrderPaid without its payload");
  EXPECT_EQ(Reason([](auto& e) { e.mutable_order_cancelled(); }),
            "payload: OrderPaid without its payload");
  EXPECT_EQ(Reason([](auto& e) {
              e.mutable_order_paid()->set_order_id("someone-else");
            }),
            "payload: order_id does not match aggregate_id");
  EXPECT_EQ(Reason([](auto& e) { e.set_aggregate_type("invoice"); })
                .substr(0, 15),
            "aggregate_type:");
}

}  // namespace
}  // namespace outbox::consumer
