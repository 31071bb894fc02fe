#include "producer/order_logic.h"

#include <cctype>
#include <climits>
#include <cstdio>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/text.h"

namespace outbox::producer {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

// Counts code points of valid UTF-8; -1 if `s` is not valid UTF-8 (an
// overlong form, a surrogate or a value above U+10FFFF included, which
// PostgreSQL would refuse) or holds a control character (C0, DEL or C1).
int CountCleanChars(absl::string_view s) {
  int count = 0;
  for (size_t i = 0; i < s.size(); ++count) {
    const std::optional<Utf8Char> ch = DecodeUtf8(s, i);
    if (!ch.has_value()) return -1;
    const uint32_t cp = ch->code_point;
    if (cp < 0x20 || (cp >= 0x7f && cp <= 0x9f)) return -1;
    i += ch->length;
  }
  return count;
}

absl::Status CheckText(absl::string_view field, absl::string_view value,
                       int min_chars, int max_chars) {
  int n = CountCleanChars(value);
  if (n < 0) return Invalid(field, "must not contain control characters");
  if (n < min_chars || n > max_chars) {
    return Invalid(field, min_chars > 0
                              ? absl::StrCat("must be ", min_chars, "-",
                                             max_chars, " characters, got ", n)
                              : absl::StrCat("must be at most ", max_chars,
                                             " characters, got ", n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> ValidateCreate(const v1::CreateOrderRequest& req) {
  if (absl::Status s =
          CheckText("customer_id", req.customer_id(), 1, kMaxTextChars);
      !s.ok()) {
    return s;
  }
  if (req.items_size() < 1 || req.items_size() > kMaxItems) {
    return Invalid("items", absl::StrCat("must hold 1-", kMaxItems,
                                         " items, got ", req.items_size()));
  }
  int64_t total = 0;
  for (int i = 0; i < req.items_size(); ++i) {
    const v1::LineItem& item = req.items(i);
    const std::string prefix = absl::StrCat("items[", i, "].");
    if (absl::Status s =
            CheckText(prefix + "sku", item.sku(), 1, kMaxTextChars);
        !s.ok()) {
      return s;
    }
    if (item.quantity() < 1 || item.quantity() > kMaxQuantity) {
      return Invalid(
          prefix + "quantity",
          absl::StrCat("must be 1-", kMaxQuantity, ", got ", item.quantity()));
    }
    if (item.unit_price_cents() < 0 ||
        item.unit_price_cents() > kMaxUnitPriceCents) {
      return Invalid(prefix + "unit_price_cents",
                     absl::StrCat("must be 0-", kMaxUnitPriceCents, ", got ",
                                  item.unit_price_cents()));
    }
    int64_t line = 0;
    if (__builtin_mul_overflow(item.unit_price_cents(),
                               static_cast<int64_t>(item.quantity()), &line) ||
        __builtin_add_overflow(total, line, &total)) {
      return Invalid("items", "the order total overflows");
    }
  }
  const std::string& cur = req.currency();
  if (cur.size() != 3 || !(cur[0] >= 'A' && cur[0] <= 'Z') ||
      !(cur[1] >= 'A' && cur[1] <= 'Z') || !(cur[2] >= 'A' && cur[2] <= 'Z')) {
    return Invalid("currency",
                   absl::StrCat("must be three upper-case letters "
                                "(ISO 4217, e.g. EUR), got \"",
                                cur.size() <= 16 ? cur : "...", "\""));
  }
  if (absl::Status s = CheckText("idempotency_key", req.idempotency_key(), 0,
                                 kMaxIdempotencyKeyChars);
      !s.ok()) {
    return s;
  }
  return total;
}

absl::Status ValidateOrderId(const std::string& order_id) {
  if (order_id.empty()) return Invalid("order_id", "is required");
  if (!IsUuid(order_id)) return Invalid("order_id", "must be a UUID");
  return absl::OkStatus();
}

absl::Status ValidatePay(const v1::PayOrderRequest& req) {
  if (absl::Status s = ValidateOrderId(req.order_id()); !s.ok()) return s;
  if (req.expected_version() < 0) {
    return Invalid("expected_version", "must not be negative");
  }
  if (req.amount_cents() < 0) {
    return Invalid("amount_cents", "must not be negative");
  }
  return absl::OkStatus();
}

absl::Status ValidateCancel(const v1::CancelOrderRequest& req) {
  if (absl::Status s = ValidateOrderId(req.order_id()); !s.ok()) return s;
  if (req.expected_version() < 0) {
    return Invalid("expected_version", "must not be negative");
  }
  return CheckText("reason", req.reason(), 0, kMaxReasonChars);
}

absl::Status CheckVersion(int64_t expected, int64_t actual) {
  if (expected != 0 && expected != actual) {
    return absl::AbortedError(
        absl::StrCat("expected_version: the order is at version ", actual,
                     ", not ", expected, "; read it again and retry"));
  }
  return absl::OkStatus();
}

absl::Status CheckTransition(v1::OrderStatus from, v1::OrderStatus to) {
  const bool ok =
      (from == v1::ORDER_STATUS_CREATED &&
       (to == v1::ORDER_STATUS_PAID || to == v1::ORDER_STATUS_CANCELLED)) ||
      (from == v1::ORDER_STATUS_PAID && to == v1::ORDER_STATUS_CANCELLED);
  if (ok) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the order is ", StatusName(from), "; it cannot become ",
                   StatusName(to)));
}

std::string StatusName(v1::OrderStatus s) {
  switch (s) {
    case v1::ORDER_STATUS_CREATED:
      return "CREATED";
    case v1::ORDER_STATUS_PAID:
      return "PAID";
    case v1::ORDER_STATUS_CANCELLED:
      return "CANCELLED";
    default:
      return "UNSPECIFIED";
  }
}

v1::OrderStatus StatusFromName(absl::string_view name) {
  if (name == "CREATED") return v1::ORDER_STATUS_CREATED;
  if (name == "PAID") return v1::ORDER_STATUS_PAID;
  if (name == "CANCELLED") return v1::ORDER_STATUS_CANCELLED;
  return v1::ORDER_STATUS_UNSPECIFIED;
}

std::string RequestFingerprint(const v1::CreateOrderRequest& req) {
  // Field by field rather than serialized bytes, so the fingerprint does not
  // depend on the protobuf library's output.
  std::string canonical = absl::StrCat(req.customer_id().size(), ":",
                                       req.customer_id(), "|", req.currency());
  for (const v1::LineItem& item : req.items()) {
    absl::StrAppend(&canonical, "|", item.sku().size(), ":", item.sku(), "x",
                    item.quantity(), "@", item.unit_price_cents());
  }
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : canonical) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx",
                static_cast<unsigned long long>(h));
  return buf;
}

std::string ItemsJson(
    const google::protobuf::RepeatedPtrField<v1::LineItem>& items) {
  std::string out = "[";
  for (int i = 0; i < items.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", "{\"sku\":\"",
                    JsonEscape(items[i].sku()),
                    "\",\"quantity\":", items[i].quantity(),
                    ",\"unitPriceCents\":", items[i].unit_price_cents(), "}");
  }
  return out + "]";
}

namespace {

// A cursor over JSON text; each Take* consumes what it reads.
class JsonCursor {
 public:
  explicit JsonCursor(absl::string_view s) : s_(s) {}
  void Space() {
    while (!s_.empty() &&
           (s_[0] == ' ' || s_[0] == '\n' || s_[0] == '\t' || s_[0] == '\r')) {
      s_.remove_prefix(1);
    }
  }
  bool Take(char c) {
    Space();
    if (s_.empty() || s_[0] != c) return false;
    s_.remove_prefix(1);
    return true;
  }
  bool TakeString(std::string* out) {
    if (!Take('"')) return false;
    out->clear();
    while (!s_.empty() && s_[0] != '"') {
      char c = s_[0];
      s_.remove_prefix(1);
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (s_.empty()) return false;
      c = s_[0];
      s_.remove_prefix(1);
      switch (c) {
        case '"':
        case '\\':
        case '/':
          out->push_back(c);
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          uint32_t cp;
          if (!Hex4(&cp)) return false;
          if (cp >= 0xD800 && cp < 0xDC00) {  // a surrogate pair
            uint32_t low;
            if (!absl::ConsumePrefix(&s_, "\\u") || !Hex4(&low) ||
                low < 0xDC00 || low > 0xDFFF) {
              return false;
            }
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          Utf8(cp, out);
          break;
        }
        default:
          return false;
      }
    }
    return Take('"');
  }
  bool TakeInt(int64_t* out) {
    Space();
    size_t n = 0;
    while (n < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[n])) ||
                             (n == 0 && s_[n] == '-'))) {
      ++n;
    }
    if (!absl::SimpleAtoi(s_.substr(0, n), out)) return false;
    s_.remove_prefix(n);
    return true;
  }
  bool AtEnd() {
    Space();
    return s_.empty();
  }

 private:
  bool Hex4(uint32_t* out) {
    if (s_.size() < 4) return false;
    *out = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[i];
      *out <<= 4;
      if (c >= '0' && c <= '9')
        *out |= c - '0';
      else if (c >= 'a' && c <= 'f')
        *out |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        *out |= c - 'A' + 10;
      else
        return false;
    }
    s_.remove_prefix(4);
    return true;
  }
  static void Utf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  absl::string_view s_;
};

}  // namespace

absl::Status ParseItemsJson(
    absl::string_view json,
    google::protobuf::RepeatedPtrField<v1::LineItem>* items) {
  items->Clear();
  const absl::Status bad =
      absl::InvalidArgumentError("items: not the stored form");
  JsonCursor in(json);
  if (!in.Take('[')) return bad;
  if (in.Take(']')) return in.AtEnd() ? absl::OkStatus() : bad;
  do {
    if (!in.Take('{')) return bad;
    v1::LineItem* item = items->Add();
    std::string key;
    do {
      if (!in.TakeString(&key) || !in.Take(':')) return bad;
      int64_t n = 0;
      if (key == "sku") {
        if (!in.TakeString(item->mutable_sku())) return bad;
      } else if (key == "quantity" && in.TakeInt(&n) && n >= INT32_MIN &&
                 n <= INT32_MAX) {
        item->set_quantity(static_cast<int32_t>(n));
      } else if (key == "unitPriceCents" && in.TakeInt(&n)) {
        item->set_unit_price_cents(n);
      } else {
        return bad;
      }
    } while (in.Take(','));
    if (!in.Take('}')) return bad;
  } while (in.Take(','));
  if (!in.Take(']') || !in.AtEnd()) return bad;
  return absl::OkStatus();
}

}  // namespace outbox::producer
