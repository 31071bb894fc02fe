#include "common/service.h"

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
ABSL_FLAG(std::string, health_listen, "",
          "host:port of a plaintext server that answers grpc.health.v1 "
          "only, for probes that cannot speak TLS (Kubernetes' gRPC "
          "probes); empty: none.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve TLS on --listen (with --tls_key).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mutual "
          "TLS).");
ABSL_FLAG(bool, tls_no_client_auth, false,
          "Serve TLS without client certificates (--tls_cert without "
          "--tls_client_ca): nobody is authenticated, so delivering events "
          "and admin calls are refused. Without this flag --tls_cert needs "
          "--tls_client_ca.");
ABSL_FLAG(bool, tls_cn_identity, false,
          "A client certificate without any URI or DNS SAN is known by its "
          "subject CN (off: it has no identity, and lists admit it by none). "
          "Needs --tls_client_ca.");
ABSL_FLAG(std::string, allowed_clients, "",
          "Comma-separated identities admitted (URI SAN such as "
          "spiffe://outbox/relay, else DNS SAN, else CN); empty admits every "
          "client the CA signed. Needs --tls_client_ca.");
ABSL_FLAG(std::string, admin_clients, "",
          "Comma-separated identities allowed to change state through admin "
          "calls (RelayAdmin.Requeue). Needs --tls_client_ca; empty refuses "
          "admin calls under mutual TLS.");

namespace outbox {

std::unique_ptr<IdentityWatch> WatchDatabase(const std::string& what,
                                             const std::string& label,
                                             Metrics* metrics,
                                             IdentityWatch::OnChange also) {
  const char* help =
      "Times this process saw its database change identity: a failover (a "
      "new timeline), another server behind the address, or the database "
      "dropped and made again (a restore).";
  std::map<std::string, Counter*> counters;
  for (const char* kind : {"failover", "new_server", "recreated"}) {
    counters[kind] = metrics->AddCounter(
        absl::StrCat("outbox_database_failovers_total{database=\"", label,
                     "\",kind=\"", kind, "\"}"),
        help);
  }
  auto watch = std::make_unique<IdentityWatch>(
      what, [counters, also](const IdentityChange& c) {
        auto it = counters.find(c.KindName());
        if (it != counters.end()) it->second->Add();
        if (also) also(c);
      });
  IdentityWatch* w = watch.get();
  metrics->AddGaugeFamily(
      "outbox_database_timeline",
      "The timeline of the database as this process last saw it (0: not "
      "seen yet); it grows with each promotion of a standby.",
      [w, label] {
        return std::vector<std::pair<Labels, double>>{
            {{{"database", label}},
             static_cast<double>(w->current().timeline)}};
      });
  return watch;
}

void CheckDatabaseIdentity(const std::string& name, const std::string& url,
                           const DbSession& session) {
  auto conn = Connect(url, name, session);
  if (!conn.ok()) {
    spdlog::warn("{}: cannot read the database's identity yet: {}", name,
                 std::string(conn.status().message()));
    return;
  }
  try {
    pqxx::nontransaction tx(**conn);
    std::optional<DatabaseIdentity> recorded = RecordedIdentity(tx);
    if (recorded.has_value() && session.identity_watch != nullptr) {
      session.identity_watch->ObserveRecorded(*recorded);
    }
    RecordIdentity(tx, (*conn)->info().identity);
    spdlog::info("{}: database {}{}", name, (*conn)->info().identity.ToString(),
                 (*conn)->info().pooler
                     ? ((*conn)->info().pooled
                            ? "; through a connection pooler: no session "
                              "state, statements unnamed"
                            : "; through a connection pooler in session mode")
                     : "");
  } catch (const std::exception& e) {
    spdlog::warn("{}: cannot record the database's identity: {}", name,
                 std::string(StatusFromException(e).message()));
  }
}

std::optional<int> MigrateAtStartup(const std::string& name,
                                    const std::string& url,
                                    const std::vector<Schema>& schemas,
                                    const DbSession& session) {
  for (const Schema& schema : schemas) {
    absl::Status s = Migrate(url, schema.name, *schema.migrations,
                             absl::Seconds(30), session);
    if (s.ok()) continue;
    if (absl::IsCancelled(s)) {
      spdlog::info("{}: stopped during start-up", name);
      return 0;
    }
    if (absl::IsFailedPrecondition(s)) {
      // The database is reached in a way this binary cannot work with (a
      // pooler in statement mode, say): waiting does not help.
      spdlog::critical("{}: refusing to start: {}", name,
                       std::string(s.message()));
      return 2;
    }
    spdlog::critical("{}: migrations of {} failed: {}", name, schema.name,
                     s.ToString());
    return 1;
  }
  return std::nullopt;
}

absl::StatusOr<ServerSecurity> ServerSecurityFromFlags() {
  ServerSecurity sec;
  sec.files = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
               absl::GetFlag(FLAGS_tls_client_ca)};
  if (absl::Status s = CheckServerTls(sec.files); !s.ok()) return s;
  const bool no_client_auth = absl::GetFlag(FLAGS_tls_no_client_auth);
  if (no_client_auth && !sec.files.tls()) {
    return absl::InvalidArgumentError(
        "--tls_no_client_auth: needs --tls_cert and --tls_key (it says how "
        "TLS is served)");
  }
  if (no_client_auth && sec.files.mutual()) {
    return absl::InvalidArgumentError(
        "--tls_no_client_auth contradicts --tls_client_ca (which requires "
        "client certificates): give one of them");
  }
  if (sec.files.tls() && !sec.files.mutual() && !no_client_auth) {
    return absl::InvalidArgumentError(
        "--tls_cert without --tls_client_ca would serve every client "
        "unauthenticated: give --tls_client_ca (mutual TLS), or "
        "--tls_no_client_auth to mean it (delivering events and admin calls "
        "are then refused)");
  }
  sec.rules.require_identity = sec.files.mutual();
  sec.rules.tls = sec.files.tls();
  sec.rules.common_name_identity = absl::GetFlag(FLAGS_tls_cn_identity);
  if (sec.rules.common_name_identity && !sec.files.mutual()) {
    return absl::InvalidArgumentError(
        "--tls_cn_identity: identities come from client certificates; needs "
        "--tls_client_ca");
  }
  sec.rules.allowed = ParseIdentityList(absl::GetFlag(FLAGS_allowed_clients));
  sec.rules.admin = ParseIdentityList(absl::GetFlag(FLAGS_admin_clients));
  if (!sec.files.mutual() && !sec.rules.allowed.empty()) {
    return absl::InvalidArgumentError(
        "--allowed_clients: identities come from client certificates; "
        "needs --tls_client_ca");
  }
  if (!sec.files.mutual() && !sec.rules.admin.empty()) {
    return absl::InvalidArgumentError(
        "--admin_clients: identities come from client certificates; needs "
        "--tls_client_ca");
  }
  sec.credentials = MakeServerCredentials(sec.files);
  return sec;
}

namespace {

void LogSecurity(const std::string& name, const ServerSecurity* sec) {
  if (sec == nullptr || !sec->files.tls()) {
    spdlog::warn(
        "{}: plaintext gRPC, every caller admitted (loopback "
        "development; see --tls_cert)",
        name);
    return;
  }
  if (!sec->files.mutual()) {
    spdlog::warn(
        "{}: TLS without client certificates (--tls_no_client_auth): "
        "nobody is authenticated; delivering events and admin calls are "
        "refused",
        name);
    return;
  }
  auto list = [](const std::set<std::string>& s) {
    return s.empty() ? std::string("(none)") : absl::StrJoin(s, ",");
  };
  spdlog::info("{}: mutual TLS; admitted: {}; admin: {}{}", name,
               sec->rules.allowed.empty() ? "any client the CA signed"
                                          : list(sec->rules.allowed),
               list(sec->rules.admin),
               sec->rules.common_name_identity
                   ? "; a certificate without SAN is known by its CN"
                   : "");
}

}  // namespace

int ServeUntilSignal(const ServeOptions& options) {
  std::unique_ptr<MetricsHttpServer> metrics_server;
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!metrics_listen.empty() && options.metrics != nullptr) {
    auto started = MetricsHttpServer::Start(metrics_listen, options.metrics);
    if (!started.ok()) {
      spdlog::critical("{}: {}", options.name,
                       std::string(started.status().message()));
      return 1;
    }
    metrics_server = std::move(*started);
    spdlog::info("{}: metrics on http://{}/metrics", options.name,
                 metrics_listen);
  }
  LogSecurity(options.name, options.security);
  ServerOptions server_options;
  server_options.listen = options.listen;
  server_options.shutdown_timeout = absl::GetFlag(FLAGS_shutdown_timeout);
  if (options.security != nullptr) {
    server_options.credentials = options.security->credentials;
  }
  server_options.max_receive_message_bytes = options.max_receive_message_bytes;
  server_options.health_listen = absl::GetFlag(FLAGS_health_listen);
  auto server = GrpcServer::Start(server_options, options.services);
  if (!server.ok()) {
    spdlog::critical("{}: {}", options.name,
                     std::string(server.status().message()));
    return 1;
  }
  spdlog::info("{}: serving gRPC on {}", options.name, (*server)->address());
  if ((*server)->health_port() != 0) {
    spdlog::info("{}: health (plaintext) on {}", options.name,
                 absl::GetFlag(FLAGS_health_listen));
  }
  bool serving = true, live = true;
  std::optional<std::string> sig;
  while (!(sig = WaitForTerminationSignal(absl::Milliseconds(500)))) {
    std::string stalled, unready;
    for (const Watchdog* w : options.watchdogs) {
      if (auto why = w->Stalled()) stalled = *why;
    }
    for (const auto& check : options.readiness) {
      if (auto why = check()) unready = *why;
    }
    if (live != stalled.empty()) {
      live = stalled.empty();
      (*server)->SetLive(live);
    }
    const std::string why = stalled.empty() ? unready : stalled;
    if (serving && !why.empty()) {
      spdlog::error("{}: health NOT_SERVING{}: {}", options.name,
                    stalled.empty() ? " (readiness; liveness SERVING)" : "",
                    why);
      (*server)->SetServing(false);
      serving = false;
    } else if (!serving && why.empty()) {
      spdlog::info("{}: health SERVING again", options.name);
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
