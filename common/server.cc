#include "common/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "common/db.h"
#include "common/ids.h"
#include "grpc/health/v1/health.pb.h"

namespace outbox {

std::string PublicMessage(const absl::Status& s) {
  const bool from_database = !SqlStateOf(s).empty();
  const char* sentence = nullptr;
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
      sentence = "the database is unavailable; try again";
      break;
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
      sentence = "internal error";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      if (from_database)
        sentence = "the database did not answer in time; try again";
      break;
    case absl::StatusCode::kAborted:
      if (from_database) sentence = "a concurrent change conflicted; try again";
      break;
    default:
      if (from_database) sentence = "the database refused the request's data";
  }
  if (sentence == nullptr) return std::string(s.message());
  const std::string id = NewUuid().substr(0, 8);
  spdlog::warn("error id {}: {}", id, s.ToString());
  std::string state = SqlStateOf(s);
  return absl::StrCat(sentence,
                      state.empty() ? "" : " (SQLSTATE " + state + ")",
                      " [error id ", id, "]");
}

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      PublicMessage(s));
}

grpc::Status CheckReason(const std::string& reason, const char* hint) {
  if (!reason.empty() && reason.size() <= 2000) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("reason: must be 1-2000 bytes (", hint, ")"));
}

std::vector<std::pair<std::string, int>> ServerChannelArgs(
    const ServerOptions& options) {
  const auto ms = [](absl::Duration d) {
    return static_cast<int>(absl::ToInt64Milliseconds(d));
  };
  return {
      // Two processes must never share a port silently.
      {GRPC_ARG_ALLOW_REUSEPORT, 0},
      // Peers that stop answering pings are dropped within 40 s.
      {GRPC_ARG_KEEPALIVE_TIME_MS, 30000},
      {GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000},
      {GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1},
      // Clients (the relay) ping every few seconds to spot a dead peer;
      // one that pings more often is sent away after two warnings.
      {GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
       ms(options.min_ping_interval)},
      {GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2},
      {GRPC_ARG_MAX_CONNECTION_IDLE_MS, ms(options.max_connection_idle)},
      {GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, ms(options.handshake_timeout)},
      {GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams},
  };
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
  builder.AddListeningPort(options.listen,
                           options.credentials != nullptr
                               ? options.credentials
                               : grpc::InsecureServerCredentials(),
                           &port);
  for (const auto& [name, value] : ServerChannelArgs(options)) {
    builder.AddChannelArgument(name, value);
  }
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  // The synchronous server keeps this many threads waiting for calls. With
  // gRPC's default (at most 2), every call beyond two at once spawned a
  // thread and ended it afterwards: most of the producer's CPU went there.
  builder.SetSyncServerOption(
      grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 2);
  builder.SetSyncServerOption(
      grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, options.max_threads);
  grpc::ResourceQuota quota("outbox-server");
  quota.SetMaxThreads(options.max_threads);
  quota.Resize(options.memory_bytes);
  builder.SetResourceQuota(quota);
  std::vector<std::string> names;
  for (const NamedService& s : services) {
    builder.RegisterService(s.service);
    names.push_back(s.name);
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", options.listen, " (address in use or invalid?)"));
  }
  auto result = std::unique_ptr<GrpcServer>(
      new GrpcServer(options, std::move(server), port, std::move(names)));
  if (!options.health_listen.empty()) {
    grpc::ServerBuilder health;
    health.AddListeningPort(options.health_listen,
                            grpc::InsecureServerCredentials(),
                            &result->health_port_);
    health.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health.SetMaxReceiveMessageSize(4 << 10);
    health.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 4);
    grpc::ResourceQuota small("outbox-health");
    small.SetMaxThreads(4);
    health.SetResourceQuota(small);
    result->health_server_ = health.BuildAndStart();
    if (result->health_server_ == nullptr || result->health_port_ == 0) {
      return absl::UnavailableError(absl::StrCat(
          "--health_listen: cannot listen on ", options.health_listen));
    }
  }
  result->SetServing(true);
  result->SetLive(true);
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

void GrpcServer::SetHealth(const std::vector<std::string>& names, bool up) {
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server == nullptr) continue;
    auto* health = server->GetHealthCheckService();
    if (health == nullptr) continue;
    for (const std::string& name : names) health->SetServingStatus(name, up);
  }
}

void GrpcServer::SetServing(bool serving) {
  std::vector<std::string> names = names_;
  names.emplace_back("");
  SetHealth(names, serving);
}

void GrpcServer::SetLive(bool live) { SetHealth({kLivenessService}, live); }

void GrpcServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  SetServing(false);
  SetLive(false);
  const auto deadline = std::chrono::system_clock::now() +
                        absl::ToChronoNanoseconds(options_.shutdown_timeout);
  server_->Shutdown(deadline);
  server_->Wait();
  if (health_server_ != nullptr) {
    health_server_->Shutdown(deadline);
    health_server_->Wait();
  }
}

}  // namespace outbox
