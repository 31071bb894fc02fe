#pragma once
// Test support for reading a Metrics registry the way a scrape does: the
// values of one family's series in its text exposition.

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/metrics.h"

namespace outbox::testing {

// The value of each series of `family` (with labels or without).
inline std::vector<double> SeriesOf(const Metrics& metrics,
                                    const std::string& family) {
  std::vector<double> values;
  for (absl::string_view line : absl::StrSplit(metrics.Render(), '\n')) {
    if (!absl::StartsWith(line, family + "{") &&
        !absl::StartsWith(line, family + " ")) {
      continue;
    }
    double v = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) {
      values.push_back(v);
    }
  }
  return values;
}

// Their sum, and their largest (0: none).
inline double SumOf(const Metrics& metrics, const std::string& family) {
  const std::vector<double> v = SeriesOf(metrics, family);
  return std::accumulate(v.begin(), v.end(), 0.0);
}
inline double MaxOf(const Metrics& metrics, const std::string& family) {
  const std::vector<double> v = SeriesOf(metrics, family);
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

}  // namespace outbox::testing
