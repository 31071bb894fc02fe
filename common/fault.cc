#include "common/fault.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace outbox {
namespace {

// Parsed once from OUTBOX_FAULT; read-only afterwards.
const std::map<std::string, double>* Armed() {
  static const std::map<std::string, double>* armed = [] {
    auto* m = new std::map<std::string, double>();
    const char* spec = std::getenv("OUTBOX_FAULT");
    if (spec == nullptr) return m;
    for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(item, ':');
      double p = 0;
      if (!absl::SimpleAtod(kv.second, &p) || p < 0 || p > 1) {
        std::fprintf(stderr, "OUTBOX_FAULT: bad probability in \"%s\"\n",
                     std::string(item).c_str());
        std::exit(2);
      }
      (*m)[kv.first] = p;
    }
    return m;
  }();
  return armed;
}

}  // namespace

void MaybeCrash(const char* point) {
  const auto* armed = Armed();
  if (armed->empty()) return;
  auto it = armed->find(point);
  if (it == armed->end()) return;
  thread_local absl::BitGen gen;
  if (absl::Bernoulli(gen, it->second)) {
    std::fprintf(stderr, "OUTBOX_FAULT: crashing at %s\n", point);
    std::fflush(stderr);
    kill(getpid(), SIGKILL);
  }
}

}  // namespace outbox
