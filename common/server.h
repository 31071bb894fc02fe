#pragma once
// The gRPC server bootstrap every binary shares: reflection, the standard
// health service (grpc.health.v1, described to reflection), keepalive, and a
// graceful shutdown that reports NOT_SERVING first and cancels what is still
// running when the deadline passes.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/limits.h"

namespace outbox {

// A service to register, with its full name for health ("outbox.v1.X",
// i.e. v1::X::service_full_name()).
struct NamedService {
  grpc::Service* service;
  std::string name;
};

// What one server accepts, and what any one caller can cost it.
struct ServerOptions {
  std::string listen;  // host:port; port 0 picks a free one
  absl::Duration shutdown_timeout = absl::Seconds(10);
  // TLS or mutual TLS (common/tls.h); null serves plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Larger requests are refused before they are parsed.
  int max_receive_message_bytes = kMaxApiMessageBytes;
  // Streams one connection may have open at once.
  int max_concurrent_streams = 32;
  // Threads serving calls, and memory for transport buffers, at most.
  int max_threads = 64;
  size_t memory_bytes = 64 << 20;
  // A client that pings more often than this without sending data is sent
  // away after two warnings; a connection with no call this long is
  // closed; a handshake that does not finish this soon is abandoned.
  absl::Duration min_ping_interval = absl::Seconds(2);
  absl::Duration max_connection_idle = absl::Minutes(5);
  absl::Duration handshake_timeout = absl::Seconds(10);
  // host:port of a second, plaintext server that answers grpc.health.v1
  // only (and follows SetServing): for probes that cannot speak TLS, such
  // as Kubernetes' gRPC probes. Empty: none.
  std::string health_listen;
};

// The health service name that answers liveness (GrpcServer::SetLive).
inline constexpr char kLivenessService[] = "liveness";

class GrpcServer {
 public:
  // Builds and starts a server for `services` (not owned; they must outlive
  // the server). Unavailable if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(
      const ServerOptions& options, const std::vector<NamedService>& services);
  ~GrpcServer();

  int port() const { return port_; }
  int health_port() const { return health_port_; }
  // "host:port" with the port actually bound.
  std::string address() const;

  // Sets the health of "" and of every registered service: readiness
  // (Kubernetes' readinessProbe and startupProbe ask for "").
  void SetServing(bool serving);
  // Sets the health of kLivenessService: whether the process's work loops
  // move (a livenessProbe asks for it). A process can be alive and not
  // ready: a relay that cannot reach its consumer is not restarted for it.
  void SetLive(bool live);

  // Health NOT_SERVING, stop accepting calls, wait for running calls up to
  // the shutdown timeout, then cancel them. Idempotent.
  void Shutdown();

 private:
  // Sets the health of `names` on the API server and the health server.
  void SetHealth(const std::vector<std::string>& names, bool up);

  GrpcServer(ServerOptions options, std::unique_ptr<grpc::Server> server,
             int port, std::vector<std::string> names);

  const ServerOptions options_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;  // may be null
  const int port_;
  int health_port_ = 0;
  const std::vector<std::string> names_;
  bool shut_down_ = false;
};

// The channel arguments Start gives a server for `options` (keepalive,
// pings, idle connections, handshakes, streams per connection), by name.
std::vector<std::pair<std::string, int>> ServerChannelArgs(
    const ServerOptions& options);

// Converts at the service edge: the code is kept, and so is the message
// unless it carries database internals (see PublicMessage).
grpc::Status ToGrpcStatus(const absl::Status& s);

// OK, or INVALID_ARGUMENT when an operator's `reason` (recorded with the
// action) is empty or over 2000 bytes; `hint` says what it should say.
grpc::Status CheckReason(const std::string& reason, const char* hint);

// The message a caller may see for `s`: its own, unless it comes from the
// database (a SQLSTATE) or is Unavailable, Internal, Unknown or DataLoss;
// then a short sentence and an error id, under which the full status is
// logged. Callers never see SQL text, table names or server addresses.
std::string PublicMessage(const absl::Status& s);

}  // namespace outbox
