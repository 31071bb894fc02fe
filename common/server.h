#pragma once
// The gRPC server bootstrap every binary shares: reflection, the standard
// health service (grpc.health.v1, described to reflection), keepalive, and a
// graceful shutdown that reports NOT_SERVING first and cancels what is still
// running when the deadline passes.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace outbox {

// A service to register, with its full name for health ("outbox.v1.X",
// i.e. v1::X::service_full_name()).
struct NamedService {
  grpc::Service* service;
  std::string name;
};

struct ServerOptions {
  std::string listen;  // host:port; port 0 picks a free one
  absl::Duration shutdown_timeout = absl::Seconds(10);
};

class GrpcServer {
 public:
  // Builds and starts a server for `services` (not owned; they must outlive
  // the server). Unavailable if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(
      const ServerOptions& options, const std::vector<NamedService>& services);
  ~GrpcServer();

  int port() const { return port_; }
  // "host:port" with the port actually bound.
  std::string address() const;

  // Sets the health of "" and of every registered service.
  void SetServing(bool serving);

  // Health NOT_SERVING, stop accepting calls, wait for running calls up to
  // the shutdown timeout, then cancel them. Idempotent.
  void Shutdown();

 private:
  GrpcServer(ServerOptions options, std::unique_ptr<grpc::Server> server,
             int port, std::vector<std::string> names);

  const ServerOptions options_;
  std::unique_ptr<grpc::Server> server_;
  const int port_;
  const std::vector<std::string> names_;
  bool shut_down_ = false;
};

// Converts at the service edge; keeps the message.
grpc::Status ToGrpcStatus(const absl::Status& s);

}  // namespace outbox
