#include "tests/testing/grpc.h"

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"

namespace outbox::testing {

using grpc::reflection::v1alpha::ServerReflection;
using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;

std::shared_ptr<grpc::Channel> Loopback(int port) {
  return grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                             grpc::InsecureChannelCredentials());
}

std::string HealthStatus(grpc::Channel* channel, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok())
    return absl::StrCat("error ", s.error_code(), ": ", s.error_message());
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
      resp.status());
}

namespace {
ServerReflectionResponse Ask(grpc::Channel* channel,
                             const ServerReflectionRequest& req) {
  auto stub = ServerReflection::NewStub(
      std::shared_ptr<grpc::Channel>(channel, [](grpc::Channel*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->ServerReflectionInfo(&ctx);
  ServerReflectionResponse resp;
  stream->Write(req);
  stream->WritesDone();
  stream->Read(&resp);
  stream->Finish();
  return resp;
}
}  // namespace

std::set<std::string> ReflectedServices(grpc::Channel* channel) {
  ServerReflectionRequest req;
  req.set_list_services("*");
  std::set<std::string> out;
  const ServerReflectionResponse resp = Ask(channel, req);
  for (const auto& s : resp.list_services_response().service()) {
    out.insert(s.name());
  }
  return out;
}

bool ReflectionDescribes(grpc::Channel* channel, const std::string& symbol) {
  ServerReflectionRequest req;
  req.set_file_containing_symbol(symbol);
  ServerReflectionResponse resp = Ask(channel, req);
  return resp.has_file_descriptor_response() &&
         resp.file_descriptor_response().file_descriptor_proto_size() > 0;
}

}  // namespace outbox::testing
