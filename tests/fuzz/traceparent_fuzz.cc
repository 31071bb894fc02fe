// Fuzzes the identifier parsers shared by the services: the W3C
// traceparent a caller sends, UUIDs, and the partition of an aggregate id.
// Whatever they accept has the exact form the rest of the code assumes.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/ids.h"

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

bool Hex(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') ||
         (c >= 'A' && c <= 'F');
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string s(reinterpret_cast<const char*>(data), size);
  if (outbox::IsTraceParent(s)) {
    Require(s.size() == 55 && s.compare(0, 3, "00-") == 0);
    Require(s[35] == '-' && s[52] == '-');
    for (size_t i : {size_t{3}, size_t{36}, size_t{53}}) Require(Hex(s[i]));
    Require(s.substr(3, 32) != std::string(32, '0'));
    Require(s.substr(36, 16) != std::string(16, '0'));
  }
  if (outbox::IsUuid(s)) {
    Require(s.size() == 36 && s[8] == '-' && s[13] == '-' && s[18] == '-' &&
            s[23] == '-');
  }
  const int p = outbox::PartitionOf(s);
  Require(p >= 0 && p < outbox::kPartitionCount);
  Require(p == outbox::PartitionOf(s));
  return 0;
}
