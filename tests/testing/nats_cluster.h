#pragma once
// Test support for tests against a real NATS JetStream cluster: a
// NatsCluster is three nats-server nodes on free 127.0.0.1 ports, started
// by tests/testing/nats_cluster.sh in a fresh temporary folder and stopped
// by pid when it is destroyed (or, if the test process dies, by the
// script's watcher). Nodes are numbered 1-3 and named "n1".."n3".
//
//   auto cluster = outbox::testing::NatsCluster::Start();
//   if (!cluster.ok()) GTEST_SKIP() << cluster.status();  // or fail
//   Connect({.servers = (*cluster)->urls()});
//   (*cluster)->Kill(2);     // SIGKILL, a crash
//   (*cluster)->Restart(2);  // same ports, same data

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace outbox::testing {

// Whether nats-server is on PATH (a test that needs it skips otherwise).
bool NatsServerInstalled();

class NatsCluster {
 public:
  // Starts the cluster and waits (at most 30 s) for its meta leader.
  static absl::StatusOr<std::unique_ptr<NatsCluster>> Start();
  ~NatsCluster();
  NatsCluster(const NatsCluster&) = delete;
  NatsCluster& operator=(const NatsCluster&) = delete;

  // "nats://127.0.0.1:PORT" of node 1, 2 and 3.
  const std::vector<std::string>& urls() const { return urls_; }
  const std::string& dir() const { return dir_; }

  absl::Status Kill(int node);     // SIGKILL
  absl::Status Stop(int node);     // SIGTERM, a clean shutdown
  absl::Status Restart(int node);  // from its own data folder
  absl::Status Pause(int node);    // SIGSTOP: connections open, no answers
  absl::Status Resume(int node);   // SIGCONT
  // 1-3 for "n1".."n3"; 0 for any other name.
  static int NodeOf(const std::string& server_name);
  // The end of each node's log, for a failure message.
  std::string Logs() const;

 private:
  explicit NatsCluster(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Run(const std::string& args) const;

  std::string dir_;
  std::vector<std::string> urls_;
};

// A GoogleTest fixture whose suite shares one NatsCluster, started before
// its first test and stopped after its last; each test is skipped when
// nats-server is not installed.
//
//   class SinkTest : public outbox::testing::NatsClusterTest { ... };
//   TEST_F(SinkTest, X) { Connect({.servers = cluster()->urls()}); }
class NatsClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite();
  static void TearDownTestSuite();
  void SetUp() override;
  static NatsCluster* cluster() { return cluster_; }

 private:
  static NatsCluster* cluster_;
};

}  // namespace outbox::testing
