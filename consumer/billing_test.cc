// The billing handler's rules for order events, without a database.

#include "consumer/billing.h"

#include <gtest/gtest.h>

#include "google/protobuf/wrappers.pb.h"

namespace outbox::consumer {
namespace {

constexpr char kOrder[] = "0b9f6f1e-1111-4222-8333-444455556666";

v1::Event Paid() {
  v1::Event e;
  e.set_event_id("6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e");
  e.set_aggregate_type("order");
  e.set_aggregate_id(kOrder);
  e.set_seq(10);
  e.set_prev_seq(4);
  e.set_event_type("OrderPaid");
  e.set_schema_version(1);
  v1::OrderPaid paid;
  paid.set_order_id(kOrder);
  paid.set_amount_cents(100);
  e.mutable_payload()->PackFrom(paid);
  return e;
}

std::string Reason(void (*mutate)(v1::Event&)) {
  v1::Event e = Paid();
  mutate(e);
  absl::Status s = BillingHandler().Validate(e);
  return s.ok() ? "ok" : std::string(s.message());
}

TEST(BillingValidate, AcceptsAWellFormedOrderEvent) {
  EXPECT_EQ(Reason([](v1::Event&) {}), "ok");
}

TEST(BillingValidate, RejectsWithAReason) {
  EXPECT_EQ(Reason([](auto& e) { e.set_schema_version(2); }),
            "schema_version: 2 is not supported (1 is)");
  EXPECT_EQ(Reason([](auto& e) { e.set_event_type("OrderShipped"); }),
            "event_type: unknown type \"OrderShipped\"");
  EXPECT_EQ(Reason([](auto& e) { e.clear_payload(); }),
            "payload: OrderPaid without its payload");
  EXPECT_EQ(Reason([](auto& e) {
              v1::OrderCancelled c;
              c.set_order_id(kOrder);
              e.mutable_payload()->PackFrom(c);
            }),
            "payload: OrderPaid expected, got "
            "\"type.googleapis.com/outbox.v1.OrderCancelled\" (or it does "
            "not parse)");
  EXPECT_EQ(Reason([](auto& e) {
              google::protobuf::StringValue junk;
              junk.set_value("x");
              e.mutable_payload()->PackFrom(junk);
              // Same type URL as expected, bytes that do not parse as it.
              e.mutable_payload()->set_type_url(
                  "type.googleapis.com/outbox.v1.OrderPaid");
              e.mutable_payload()->set_value("\xff\xff\xff");
            }).substr(0, 30),
            "payload: OrderPaid expected, g");
  EXPECT_EQ(Reason([](auto& e) {
              v1::OrderPaid p;
              p.set_order_id("someone-else");
              e.mutable_payload()->PackFrom(p);
            }),
            "payload: order_id does not match aggregate_id");
  EXPECT_EQ(Reason([](auto& e) {
              v1::OrderPaid p;
              p.set_order_id(kOrder);
              p.set_amount_cents(-1);
              e.mutable_payload()->PackFrom(p);
            }),
            "payload: negative amount");
  EXPECT_EQ(
      Reason([](auto& e) { e.set_aggregate_type("invoice"); }).substr(0, 15),
      "aggregate_type:");
}

// An event written before the envelope was domain-free: the payload in
// field 11 (order_paid), as that release serialized it.
TEST(BillingValidate, ReadsEventsOfTheEarlierEnvelope) {
  v1::Event e = Paid();
  e.clear_payload();
  v1::LegacyOrderPayload legacy;
  legacy.mutable_order_paid()->set_order_id(kOrder);
  legacy.mutable_order_paid()->set_amount_cents(250);
  v1::Event old;
  ASSERT_TRUE(
      old.ParseFromString(e.SerializeAsString() + legacy.SerializeAsString()));
  EXPECT_TRUE(BillingHandler().Validate(old).ok());
  auto decoded = DecodeOrderPayload(old);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->order_paid().amount_cents(), 250);
  // The relay passes such an event on unchanged: it survives a round trip.
  v1::Event relayed;
  ASSERT_TRUE(relayed.ParseFromString(old.SerializeAsString()));
  EXPECT_EQ(DecodeOrderPayload(relayed)->order_paid().amount_cents(), 250);
  // Its type must match its payload there too.
  old.set_event_type("OrderCreated");
  EXPECT_EQ(BillingHandler().Validate(old).message(),
            "payload: OrderCreated without its payload");
}

}  // namespace
}  // namespace outbox::consumer
