#include "common/ids.h"

#include <cstdio>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace outbox {
namespace {

absl::BitGen& Gen() {
  thread_local absl::BitGen gen;
  return gen;
}

std::string RandomHex(int bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes * 2);
  for (int i = 0; i < bytes; ++i) {
    uint8_t b = absl::Uniform<uint8_t>(Gen());
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

// W3C trace context allows lower-case hex only ("4BF9..." is invalid).
bool AllLowerHex(absl::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool AllZero(absl::string_view s) {
  return s.find_first_not_of('0') == absl::string_view::npos;
}

}  // namespace

namespace {

std::string FormatUuid(uint64_t hi, uint64_t lo) {
  char buf[37];
  std::snprintf(buf, sizeof(buf), "%08x-%04x-%04x-%04x-%012llx",
                static_cast<unsigned>(hi >> 32),
                static_cast<unsigned>((hi >> 16) & 0xffff),
                static_cast<unsigned>(hi & 0xffff),
                static_cast<unsigned>(lo >> 48),
                static_cast<unsigned long long>(lo & 0xffffffffffffULL));
  return buf;
}

}  // namespace

std::string NewUuid() {
  uint64_t hi = absl::Uniform<uint64_t>(Gen());
  uint64_t lo = absl::Uniform<uint64_t>(Gen());
  hi = (hi & ~0xf000ULL) | 0x4000ULL;        // version 4
  lo = (lo & ~(3ULL << 62)) | (2ULL << 62);  // RFC 4122 variant
  return FormatUuid(hi, lo);
}

std::string NewTimeOrderedUuid() {
  const uint64_t ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now())) &
                      0xffffffffffffULL;
  uint64_t hi = (ms << 16) | 0x7000ULL |  // version 7
                (absl::Uniform<uint64_t>(Gen()) & 0xfffULL);
  uint64_t lo = absl::Uniform<uint64_t>(Gen());
  lo = (lo & ~(3ULL << 62)) | (2ULL << 62);  // RFC 4122 variant
  return FormatUuid(hi, lo);
}

bool IsUuid(absl::string_view s) {
  if (s.size() != 36) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? s[i] != '-'
             : !absl::ascii_isxdigit(static_cast<unsigned char>(s[i]))) {
      return false;
    }
  }
  return true;
}

bool IsTraceParent(absl::string_view s) {
  if (s.size() != 55 || s[2] != '-' || s[35] != '-' || s[52] != '-') {
    return false;
  }
  absl::string_view version = s.substr(0, 2), trace = s.substr(3, 32),
                    parent = s.substr(36, 16), flags = s.substr(53, 2);
  return version == "00" && AllLowerHex(trace) && AllLowerHex(parent) &&
         AllLowerHex(flags) && !AllZero(trace) && !AllZero(parent);
}

std::string NewTraceParent() {
  return "00-" + RandomHex(16) + "-" + RandomHex(8) + "-01";
}

std::string ChainKey(absl::string_view source, absl::string_view type,
                     absl::string_view id) {
  return absl::StrCat(source.size(), ":", source, type.size(), ":", type, id);
}

namespace {
// Takes "<n>:" and the n bytes after it off the front of `in`.
bool TakeCounted(absl::string_view* in, absl::string_view* out) {
  const size_t colon = in->find(':');
  if (colon == absl::string_view::npos || colon == 0 || colon > 6) return false;
  size_t n = 0;
  for (char ch : in->substr(0, colon)) {
    if (ch < '0' || ch > '9') return false;
    n = n * 10 + static_cast<size_t>(ch - '0');
  }
  if (n > in->size() - colon - 1) return false;
  *out = in->substr(colon + 1, n);
  in->remove_prefix(colon + 1 + n);
  return true;
}
}  // namespace

absl::string_view ChainIdOf(absl::string_view key) {
  ChainView v;
  return ParseChainKey(key, &v) ? v.id : key;
}

bool ParseChainKey(absl::string_view key, ChainView* out) {
  if (!TakeCounted(&key, &out->source) || !TakeCounted(&key, &out->type)) {
    return false;
  }
  out->id = key;
  return true;
}

bool ParseChainKey(absl::string_view key, ChainId* out) {
  ChainView v;
  if (!ParseChainKey(key, &v)) return false;
  out->source.assign(v.source.data(), v.source.size());
  out->type.assign(v.type.data(), v.type.size());
  out->id.assign(v.id.data(), v.id.size());
  return true;
}

bool IsSourceName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char ch : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '.' &&
        ch != '_' && ch != '-') {
      return false;
    }
  }
  return true;
}

std::string ChainLabel(absl::string_view key) {
  ChainId c;
  if (!ParseChainKey(key, &c)) return std::string(key);
  std::string out = c.type.empty() ? c.id : absl::StrCat(c.type, " ", c.id);
  if (!c.source.empty()) absl::StrAppend(&out, " of source ", c.source);
  return out;
}

int PartitionOf(absl::string_view aggregate_id) {
  uint32_t h = 2166136261u;
  for (unsigned char c : aggregate_id) {
    h ^= c;
    h *= 16777619u;
  }
  return static_cast<int>(h % kPartitionCount);
}

void ToTimestamp(absl::Time t, google::protobuf::Timestamp* out) {
  const int64_t micros = absl::ToUnixMicros(t);
  int64_t secs = micros / 1000000;
  int64_t rem = micros % 1000000;
  if (rem < 0) {
    rem += 1000000;
    --secs;
  }
  out->set_seconds(secs);
  out->set_nanos(static_cast<int32_t>(rem * 1000));
}

absl::Time FromTimestamp(const google::protobuf::Timestamp& ts) {
  return absl::FromUnixSeconds(ts.seconds()) + absl::Nanoseconds(ts.nanos());
}

std::string SqlTimestamp(const google::protobuf::Timestamp& ts) {
  return absl::FormatTime("%Y-%m-%d %H:%M:%E6S+00", FromTimestamp(ts),
                          absl::UTCTimeZone());
}

}  // namespace outbox
