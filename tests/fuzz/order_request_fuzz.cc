// Fuzzes the producer's request validation with arbitrary wire bytes: the
// first byte picks the request (CreateOrder, PayOrder, CancelOrder,
// GetOrder), the rest is parsed as its protobuf. For each, validation
// accepts exactly what an independent model of the documented limits
// accepts (producer/order_logic.h: text that is well-formed UTF-8 without
// control characters and within its length in code points, item counts,
// quantities, prices, an upper-case ISO currency, UUID order ids,
// non-negative versions and amounts), and a refusal is INVALID_ARGUMENT
// naming the first field the model finds bad. What CreateOrder accepts has
// the exact total of its items, and its idempotency fingerprint is the same
// for an equal request (however built, whatever its key) and differs when
// any field that matters changes.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "producer/order_logic.h"

namespace {

namespace p = outbox::producer;

// Fails the run, saying which property broke.
#define Require(cond)                                                   \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "%s:%d: violated: %s\n", __FILE__, __LINE__, \
                   #cond);                                              \
      std::abort();                                                     \
    }                                                                   \
  } while (0)

// Code points of `s` if it is well-formed UTF-8 (the byte ranges of the
// Unicode standard's table 3-7: no overlong forms, no surrogates, nothing
// above U+10FFFF) without a C0 control, DEL or a C1 control; else -1.
int ModelCleanChars(const std::string& s) {
  int n = 0;
  for (size_t i = 0; i < s.size(); ++n) {
    const auto b = [&](size_t k) {
      return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0x100;
    };
    const auto in = [](unsigned v, unsigned lo, unsigned hi) {
      return v >= lo && v <= hi;
    };
    const unsigned c = b(0);
    if (c < 0x20 || c == 0x7f) return -1;
    if (c < 0x80) {
      i += 1;
    } else if (c == 0xc2 && in(b(1), 0x80, 0x9f)) {
      return -1;  // U+0080-U+009F: C1 controls
    } else if (in(c, 0xc2, 0xdf) && in(b(1), 0x80, 0xbf)) {
      i += 2;
    } else if ((c == 0xe0 && in(b(1), 0xa0, 0xbf) && in(b(2), 0x80, 0xbf)) ||
               ((in(c, 0xe1, 0xec) || in(c, 0xee, 0xef)) &&
                in(b(1), 0x80, 0xbf) && in(b(2), 0x80, 0xbf)) ||
               (c == 0xed && in(b(1), 0x80, 0x9f) && in(b(2), 0x80, 0xbf))) {
      i += 3;
    } else if ((c == 0xf0 && in(b(1), 0x90, 0xbf) && in(b(2), 0x80, 0xbf) &&
                in(b(3), 0x80, 0xbf)) ||
               (in(c, 0xf1, 0xf3) && in(b(1), 0x80, 0xbf) &&
                in(b(2), 0x80, 0xbf) && in(b(3), 0x80, 0xbf)) ||
               (c == 0xf4 && in(b(1), 0x80, 0x8f) && in(b(2), 0x80, 0xbf) &&
                in(b(3), 0x80, 0xbf))) {
      i += 4;
    } else {
      return -1;
    }
  }
  return n;
}

bool TextOk(const std::string& s, int min_chars, int max_chars) {
  const int n = ModelCleanChars(s);
  return n >= min_chars && n <= max_chars;
}

bool ModelUuid(const std::string& s) {
  if (s.size() != 36) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    const bool hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') ||
                     (c >= 'A' && c <= 'F');
    if (dash ? c != '-' : !hex) return false;
  }
  return true;
}

// The first field the model refuses, "" if it accepts.
std::string FirstBadCreateField(const outbox::v1::CreateOrderRequest& req) {
  if (!TextOk(req.customer_id(), 1, 64)) return "customer_id";
  if (req.items_size() < 1 || req.items_size() > 100) return "items";
  for (int i = 0; i < req.items_size(); ++i) {
    const auto& item = req.items(i);
    const std::string at = absl::StrCat("items[", i, "].");
    if (!TextOk(item.sku(), 1, 64)) return at + "sku";
    if (item.quantity() < 1 || item.quantity() > 10000) return at + "quantity";
    if (item.unit_price_cents() < 0 || item.unit_price_cents() > 1000000000) {
      return at + "unit_price_cents";
    }
  }
  const std::string& c = req.currency();
  if (c.size() != 3) return "currency";
  for (char ch : c) {
    if (ch < 'A' || ch > 'Z') return "currency";
  }
  if (!TextOk(req.idempotency_key(), 0, 128)) return "idempotency_key";
  return "";
}

// A refusal: INVALID_ARGUMENT, its message "<field>: why".
void RequireRefusal(const absl::Status& s, const std::string& field) {
  Require(s.code() == absl::StatusCode::kInvalidArgument);
  Require(absl::StartsWith(s.message(), field + ": "));
  Require(s.message().size() > field.size() + 2);
}

void CheckCreate(const outbox::v1::CreateOrderRequest& req) {
  const absl::StatusOr<int64_t> total = p::ValidateCreate(req);
  const std::string bad = FirstBadCreateField(req);
  if (!bad.empty()) {
    Require(!total.ok());
    RequireRefusal(total.status(), bad);
    return;
  }
  Require(total.ok());
  __int128 sum = 0;
  for (const auto& item : req.items()) {
    sum += static_cast<__int128>(item.quantity()) * item.unit_price_cents();
  }
  Require(sum == *total);

  // Equal requests, however built and whatever their key, share the
  // fingerprint (the idempotency key is what names the request).
  const std::string fp = p::RequestFingerprint(req);
  outbox::v1::CreateOrderRequest rebuilt;
  rebuilt.set_customer_id(req.customer_id());
  rebuilt.set_currency(req.currency());
  for (const auto& item : req.items()) {
    auto* copy = rebuilt.add_items();
    copy->set_sku(item.sku());
    copy->set_quantity(item.quantity());
    copy->set_unit_price_cents(item.unit_price_cents());
  }
  rebuilt.set_idempotency_key(req.idempotency_key() + "-other");
  Require(p::RequestFingerprint(rebuilt) == fp);
  outbox::v1::CreateOrderRequest reparsed;
  Require(reparsed.ParseFromString(req.SerializeAsString()));
  Require(p::RequestFingerprint(reparsed) == fp);

  // Any field that makes it another order changes it.
  auto differs = [&](const outbox::v1::CreateOrderRequest& other) {
    return p::RequestFingerprint(other) != fp;
  };
  outbox::v1::CreateOrderRequest m = rebuilt;
  m.set_customer_id(req.customer_id() + "x");
  Require(differs(m));
  m = rebuilt;
  m.set_currency(std::string(1, req.currency()[0] == 'Z' ? 'A' : 'Z') +
                 req.currency().substr(1));
  Require(differs(m));
  const int last = req.items_size() - 1;
  m = rebuilt;
  m.mutable_items(last)->set_sku(req.items(last).sku() + "x");
  Require(differs(m));
  m = rebuilt;
  m.mutable_items(last)->set_quantity(req.items(last).quantity() + 1);
  Require(differs(m));
  m = rebuilt;
  m.mutable_items(last)->set_unit_price_cents(
      req.items(last).unit_price_cents() + 1);
  Require(differs(m));
  m = rebuilt;
  *m.add_items() = req.items(last);
  Require(differs(m));
  if (last > 0) {
    m = rebuilt;
    m.mutable_items()->RemoveLast();
    Require(differs(m));
  }
  // The boundary between two fields cannot be moved without a change:
  // customer "ab" + sku "c" is not customer "a" + sku "bc".
  if (!req.customer_id().empty()) {
    m = rebuilt;
    m.set_customer_id(
        req.customer_id().substr(0, req.customer_id().size() - 1));
    m.mutable_items(0)->set_sku(req.customer_id().back() + req.items(0).sku());
    Require(differs(m));
  }
}

void CheckPay(const outbox::v1::PayOrderRequest& req) {
  const absl::Status s = p::ValidatePay(req);
  std::string bad;
  if (!ModelUuid(req.order_id())) {
    bad = "order_id";
  } else if (req.expected_version() < 0) {
    bad = "expected_version";
  } else if (req.amount_cents() < 0) {
    bad = "amount_cents";
  }
  if (bad.empty()) {
    Require(s.ok());
  } else {
    RequireRefusal(s, bad);
  }
}

void CheckCancel(const outbox::v1::CancelOrderRequest& req) {
  const absl::Status s = p::ValidateCancel(req);
  std::string bad;
  if (!ModelUuid(req.order_id())) {
    bad = "order_id";
  } else if (req.expected_version() < 0) {
    bad = "expected_version";
  } else if (!TextOk(req.reason(), 0, 500)) {
    bad = "reason";
  }
  if (bad.empty()) {
    Require(s.ok());
  } else {
    RequireRefusal(s, bad);
  }
}

void CheckGet(const outbox::v1::GetOrderRequest& req) {
  const absl::Status s = p::ValidateOrderId(req.order_id());
  if (ModelUuid(req.order_id())) {
    Require(s.ok());
  } else {
    RequireRefusal(s, "order_id");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const char* body = reinterpret_cast<const char*>(data + 1);
  const int n = static_cast<int>(size - 1);
  switch (data[0] % 4) {
    case 0: {
      outbox::v1::CreateOrderRequest req;
      if (req.ParseFromArray(body, n)) CheckCreate(req);
      break;
    }
    case 1: {
      outbox::v1::PayOrderRequest req;
      if (req.ParseFromArray(body, n)) CheckPay(req);
      break;
    }
    case 2: {
      outbox::v1::CancelOrderRequest req;
      if (req.ParseFromArray(body, n)) CheckCancel(req);
      break;
    }
    default: {
      outbox::v1::GetOrderRequest req;
      if (req.ParseFromArray(body, n)) CheckGet(req);
    }
  }
  return 0;
}
