#include "common/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.pb.h"

namespace outbox {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(
    const ServerOptions& options, const std::vector<NamedService>& services) {
  // Links health.proto's descriptors into the binary so reflection can
  // describe grpc.health.v1.Health.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(),
                           &port);
  // Two processes must never share a port silently.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Clients (the relay) ping every few seconds to spot a dead peer.
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 2000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // Delivery batches of large orders may exceed gRPC's default 4 MiB.
  builder.SetMaxReceiveMessageSize(16 << 20);
  std::vector<std::string> names;
  for (const NamedService& s : services) {
    builder.RegisterService(s.service);
    names.push_back(s.name);
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen,
                     " (address in use or invalid?)"));
  }
  auto result = std::unique_ptr<GrpcServer>(
      new GrpcServer(options, std::move(server), port, std::move(names)));
  result->SetServing(true);
  return result;
}

GrpcServer::GrpcServer(ServerOptions options,
                       std::unique_ptr<grpc::Server> server, int port,
                       std::vector<std::string> names)
    : options_(std::move(options)),
      server_(std::move(server)),
      port_(port),
      names_(std::move(names)) {}

GrpcServer::~GrpcServer() { Shutdown(); }

std::string GrpcServer::address() const {
  std::string host = options_.listen.substr(0, options_.listen.rfind(':'));
  return absl::StrCat(host, ":", port_);
}

void GrpcServer::SetServing(bool serving) {
  auto* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", serving);
  for (const std::string& name : names_) {
    health->SetServingStatus(name, serving);
  }
}

void GrpcServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  SetServing(false);
  const auto deadline = std::chrono::system_clock::now() +
                        absl::ToChronoNanoseconds(options_.shutdown_timeout);
  server_->Shutdown(deadline);
  server_->Wait();
}

}  // namespace outbox
