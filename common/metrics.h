#pragma once
// Prometheus metrics: counters and gauges registered by name, rendered in
// the text exposition format, and a minimal HTTP server for
// --metrics_listen that answers GET /metrics.

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace outbox {

class Counter {
 public:
  void Add(int64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  int64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> value_{0};
};

// Example:
//   Metrics m;
//   Counter* applied = m.AddCounter("outbox_consumer_applied_total", "...");
//   m.AddGauge("outbox_relay_in_flight", "...", [&] { return inflight; });
class Metrics {
 public:
  // Returns a counter owned by this registry; the same name returns the
  // same counter. `name` may carry labels: `x_total{outcome="applied"}`.
  Counter* AddCounter(const std::string& name, const std::string& help);
  // `read` is called on every scrape, from the HTTP thread.
  void AddGauge(const std::string& name, const std::string& help,
                std::function<double()> read);
  // The text exposition format.
  std::string Render() const;

 private:
  struct Entry {
    std::string help;
    std::string type;
    std::unique_ptr<Counter> counter;
    std::function<double()> gauge;
  };
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;
};

// Serves `metrics` at http://listen/metrics on its own thread until
// destroyed.
class MetricsHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, const Metrics* metrics);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  MetricsHttpServer(int fd, int port, const Metrics* metrics);
  void Loop();

  const int fd_;
  const int port_;
  const Metrics* metrics_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace outbox
