#pragma once
// What the three service binaries share after start-up: their common flags
// (--metrics_listen, --shutdown_timeout, --db_pool_size) and the loop that
// serves gRPC and metrics until SIGINT/SIGTERM, then shuts down in order.

#include <grpcpp/grpcpp.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/time/time.h"
#include "common/db.h"
#include "common/identity.h"
#include "common/metrics.h"
#include "common/server.h"
#include "common/tls.h"
#include "common/watchdog.h"

ABSL_DECLARE_FLAG(std::string, metrics_listen);
ABSL_DECLARE_FLAG(absl::Duration, shutdown_timeout);
ABSL_DECLARE_FLAG(int, db_pool_size);
ABSL_DECLARE_FLAG(absl::Duration, stall_timeout);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_client_ca);
ABSL_DECLARE_FLAG(std::string, allowed_clients);
ABSL_DECLARE_FLAG(std::string, admin_clients);

namespace outbox {

// A server's transport security and who may call it, from the flags.
struct ServerSecurity {
  ServerTlsFiles files;
  AccessRules rules;
  std::shared_ptr<grpc::ServerCredentials> credentials;
};

// Reads --tls_cert, --tls_key, --tls_client_ca, --tls_no_client_auth,
// --tls_cn_identity, --allowed_clients and --admin_clients; InvalidArgument
// naming the flag when they do not fit together (TLS without client
// certificates only with --tls_no_client_auth; identities need client
// certificates, so the lists and --tls_cn_identity need --tls_client_ca)
// or a file is unreadable.
absl::StatusOr<ServerSecurity> ServerSecurityFromFlags();

struct ServeOptions {
  std::string name;                          // e.g. "outbox-producer", for logs
  std::string listen;                        // gRPC address
  const ServerSecurity* security = nullptr;  // null: plaintext
  int max_receive_message_bytes = kMaxApiMessageBytes;
  std::vector<NamedService> services;
  const Metrics* metrics = nullptr;
  // Health (readiness and liveness) turns NOT_SERVING while any of these is
  // stalled, and back to SERVING when all move again. Not owned.
  std::vector<const Watchdog*> watchdogs;
  // Readiness only: while any of these gives a reason, health "" (and each
  // service) is NOT_SERVING and liveness stays SERVING; the process is not
  // restarted for it (the relay: its consumer does not answer).
  std::vector<std::function<std::optional<std::string>()>> readiness;
  // Called after health went NOT_SERVING and before the gRPC server drains:
  // stop background work here (the relay stops claiming).
  std::function<void()> before_drain;
};

// An IdentityWatch of one database (`label`: "outbox" or "inbox", as the
// metrics name it) whose changes count in
// outbox_database_failovers_total{database=label,kind=...} and whose
// current timeline is the gauge outbox_database_timeline{database=label}.
// `metrics` must outlive it. `also`, if given, hears each change after it
// was counted.
std::unique_ptr<IdentityWatch> WatchDatabase(
    const std::string& what, const std::string& label, Metrics* metrics,
    IdentityWatch::OnChange also = nullptr);

// At start-up, after the migrations: connects once (so session.identity_watch
// sees the database), compares the identity the database recorded with it
// (a failover or restore while this process was down is reported then) and
// records it. Never fails: a database that cannot be read or written is
// logged and left to the binary's own retries.
void CheckDatabaseIdentity(const std::string& name, const std::string& url,
                           const DbSession& session);

// Applies each schema's migrations to `url` at start-up, in order (see
// Migrate). Returns the exit code the binary must stop with, or nothing
// when the database is ready.
std::optional<int> MigrateAtStartup(const std::string& name,
                                    const std::string& url,
                                    const std::vector<Schema>& schemas,
                                    const DbSession& session);

// Serves until SIGINT or SIGTERM, then: health NOT_SERVING, before_drain,
// drain the gRPC server within --shutdown_timeout. Meanwhile health follows
// the watchdogs, each change logged with its reason. Returns the process
// exit code (non-zero if a port cannot be bound).
int ServeUntilSignal(const ServeOptions& options);

}  // namespace outbox
