#pragma once
// Prometheus metrics through prometheus-cpp: counters, histograms and
// gauges registered by name, gauges read at scrape time, the standard
// process metrics (CPU, memory, file descriptors), and the HTTP endpoint
// behind --metrics_listen (civetweb with a few threads and a request
// timeout, so one slow client never blocks a scrape).
//
// A name may carry labels, as the text format writes them:
//   Metrics m;
//   Counter* applied = m.AddCounter(
//       "outbox_consumer_events_total{outcome=\"applied\"}", "Events ...");
//   applied->Add();
//   Histogram* apply = m.AddHistogram("outbox_consumer_apply_seconds",
//                                     "...", Histogram::LatencyBuckets());
//   m.AddGauge("outbox_relay_in_flight", "...", [&] { return inflight; });

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace prometheus {
class Counter;
class Exposer;
class Histogram;
}  // namespace prometheus

namespace outbox {

class Counter {
 public:
  explicit Counter(prometheus::Counter* c) : c_(c) {}
  void Add(int64_t n = 1);
  int64_t value() const;

 private:
  prometheus::Counter* const c_;
};

class Histogram {
 public:
  explicit Histogram(prometheus::Histogram* h) : h_(h) {}
  void Observe(double value);

  // Seconds from 0.5 ms to 30 s: the latencies of a call, a transaction, or
  // an event from commit to applied.
  static std::vector<double> LatencyBuckets();
  // 1 to 1024, doubling: batch sizes.
  static std::vector<double> SizeBuckets();

 private:
  prometheus::Histogram* const h_;
};

// Labels of one series of a gauge family, name -> value.
using Labels = std::map<std::string, std::string>;

class Metrics {
 public:
  // `base`: labels every series of this registry carries but the process
  // metrics (e.g. the relay's subscription).
  explicit Metrics(Labels base = {});
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The counter of `name` (with its labels), created on first use; the same
  // name returns the same counter. Thread-safe.
  Counter* AddCounter(const std::string& name, const std::string& help);
  Histogram* AddHistogram(const std::string& name, const std::string& help,
                          const std::vector<double>& buckets);
  // `read` is called on every scrape, from the HTTP server's threads.
  void AddGauge(const std::string& name, const std::string& help,
                std::function<double()> read);
  // A gauge family whose series `read` lists on every scrape (e.g. one per
  // partition the relay owns).
  void AddGaugeFamily(
      const std::string& family, const std::string& help,
      std::function<std::vector<std::pair<Labels, double>>()> read);

  // Everything, in the text exposition format.
  std::string Render() const;

 private:
  friend class MetricsHttpServer;
  class Collector;
  std::shared_ptr<Collector> collector_;
};

// Serves `metrics` at http://listen/metrics until destroyed.
class MetricsHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, const Metrics* metrics);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  MetricsHttpServer(std::unique_ptr<prometheus::Exposer> exposer, int port);
  std::unique_ptr<prometheus::Exposer> exposer_;
  const int port_;
};

// Splits "x_total{k=\"a\",j=\"b\"}" into "x_total" and {k: a, j: b}.
std::pair<std::string, Labels> ParseMetricName(const std::string& name);

}  // namespace outbox
