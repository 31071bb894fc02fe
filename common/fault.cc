#include "common/fault.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
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
    for (absl::string_view item :
         absl::StrSplit(spec, ',', absl::SkipEmpty())) {
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

// True with probability `p`, from OUTBOX_FAULT_SEED's sequence if set.
bool Draw(double p) {
  static std::mutex mu;
  static std::mt19937_64* seeded = [] {
    const char* seed = std::getenv("OUTBOX_FAULT_SEED");
    uint64_t value = 0;
    return seed != nullptr && absl::SimpleAtoi(seed, &value)
               ? new std::mt19937_64(value)
               : nullptr;
  }();
  if (seeded == nullptr) {
    thread_local absl::BitGen gen;
    return absl::Bernoulli(gen, p);
  }
  std::lock_guard<std::mutex> lock(mu);
  return std::uniform_real_distribution<double>(0, 1)(*seeded) < p;
}

}  // namespace

void MaybeCrash(const char* point) {
  const auto* armed = Armed();
  if (armed->empty()) return;
  auto it = armed->find(point);
  if (it == armed->end()) return;
  if (Draw(it->second)) {
    std::fprintf(stderr, "OUTBOX_FAULT: crashing at %s\n", point);
    std::fflush(stderr);
    kill(getpid(), SIGKILL);
  }
}

}  // namespace outbox
