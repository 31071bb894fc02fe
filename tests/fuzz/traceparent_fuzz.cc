// Fuzzes the identifier parsers shared by the services: the W3C
// traceparent a caller sends, UUIDs, and the partition of an aggregate id.
// Each parser accepts exactly what an independent model of its format
// accepts (W3C trace context version 00: lower-case hex only, ids not all
// zero; RFC 4122's 8-4-4-4-12 hex form), and the trace id the logs carry
// (TraceIdOf) is there exactly when the producer would store the
// traceparent (IsTraceParent).

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/ids.h"
#include "common/log.h"

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

bool LowerHex(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
}
bool AnyHex(char c) { return LowerHex(c) || (c >= 'A' && c <= 'F'); }

// "00-" 32 lower hex "-" 16 lower hex "-" 2 lower hex, ids not all zero.
bool ModelTraceParent(const std::string& s) {
  if (s.size() != 55) return false;
  bool trace_zero = true, parent_zero = true;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (i == 0 || i == 1) {
      if (c != '0') return false;
    } else if (i == 2 || i == 35 || i == 52) {
      if (c != '-') return false;
    } else if (!LowerHex(c)) {
      return false;
    } else if (i < 35) {
      trace_zero &= c == '0';
    } else if (i < 52) {
      parent_zero &= c == '0';
    }
  }
  return !trace_zero && !parent_zero;
}

bool ModelUuid(const std::string& s) {
  if (s.size() != 36) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash != (s[i] == '-')) return false;
    if (!dash && !AnyHex(s[i])) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string s(reinterpret_cast<const char*>(data), size);
  const bool trace = outbox::IsTraceParent(s);
  Require(trace == ModelTraceParent(s));
  Require(outbox::TraceIdOf(s) == (trace ? s.substr(3, 32) : std::string()));
  Require(outbox::IsUuid(s) == ModelUuid(s));
  const int p = outbox::PartitionOf(s);
  Require(p >= 0 && p < outbox::kPartitionCount);
  Require(p == outbox::PartitionOf(s));
  return 0;
}
