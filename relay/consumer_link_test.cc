// The relay's link to its consumer against real gRPC on loopback: a
// consumer whose health check answers SERVING stays reachable without
// batches, one that answers NOT_SERVING, or does not listen at all,
// becomes unreachable after unready_after and says why, an answered batch
// counts as much as a health check, and zero disables it all.

#include "relay/consumer_link.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/testing/wait.h"

namespace outbox::relay {
namespace {

using ::outbox::testing::WaitFor;

// A server that answers only grpc.health.v1 for outbox.v1.EventSink (its
// Deliver is unimplemented).
class HealthOnly {
 public:
  HealthOnly() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(&sink_);
    server_ = builder.BuildAndStart();
    Serve(true);
  }
  ~HealthOnly() { Shutdown(); }
  void Serve(bool serving) {
    server_->GetHealthCheckService()->SetServingStatus(
        v1::EventSink::service_full_name(), serving);
  }
  void Shutdown() {
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now());
    server_.reset();
  }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int port_ = 0;
  v1::EventSink::Service sink_;
  std::unique_ptr<grpc::Server> server_;
};

ConsumerLink::Options OptionsFor(const std::string& target) {
  return {.target = target,
          .retry_max = absl::Milliseconds(200),
          .unready_after = absl::Milliseconds(1500)};
}

TEST(ConsumerLink, AServingConsumerStaysReachableWithoutBatches) {
  HealthOnly consumer;
  // Checks come a second or two apart: room for one to be late.
  ConsumerLink::Options options = OptionsFor(consumer.target());
  options.unready_after = absl::Milliseconds(2500);
  ConsumerLink link(options);
  link.Start();
  // Twice unready_after without a batch: the health checks answer for it.
  absl::SleepFor(absl::Seconds(5));
  EXPECT_EQ(link.Unreachable(), std::nullopt);
  link.Stop();
  link.Stop();  // again: nothing
}

TEST(ConsumerLink, NotServingMakesItUnreachableUntilItServesAgain) {
  HealthOnly consumer;
  ConsumerLink link(OptionsFor(consumer.target()));
  link.Start();
  consumer.Serve(false);
  ASSERT_TRUE(WaitFor([&] { return link.Unreachable().has_value(); },
                      absl::Seconds(10)));
  const std::string why = link.Unreachable().value_or("");
  EXPECT_TRUE(absl::StrContains(why, consumer.target())) << why;
  EXPECT_TRUE(absl::StrContains(why, "NOT_SERVING")) << why;
  consumer.Serve(true);
  EXPECT_TRUE(WaitFor([&] { return !link.Unreachable().has_value(); },
                      absl::Seconds(10)));
}

TEST(ConsumerLink, AConsumerThatIsGoneIsUnreachableAndTheCheckSaysWhy) {
  std::string target;
  {
    HealthOnly gone;  // a port that nothing listens on once it is shut
    target = gone.target();
  }
  ConsumerLink link(OptionsFor(target));
  link.Start();
  ASSERT_TRUE(WaitFor([&] { return link.Unreachable().has_value(); },
                      absl::Seconds(10)));
  const std::string why = link.Unreachable().value_or("");
  EXPECT_TRUE(absl::StrContains(why, "health check failed")) << why;
  EXPECT_TRUE(absl::StrContains(why, "UNAVAILABLE")) << why;
}

TEST(ConsumerLink, AnsweredBatchesCountAsMuchAsHealthChecks) {
  HealthOnly consumer;
  consumer.Serve(false);  // its checks never help
  ConsumerLink link(OptionsFor(consumer.target()));
  link.Start();
  for (int i = 0; i < 15; ++i) {
    link.Answered();
    absl::SleepFor(absl::Milliseconds(200));
    ASSERT_EQ(link.Unreachable(), std::nullopt) << "after " << i;
  }
  EXPECT_TRUE(WaitFor([&] { return link.Unreachable().has_value(); },
                      absl::Seconds(10)));
}

TEST(ConsumerLink, ZeroNeverCountsItUnreachable) {
  HealthOnly consumer;
  consumer.Shutdown();
  ConsumerLink::Options options = OptionsFor(consumer.target());
  options.unready_after = absl::ZeroDuration();
  ConsumerLink link(options);
  link.Start();
  absl::SleepFor(absl::Seconds(2));
  EXPECT_EQ(link.Unreachable(), std::nullopt);
  EXPECT_NE(link.State(), GRPC_CHANNEL_READY);
}

}  // namespace
}  // namespace outbox::relay
