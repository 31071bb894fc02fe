#pragma once
// Test support for gRPC over loopback: channels to in-process servers and
// the two things every server must answer (health, reflection).

#include <grpcpp/grpcpp.h>

#include <memory>
#include <set>
#include <string>

namespace outbox::testing {

std::shared_ptr<grpc::Channel> Loopback(int port);

// grpc.health.v1.Health/Check for `service` ("" = overall): "SERVING",
// "NOT_SERVING", ... or the call's error.
std::string HealthStatus(grpc::Channel* channel,
                         const std::string& service = "");

// The services listed by reflection (v1alpha, as Debian's gRPC serves).
std::set<std::string> ReflectedServices(grpc::Channel* channel);

// True if reflection can return the file that defines `symbol`.
bool ReflectionDescribes(grpc::Channel* channel, const std::string& symbol);

}  // namespace outbox::testing
