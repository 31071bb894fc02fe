#include "common/metrics.h"

#include <dirent.h>
#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace outbox {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

std::vector<ClientMetric::Label> ToLabels(const Labels& labels) {
  std::vector<ClientMetric::Label> out;
  for (const auto& [k, v] : labels) out.push_back({k, v});
  return out;
}

MetricFamily Gauge(const std::string& name, const std::string& help,
                   double value, MetricType type = MetricType::Gauge) {
  MetricFamily f{name, help, type, {}};
  ClientMetric m;
  if (type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

std::string ReadFile(const char* path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The standard process metrics of the Prometheus client libraries, from
// /proc: CPU seconds, resident and virtual memory, open and allowed file
// descriptors, start time.
std::vector<MetricFamily> ProcessMetrics() {
  std::vector<MetricFamily> out;
  const std::string stat = ReadFile("/proc/self/stat");
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return out;
  // Fields after "(comm)", from field 3 (state) on.
  std::vector<std::string> f = absl::StrSplit(stat.substr(paren + 2), ' ');
  if (f.size() < 22) return out;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  int64_t utime = 0, stime = 0, start = 0, vsize = 0, rss = 0;
  if (!absl::SimpleAtoi(f[11], &utime) || !absl::SimpleAtoi(f[12], &stime) ||
      !absl::SimpleAtoi(f[19], &start) || !absl::SimpleAtoi(f[20], &vsize) ||
      !absl::SimpleAtoi(f[21], &rss)) {
    return out;
  }
  out.push_back(Gauge("process_cpu_seconds_total",
                      "Total user and system CPU time spent in seconds.",
                      (utime + stime) / ticks, MetricType::Counter));
  out.push_back(Gauge("process_resident_memory_bytes",
                      "Resident memory size in bytes.",
                      static_cast<double>(rss) * sysconf(_SC_PAGESIZE)));
  out.push_back(Gauge("process_virtual_memory_bytes",
                      "Virtual memory size in bytes.",
                      static_cast<double>(vsize)));
  int64_t boot = 0;
  for (absl::string_view line : absl::StrSplit(ReadFile("/proc/stat"), '\n')) {
    if (absl::ConsumePrefix(&line, "btime "))
      (void)absl::SimpleAtoi(line, &boot);
  }
  if (boot > 0) {
    out.push_back(
        Gauge("process_start_time_seconds",
              "Start time of the process since unix epoch in seconds.",
              boot + start / ticks));
  }
  int fds = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') ++fds;
    }
    closedir(d);
    --fds;  // the one opendir held
  }
  out.push_back(
      Gauge("process_open_fds", "Number of open file descriptors.", fds));
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    out.push_back(Gauge("process_max_fds",
                        "Maximum number of open file descriptors.",
                        static_cast<double>(lim.rlim_cur)));
  }
  return out;
}

}  // namespace

std::pair<std::string, Labels> ParseMetricName(const std::string& name) {
  const size_t brace = name.find('{');
  if (brace == std::string::npos) return {name, {}};
  Labels labels;
  std::string rest = name.substr(brace + 1);
  if (!rest.empty() && rest.back() == '}') rest.pop_back();
  size_t i = 0;
  while (i < rest.size()) {
    const size_t eq = rest.find('=', i);
    if (eq == std::string::npos || eq + 1 >= rest.size() ||
        rest[eq + 1] != '"') {
      break;
    }
    std::string key = rest.substr(i, eq - i);
    std::string value;
    size_t j = eq + 2;
    for (; j < rest.size() && rest[j] != '"'; ++j) {
      if (rest[j] == '\\' && j + 1 < rest.size()) ++j;
      value.push_back(rest[j]);
    }
    labels[key] = value;
    i = j + 1;
    if (i < rest.size() && rest[i] == ',') ++i;
  }
  return {name.substr(0, brace), labels};
}

void Counter::Add(int64_t n) { c_->Increment(static_cast<double>(n)); }
int64_t Counter::value() const { return static_cast<int64_t>(c_->Value()); }

void Histogram::Observe(double value) { h_->Observe(value); }

std::vector<double> Histogram::LatencyBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
          0.25,   0.5,   1,      2.5,   5,    10,    30};
}

std::vector<double> Histogram::SizeBuckets() {
  std::vector<double> b;
  for (double v = 1; v <= 1024; v *= 2) b.push_back(v);
  return b;
}

// Owns the registry and the scrape-time gauges; collects everything.
class Metrics::Collector : public prometheus::Collectable {
 public:
  std::vector<MetricFamily> Collect() const override {
    std::vector<MetricFamily> out = registry_->Collect();
    std::vector<GaugeEntry> gauges;
    std::vector<FamilyEntry> families;
    {
      absl::MutexLock lock(&mu_);
      gauges = gauges_;
      families = families_;
    }
    std::map<std::string, size_t> index;
    for (const GaugeEntry& g : gauges) {
      auto [it, fresh] = index.emplace(g.family, out.size());
      if (fresh) out.push_back({g.family, g.help, MetricType::Gauge, {}});
      ClientMetric m;
      m.label = ToLabels(WithBase(g.labels));
      m.gauge.value = g.read();
      out[it->second].metric.push_back(std::move(m));
    }
    for (const FamilyEntry& f : families) {
      MetricFamily family{f.family, f.help, MetricType::Gauge, {}};
      for (auto& [labels, value] : f.read()) {
        ClientMetric m;
        m.label = ToLabels(WithBase(labels));
        m.gauge.value = value;
        family.metric.push_back(std::move(m));
      }
      out.push_back(std::move(family));
    }
    for (MetricFamily& f : ProcessMetrics()) out.push_back(std::move(f));
    return out;
  }

  // `labels` and the labels every series of this process carries.
  Labels WithBase(Labels labels) const {
    labels.insert(base_.begin(), base_.end());
    return labels;
  }

  struct GaugeEntry {
    std::string family, help;
    Labels labels;
    std::function<double()> read;
  };
  struct FamilyEntry {
    std::string family, help;
    std::function<std::vector<std::pair<Labels, double>>()> read;
  };

  Labels base_;
  std::shared_ptr<prometheus::Registry> registry_ =
      std::make_shared<prometheus::Registry>();
  mutable absl::Mutex mu_;
  std::map<std::string, prometheus::Family<prometheus::Counter>*>
      counter_families_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, prometheus::Family<prometheus::Histogram>*>
      histogram_families_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<Counter>> counters_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<Histogram>> histograms_
      ABSL_GUARDED_BY(mu_);
  std::vector<GaugeEntry> gauges_ ABSL_GUARDED_BY(mu_);
  std::vector<FamilyEntry> families_ ABSL_GUARDED_BY(mu_);
};

Metrics::Metrics(Labels base) : collector_(std::make_shared<Collector>()) {
  collector_->base_ = std::move(base);
}
Metrics::~Metrics() = default;

Counter* Metrics::AddCounter(const std::string& name, const std::string& help) {
  Collector& c = *collector_;
  absl::MutexLock lock(&c.mu_);
  auto& slot = c.counters_[name];
  if (slot != nullptr) return slot.get();
  auto [family, labels] = ParseMetricName(name);
  auto& f = c.counter_families_[family];
  if (f == nullptr) {
    f = &prometheus::BuildCounter().Name(family).Help(help).Register(
        *c.registry_);
  }
  slot = std::make_unique<Counter>(&f->Add(c.WithBase(labels)));
  return slot.get();
}

Histogram* Metrics::AddHistogram(const std::string& name,
                                 const std::string& help,
                                 const std::vector<double>& buckets) {
  Collector& c = *collector_;
  absl::MutexLock lock(&c.mu_);
  auto& slot = c.histograms_[name];
  if (slot != nullptr) return slot.get();
  auto [family, labels] = ParseMetricName(name);
  auto& f = c.histogram_families_[family];
  if (f == nullptr) {
    f = &prometheus::BuildHistogram().Name(family).Help(help).Register(
        *c.registry_);
  }
  slot = std::make_unique<Histogram>(&f->Add(c.WithBase(labels), buckets));
  return slot.get();
}

void Metrics::AddGauge(const std::string& name, const std::string& help,
                       std::function<double()> read) {
  auto [family, labels] = ParseMetricName(name);
  absl::MutexLock lock(&collector_->mu_);
  collector_->gauges_.push_back({family, help, labels, std::move(read)});
}

void Metrics::AddGaugeFamily(
    const std::string& family, const std::string& help,
    std::function<std::vector<std::pair<Labels, double>>()> read) {
  absl::MutexLock lock(&collector_->mu_);
  collector_->families_.push_back({family, help, std::move(read)});
}

std::string Metrics::Render() const {
  return prometheus::TextSerializer().Serialize(collector_->Collect());
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, const Metrics* metrics) {
  const size_t colon = listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen: \"", listen, "\" is not host:port"));
  }
  std::string host = listen.substr(0, colon);
  if (host.empty() || host == "*") host = "0.0.0.0";
  if (host == "localhost") host = "127.0.0.1";
  try {
    // A few threads, and a slow client is cut off after 3 s: one client can
    // never keep Prometheus from scraping.
    auto exposer =
        std::make_unique<prometheus::Exposer>(std::vector<std::string>{
            "listening_ports", absl::StrCat(host, ":", port), "num_threads",
            "4", "request_timeout_ms", "3000", "enable_keep_alive", "no"});
    exposer->RegisterCollectable(metrics->collector_);
    const std::vector<int> ports = exposer->GetListeningPorts();
    return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(
        std::move(exposer), ports.empty() ? port : ports[0]));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "--metrics_listen: cannot listen on ", listen, ": ", e.what()));
  }
}

MetricsHttpServer::MetricsHttpServer(
    std::unique_ptr<prometheus::Exposer> exposer, int port)
    : exposer_(std::move(exposer)), port_(port) {}

MetricsHttpServer::~MetricsHttpServer() = default;

}  // namespace outbox
