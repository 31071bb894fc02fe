// What any one caller can cost a server (README "What one caller can
// cost"), against GrpcServer as every binary starts it (ServerOptions'
// defaults): streams per connection, serving threads, clients that ping
// too often, idle connections, handshakes that never finish. Each cap is
// shown by its effect on real gRPC clients over loopback; the ones whose
// effect takes minutes (idle connections) or needs a flood (transport
// memory) are shown with a shorter setting, and their defaults read back.

#include <grpc/support/log.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/server.h"
#include "common/tls.h"
#include "outbox/v1/sink.grpc.pb.h"
#include "tests/testing/grpc.h"
#include "tests/testing/wait.h"

namespace outbox {
namespace {

using ::outbox::testing::WaitFor;

// An EventSink whose Deliver calls hold their stream (and their server
// thread) until the test releases them; it counts them.
class HoldingSink final : public v1::EventSink::Service {
 public:
  grpc::Status Deliver(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<v1::DeliverResponse,
                                                v1::DeliverRequest>*) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++started_;
    max_active_ = std::max(max_active_, ++active_);
    cv_.notify_all();
    while (released_ == 0 && !ctx->IsCancelled()) {
      cv_.wait_for(lock, std::chrono::milliseconds(20));
    }
    if (released_ > 0) --released_;
    --active_;
    return grpc::Status::OK;
  }
  void Release(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    released_ += n;
    cv_.notify_all();
  }
  int started() {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }
  int max_active() {
    std::lock_guard<std::mutex> lock(mu_);
    return max_active_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int started_ = 0, active_ = 0, max_active_ = 0, released_ = 0;
};

std::unique_ptr<GrpcServer> Serve(HoldingSink* sink,
                                  ServerOptions options = {}) {
  options.listen = "127.0.0.1:0";
  options.shutdown_timeout = absl::Seconds(1);
  auto server =
      GrpcServer::Start(options, {{sink, v1::EventSink::service_full_name()}});
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

// A channel of its own connection (no subchannel shared with others).
std::shared_ptr<grpc::Channel> OwnConnection(int port,
                                             grpc::ChannelArguments args = {}) {
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials(), args);
}

// Deliver calls made on threads of their own; each returns its status.
class Calls {
 public:
  void Start(std::shared_ptr<grpc::Channel> channel) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t i = statuses_.size();
    statuses_.emplace_back();
    threads_.emplace_back([this, channel, i] {
      auto stub = v1::EventSink::NewStub(channel);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(120));
      auto stream = stub->Deliver(&ctx);
      stream->WritesDone();
      grpc::Status s = stream->Finish();
      std::lock_guard<std::mutex> lock(mu_);
      statuses_[i] = s;
      ++finished_;
    });
  }
  int finished() {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_;
  }
  // Joins every call; their statuses by code.
  std::map<grpc::StatusCode, int> Join() {
    for (auto& t : threads_) t.join();
    threads_.clear();
    std::map<grpc::StatusCode, int> codes;
    for (const auto& s : statuses_) ++codes[s.error_code()];
    return codes;
  }

 private:
  std::mutex mu_;
  std::vector<std::thread> threads_;
  std::vector<grpc::Status> statuses_;
  int finished_ = 0;
};

TEST(ServerLimits, TheDefaultsAreTheDocumentedCaps) {
  const ServerOptions defaults;
  EXPECT_EQ(defaults.max_receive_message_bytes, 64 << 10);
  EXPECT_EQ(defaults.max_concurrent_streams, 32);
  EXPECT_EQ(defaults.max_threads, 64);
  EXPECT_EQ(defaults.memory_bytes, size_t{64} << 20);
  std::map<std::string, int> args;
  for (const auto& [name, value] : ServerChannelArgs(defaults)) {
    args[name] = value;
  }
  EXPECT_EQ(args[GRPC_ARG_MAX_CONCURRENT_STREAMS], 32);
  EXPECT_EQ(args[GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS], 2000);
  EXPECT_EQ(args[GRPC_ARG_HTTP2_MAX_PING_STRIKES], 2);
  EXPECT_EQ(args[GRPC_ARG_MAX_CONNECTION_IDLE_MS], 5 * 60 * 1000);
  EXPECT_EQ(args[GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS], 10000);
}

// 40 streams on one connection: the server runs 32 at once; the others
// start as those end.
TEST(ServerLimits, AConnectionHasAtMost32StreamsAtOnce) {
  HoldingSink sink;
  auto server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  auto channel = OwnConnection(server->port());
  Calls calls;
  for (int i = 0; i < 40; ++i) calls.Start(channel);
  ASSERT_TRUE(WaitFor([&] { return sink.started() >= 32; }));
  // The server has taken later work since: another connection's call.
  EXPECT_EQ(testing::HealthStatus(OwnConnection(server->port()).get()),
            "SERVING");
  EXPECT_EQ(sink.started(), 32);
  sink.Release(40);
  const auto codes = calls.Join();
  EXPECT_EQ(codes.at(grpc::StatusCode::OK), 40);
  EXPECT_EQ(sink.started(), 40);
  EXPECT_EQ(sink.max_active(), 32);
}

// Calls beyond the serving threads are refused at once with
// RESOURCE_EXHAUSTED, not queued without bound; the server keeps serving
// the others and answers again once threads are free.
TEST(ServerLimits, CallsBeyondTheThreadCapAreRefused) {
  HoldingSink sink;
  auto server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  Calls calls;
  for (int c = 0; c < 3; ++c) {
    auto channel = OwnConnection(server->port());
    for (int i = 0; i < 30; ++i) calls.Start(channel);
  }
  // Those refused finish on their own; the others wait for the release.
  ASSERT_TRUE(WaitFor([&] { return sink.started() + calls.finished() >= 90; }))
      << sink.started() << " started, " << calls.finished() << " finished";
  EXPECT_LE(sink.max_active(), 64);
  sink.Release(90);
  const auto codes = calls.Join();
  EXPECT_GT(codes.count(grpc::StatusCode::RESOURCE_EXHAUSTED), 0u);
  EXPECT_EQ(
      codes.count(grpc::StatusCode::OK) ? codes.at(grpc::StatusCode::OK) : 0,
      sink.started());
  EXPECT_EQ(testing::HealthStatus(OwnConnection(server->port()).get()),
            "SERVING");
}

// A client that pings every 100 ms without sending data is sent away
// (GOAWAY "too_many_pings"): its open call fails. One that sends no pings
// keeps its call.
TEST(ServerLimits, AClientThatPingsTooOftenIsSentAway) {
  HoldingSink sink;
  auto server = Serve(&sink);
  ASSERT_NE(server, nullptr);
  grpc::ChannelArguments pinging;
  pinging.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 100);
  pinging.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  pinging.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  pinging.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  pinging.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, 100);
  Calls rude, quiet;
  rude.Start(OwnConnection(server->port(), pinging));
  quiet.Start(OwnConnection(server->port()));
  ASSERT_TRUE(WaitFor([&] { return sink.started() == 2; }));
  EXPECT_TRUE(WaitFor([&] { return rude.finished() == 1; }))
      << "a client pinging every 100 ms still connected";
  EXPECT_EQ(quiet.finished(), 0);
  sink.Release(2);
  EXPECT_EQ(rude.Join().count(grpc::StatusCode::UNAVAILABLE), 1u);
  EXPECT_EQ(quiet.Join().count(grpc::StatusCode::OK), 1u);
}

// A connection without calls is closed after max_connection_idle (5
// minutes by default; shortened here): the client sees it go idle.
TEST(ServerLimits, AnIdleConnectionIsClosed) {
  HoldingSink sink;
  ServerOptions options;
  options.max_connection_idle = absl::Milliseconds(500);
  auto server = Serve(&sink, options);
  ASSERT_NE(server, nullptr);
  auto channel = OwnConnection(server->port());
  ASSERT_EQ(testing::HealthStatus(channel.get()), "SERVING");
  ASSERT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  EXPECT_TRUE(
      WaitFor([&] { return channel->GetState(false) != GRPC_CHANNEL_READY; }));
  // And a connection with a call stays open while the call runs.
  auto busy = OwnConnection(server->port());
  Calls calls;
  calls.Start(busy);
  ASSERT_TRUE(WaitFor([&] { return sink.started() == 1; }));
  ASSERT_EQ(busy->GetState(false), GRPC_CHANNEL_READY);
  sink.Release(1);
  EXPECT_EQ(calls.Join().count(grpc::StatusCode::OK), 1u);
}

// A TLS handshake that never starts (a client that connects and says
// nothing) is abandoned after 10 s: the server closes the connection.
TEST(ServerLimits, AHandshakeThatNeverEndsIsAbandoned) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      absl::StrCat("outbox-limits-test-", getpid());
  const std::string cmd =
      absl::StrCat("bash -c 'source \"", OUTBOX_SOURCE_DIR,
                   "/scripts/lib/certs.sh\" && make_certs \"", dir.string(),
                   "\" server' >/dev/null");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl could not make certs";
  HoldingSink sink;
  ServerOptions options;
  options.credentials = MakeServerCredentials(
      {(dir / "server.crt").string(), (dir / "server.key").string(), ""});
  auto server = Serve(&sink, options);
  ASSERT_NE(server, nullptr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(server->port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval poll{0, 200000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &poll, sizeof(poll));
  // Closed by the server: a read returns 0 (or the connection was reset).
  EXPECT_TRUE(WaitFor(
      [&] {
        char byte;
        const ssize_t n = recv(fd, &byte, 1, 0);
        return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
      },
      absl::Seconds(60)))
      << "the server kept a connection that never began its handshake";
  close(fd);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace outbox
