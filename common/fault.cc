#include "common/fault.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>

#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace outbox {
namespace {

// OUTBOX_FAULT parsed: point -> probability; an error for a malformed entry.
absl::Status ParseSpec(const char* spec, std::map<std::string, double>* out) {
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, ':');
    double p = 0;
    if (!absl::SimpleAtod(kv.second, &p) || p < 0 || p > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("OUTBOX_FAULT: bad probability in \"", item, "\""));
    }
    (*out)[kv.first] = p;
  }
  return absl::OkStatus();
}

// Parsed once from OUTBOX_FAULT; read-only afterwards.
const std::map<std::string, double>* Armed() {
  static const std::map<std::string, double>* armed = [] {
    auto* m = new std::map<std::string, double>();
    const char* spec = std::getenv("OUTBOX_FAULT");
    if (spec == nullptr) return m;
    if (absl::Status s = ParseSpec(spec, m); !s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      std::exit(2);
    }
    return m;
  }();
  return armed;
}

// True with probability `p`, from OUTBOX_FAULT_SEED's sequence if set.
bool Draw(double p) {
  static absl::Mutex mu;
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
  absl::MutexLock lock(&mu);
  return std::uniform_real_distribution<double>(0, 1)(*seeded) < p;
}

}  // namespace

absl::Status CheckCrashPoints(const std::vector<const char*>& known) {
  const char* spec = std::getenv("OUTBOX_FAULT");
  if (spec == nullptr) return absl::OkStatus();
  std::map<std::string, double> armed;
  if (absl::Status s = ParseSpec(spec, &armed); !s.ok()) return s;
  for (const auto& entry : armed) {
    const std::string& point = entry.first;
    if (std::find(known.begin(), known.end(), point) == known.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("OUTBOX_FAULT: \"", point,
                       "\" is not a crash point of this binary (it has ",
                       absl::StrJoin(known, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

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
