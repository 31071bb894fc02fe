#include "common/service.h"

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "common/config.h"
#include "common/server.h"

ABSL_FLAG(std::string, metrics_listen, "",
          "host:port serving Prometheus metrics at /metrics; empty disables.");
ABSL_FLAG(absl::Duration, shutdown_timeout, absl::Seconds(10),
          "After SIGTERM, how long running calls may finish before they are "
          "cancelled.");
ABSL_FLAG(int, db_pool_size, 8, "Database connections per process.");
ABSL_FLAG(absl::Duration, stall_timeout, absl::Seconds(30),
          "Health turns NOT_SERVING when the work loop (relay: claim/mark, "
          "consumer: apply, producer: database writes) has had work this "
          "long without progress; 0 disables the watchdog.");

namespace outbox {

std::optional<int> MigrateAtStartup(const std::string& name,
                                    const std::string& url,
                                    const std::string& schema,
                                    const std::vector<Migration>& migrations,
                                    const DbSession& session) {
  absl::Status s = Migrate(url, schema, migrations, absl::Seconds(30), session);
  if (s.ok()) return std::nullopt;
  if (absl::IsCancelled(s)) {
    spdlog::info("{}: stopped during start-up", name);
    return 0;
  }
  spdlog::critical("{}: migrations failed: {}", name, s.ToString());
  return 1;
}

int ServeUntilSignal(const ServeOptions& options) {
  std::unique_ptr<MetricsHttpServer> metrics_server;
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!metrics_listen.empty() && options.metrics != nullptr) {
    auto started = MetricsHttpServer::Start(metrics_listen, options.metrics);
    if (!started.ok()) {
      spdlog::critical("{}: {}", options.name, std::string(started.status().message()));
      return 1;
    }
    metrics_server = std::move(*started);
    spdlog::info("{}: metrics on http://{}/metrics", options.name,
                 metrics_listen);
  }
  auto server = GrpcServer::Start(
      {options.listen, absl::GetFlag(FLAGS_shutdown_timeout)},
      options.services);
  if (!server.ok()) {
    spdlog::critical("{}: {}", options.name, std::string(server.status().message()));
    return 1;
  }
  spdlog::info("{}: serving gRPC on {}", options.name, (*server)->address());
  bool serving = true;
  std::optional<std::string> sig;
  while (!(sig = WaitForTerminationSignal(absl::Milliseconds(500)))) {
    std::string why;
    for (const Watchdog* w : options.watchdogs) {
      if (auto stalled = w->Stalled()) why = *stalled;
    }
    if (serving && !why.empty()) {
      spdlog::error("{}: health NOT_SERVING: {}", options.name, why);
      (*server)->SetServing(false);
      serving = false;
    } else if (!serving && why.empty()) {
      spdlog::info("{}: health SERVING again: the work loop moves", options.name);
      (*server)->SetServing(true);
      serving = true;
    }
  }
  spdlog::info("{}: {} received; shutting down", options.name, *sig);
  (*server)->SetServing(false);
  if (options.before_drain) options.before_drain();
  (*server)->Shutdown();
  spdlog::info("{}: stopped", options.name);
  return 0;
}

}  // namespace outbox
