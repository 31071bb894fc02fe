#include "producer/order_logic.h"

#include <gtest/gtest.h>

namespace outbox::producer {
namespace {

using v1::CreateOrderRequest;

CreateOrderRequest Valid() {
  CreateOrderRequest r;
  r.set_customer_id("customer-1");
  r.set_currency("EUR");
  auto* i = r.add_items();
  i->set_sku("book");
  i->set_quantity(2);
  i->set_unit_price_cents(1250);
  auto* j = r.add_items();
  j->set_sku("pen");
  j->set_quantity(3);
  j->set_unit_price_cents(99);
  return r;
}

// The status of validating Valid() after `mutate`.
absl::Status CreateStatus(void (*mutate)(CreateOrderRequest&)) {
  CreateOrderRequest r = Valid();
  mutate(r);
  return ValidateCreate(r).status();
}

void ExpectInvalid(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message().substr(0, field.size() + 1), field + ":") << s;
}

TEST(ValidateCreate, ComputesTheTotal) {
  auto total = ValidateCreate(Valid());
  ASSERT_TRUE(total.ok()) << total.status();
  EXPECT_EQ(*total, 2 * 1250 + 3 * 99);
}

TEST(ValidateCreate, NamesTheBadField) {
  ExpectInvalid(CreateStatus([](auto& r) { r.clear_customer_id(); }),
                "customer_id");
  ExpectInvalid(
      CreateStatus([](auto& r) { r.set_customer_id(std::string(65, 'c')); }),
      "customer_id");
  ExpectInvalid(CreateStatus([](auto& r) { r.set_customer_id("a\nb"); }),
                "customer_id");
  ExpectInvalid(CreateStatus([](auto& r) { r.set_customer_id("a\x7f"); }),
                "customer_id");
  ExpectInvalid(CreateStatus([](auto& r) { r.set_customer_id("\xc2\x85"); }),
                "customer_id");  // NEL, a C1 control
  // Not UTF-8 at all, though each decodes to a printable value: an
  // overlong "/", a surrogate, a value above U+10FFFF. PostgreSQL refuses
  // them, so validation must.
  ExpectInvalid(
      CreateStatus([](auto& r) { r.set_customer_id("\xe0\x80\xaf"); }),
      "customer_id");
  ExpectInvalid(
      CreateStatus([](auto& r) { r.set_customer_id("\xed\xa0\x80"); }),
      "customer_id");
  ExpectInvalid(
      CreateStatus([](auto& r) { r.set_customer_id("\xf4\x90\x80\x80"); }),
      "customer_id");
  EXPECT_TRUE(ValidateCreate([] {
                auto r = Valid();
                r.set_customer_id("\xc3\xa9\xe2\x82\xac\xf0\x9f\x93\xa6");
                return r;
              }())
                  .ok());  // é € 📦
  ExpectInvalid(CreateStatus([](auto& r) { r.clear_items(); }), "items");
  ExpectInvalid(CreateStatus([](auto& r) {
                  for (int i = 0; i < 99; ++i) *r.add_items() = r.items(0);
                }),
                "items");
  ExpectInvalid(CreateStatus([](auto& r) { r.mutable_items(1)->clear_sku(); }),
                "items[1].sku");
  ExpectInvalid(CreateStatus([](auto& r) {
                  r.mutable_items(0)->set_sku(std::string(65, 's'));
                }),
                "items[0].sku");
  ExpectInvalid(
      CreateStatus([](auto& r) { r.mutable_items(0)->set_quantity(0); }),
      "items[0].quantity");
  ExpectInvalid(
      CreateStatus([](auto& r) { r.mutable_items(0)->set_quantity(10001); }),
      "items[0].quantity");
  ExpectInvalid(CreateStatus([](auto& r) {
                  r.mutable_items(1)->set_unit_price_cents(-1);
                }),
                "items[1].unit_price_cents");
  ExpectInvalid(CreateStatus([](auto& r) {
                  r.mutable_items(1)->set_unit_price_cents(1000000001);
                }),
                "items[1].unit_price_cents");
  ExpectInvalid(CreateStatus([](auto& r) { r.set_currency("eur"); }),
                "currency");
  ExpectInvalid(CreateStatus([](auto& r) { r.set_currency("EURO"); }),
                "currency");
  ExpectInvalid(CreateStatus([](auto& r) { r.clear_currency(); }), "currency");
  ExpectInvalid(CreateStatus([](auto& r) {
                  r.set_idempotency_key(std::string(129, 'k'));
                }),
                "idempotency_key");
}

TEST(ValidateCreate, LimitsAreInclusive) {
  EXPECT_TRUE(CreateStatus([](auto& r) {
                r.set_customer_id(std::string(64, 'c'));
                r.mutable_items(0)->set_quantity(10000);
                r.mutable_items(0)->set_unit_price_cents(1000000000);
                r.mutable_items(1)->set_unit_price_cents(0);
                r.set_idempotency_key(std::string(128, 'k'));
              }).ok());
  // 64 characters, 128 bytes: limits count characters, not bytes.
  std::string wide;
  for (int i = 0; i < 64; ++i) wide += "\xc3\xa9";
  CreateOrderRequest r = Valid();
  r.set_customer_id(wide);
  EXPECT_TRUE(ValidateCreate(r).ok());
}

TEST(ValidateCreate, LargestOrderDoesNotOverflow) {
  CreateOrderRequest r = Valid();
  r.clear_items();
  for (int i = 0; i < kMaxItems; ++i) {
    auto* item = r.add_items();
    item->set_sku("x");
    item->set_quantity(kMaxQuantity);
    item->set_unit_price_cents(kMaxUnitPriceCents);
  }
  auto total = ValidateCreate(r);
  ASSERT_TRUE(total.ok()) << total.status();
  EXPECT_EQ(*total, int64_t{kMaxItems} * kMaxQuantity * kMaxUnitPriceCents);
}

TEST(ValidateIds, OrderIdMustBeAUuid) {
  ExpectInvalid(ValidateOrderId(""), "order_id");
  ExpectInvalid(ValidateOrderId("42"), "order_id");
  EXPECT_TRUE(ValidateOrderId("123e4567-e89b-42d3-a456-426614174000").ok());
  v1::PayOrderRequest pay;
  pay.set_order_id("123e4567-e89b-42d3-a456-426614174000");
  pay.set_expected_version(-1);
  ExpectInvalid(ValidatePay(pay), "expected_version");
  pay.set_expected_version(1);
  pay.set_amount_cents(-5);
  ExpectInvalid(ValidatePay(pay), "amount_cents");
  v1::CancelOrderRequest cancel;
  cancel.set_order_id("123e4567-e89b-42d3-a456-426614174000");
  cancel.set_reason(std::string(501, 'r'));
  ExpectInvalid(ValidateCancel(cancel), "reason");
}

TEST(StateMachine, AllowsOnlyTheDocumentedTransitions) {
  using v1::OrderStatus;
  const OrderStatus all[] = {v1::ORDER_STATUS_CREATED, v1::ORDER_STATUS_PAID,
                             v1::ORDER_STATUS_CANCELLED};
  for (OrderStatus from : all) {
    for (OrderStatus to : all) {
      bool allowed =
          (from == v1::ORDER_STATUS_CREATED &&
           to != v1::ORDER_STATUS_CREATED) ||
          (from == v1::ORDER_STATUS_PAID && to == v1::ORDER_STATUS_CANCELLED);
      absl::Status s = CheckTransition(from, to);
      EXPECT_EQ(s.ok(), allowed) << StatusName(from) << "->" << StatusName(to);
      if (!allowed) {
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
      }
    }
  }
}

TEST(StateMachine, VersionZeroSkipsTheCheck) {
  EXPECT_TRUE(CheckVersion(0, 7).ok());
  EXPECT_TRUE(CheckVersion(7, 7).ok());
  EXPECT_EQ(CheckVersion(6, 7).code(), absl::StatusCode::kAborted);
}

TEST(Fingerprint, DependsOnEveryFieldButTheKey) {
  CreateOrderRequest a = Valid(), b = Valid();
  b.set_idempotency_key("k");
  EXPECT_EQ(RequestFingerprint(a), RequestFingerprint(b));
  b.mutable_items(1)->set_quantity(4);
  EXPECT_NE(RequestFingerprint(a), RequestFingerprint(b));
  // Field boundaries count: ("ab","c") differs from ("a","bc").
  CreateOrderRequest c = Valid(), d = Valid();
  c.set_customer_id("ab");
  d.set_customer_id("a");
  c.mutable_items(0)->set_sku("c");
  d.mutable_items(0)->set_sku("bc");
  EXPECT_NE(RequestFingerprint(c), RequestFingerprint(d));
}

TEST(ItemsJson, RoundTripsThroughTheStoredForm) {
  v1::CreateOrderRequest req;
  auto* a = req.add_items();
  a->set_sku("book \"A\" \\ é ✓ \U0001F600\n");
  a->set_quantity(10000);
  a->set_unit_price_cents(1000000000);
  auto* b = req.add_items();
  b->set_sku("pen");
  b->set_quantity(1);
  v1::CreateOrderRequest back;
  ASSERT_TRUE(ParseItemsJson(ItemsJson(req.items()), back.mutable_items()).ok())
      << ItemsJson(req.items());
  EXPECT_EQ(back.SerializeAsString(), req.SerializeAsString());
}

TEST(ItemsJson, ReadsWhatPostgresPrintsBack) {
  // jsonb's own output: spaces, keys by length, escapes as \u for controls.
  v1::CreateOrderRequest back;
  ASSERT_TRUE(
      ParseItemsJson("[{\"sku\": \"a\\u0001\\ud83d\\ude00\", \"quantity\": 2, "
                     "\"unitPriceCents\": 1250}]",
                     back.mutable_items())
          .ok());
  ASSERT_EQ(back.items_size(), 1);
  EXPECT_EQ(back.items(0).sku(), "a\x01\xF0\x9F\x98\x80");
  EXPECT_EQ(back.items(0).quantity(), 2);
  EXPECT_EQ(back.items(0).unit_price_cents(), 1250);
  EXPECT_TRUE(ParseItemsJson("[]", back.mutable_items()).ok());
  EXPECT_EQ(back.items_size(), 0);
}

TEST(ItemsJson, AnythingElseIsRefused) {
  v1::CreateOrderRequest back;
  for (const char* bad :
       {"", "{}", "[", "[{]", "[{\"sku\": 1}]", "[{\"color\": \"red\"}]",
        "[{\"quantity\": 99999999999}]", "[] x", "[{\"sku\": \"\\ud800\"}]"}) {
    EXPECT_FALSE(ParseItemsJson(bad, back.mutable_items()).ok()) << bad;
  }
}

}  // namespace
}  // namespace outbox::producer
