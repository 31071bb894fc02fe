#include "tests/testing/nats_cluster.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace outbox::testing {
namespace {

const char kScript[] = OUTBOX_SOURCE_DIR "/tests/testing/nats_cluster.sh";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

bool NatsServerInstalled() {
  return std::system("command -v nats-server >/dev/null 2>&1") == 0;
}

absl::StatusOr<std::unique_ptr<NatsCluster>> NatsCluster::Start() {
  std::string dir_template = "/tmp/outbox-nats.XXXXXX";
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::InternalError("mkdtemp for the NATS cluster failed");
  }
  std::unique_ptr<NatsCluster> cluster(new NatsCluster(dir_template));
  // This process's pid: the script's watcher stops the cluster if the test
  // dies without running the destructor.
  if (absl::Status s = cluster->Run(absl::StrCat("start ", getpid()));
      !s.ok()) {
    return s;
  }
  const std::string urls(
      absl::StripAsciiWhitespace(ReadFile(cluster->dir_ + "/urls")));
  cluster->urls_ = absl::StrSplit(urls, ',', absl::SkipEmpty());
  if (cluster->urls_.size() != 3) {
    return absl::InternalError(absl::StrCat("unexpected urls: ", urls));
  }
  return cluster;
}

NatsCluster::~NatsCluster() {
  Run("stop").IgnoreError();
  if (std::getenv("KEEP_WORK") == nullptr) {
    std::system(absl::StrCat("rm -rf '", dir_, "'").c_str());
  }
}

absl::Status NatsCluster::Run(const std::string& args) const {
  // `start DIR PID`, `kill DIR N` ...: the folder comes second.
  std::vector<std::string> parts = absl::StrSplit(args, ' ');
  std::string command =
      absl::StrCat("bash '", kScript, "' ", parts[0], " '", dir_, "'");
  for (size_t i = 1; i < parts.size(); ++i) {
    absl::StrAppend(&command, " ", parts[i]);
  }
  absl::StrAppend(&command, " >>'", dir_, "/script.log' 2>&1");
  const int rc = std::system(command.c_str());
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("nats_cluster.sh ", args, " failed (", rc,
                     "): ", ReadFile(dir_ + "/script.log")));
  }
  return absl::OkStatus();
}

absl::Status NatsCluster::Kill(int node) {
  return Run(absl::StrCat("kill ", node));
}
absl::Status NatsCluster::Stop(int node) {
  return Run(absl::StrCat("term ", node));
}
absl::Status NatsCluster::Restart(int node) {
  return Run(absl::StrCat("restart ", node));
}

absl::Status NatsCluster::Pause(int node) {
  return Run(absl::StrCat("pause ", node));
}
absl::Status NatsCluster::Resume(int node) {
  return Run(absl::StrCat("resume ", node));
}

int NatsCluster::NodeOf(const std::string& server_name) {
  if (server_name == "n1") return 1;
  if (server_name == "n2") return 2;
  if (server_name == "n3") return 3;
  return 0;
}

std::string NatsCluster::Logs() const {
  std::string out;
  for (int n = 1; n <= 3; ++n) {
    const std::string log = ReadFile(absl::StrCat(dir_, "/n", n, ".log"));
    const size_t from = log.size() > 1500 ? log.size() - 1500 : 0;
    absl::StrAppend(&out, "--- n", n, ".log (end)\n", log.substr(from));
  }
  return out;
}

NatsCluster* NatsClusterTest::cluster_ = nullptr;

void NatsClusterTest::SetUpTestSuite() {
  if (!NatsServerInstalled()) return;
  auto cluster = NatsCluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  cluster_ = cluster->release();
}

void NatsClusterTest::TearDownTestSuite() {
  delete cluster_;
  cluster_ = nullptr;
}

void NatsClusterTest::SetUp() {
  if (!NatsServerInstalled()) {
    GTEST_SKIP() << "nats-server is not installed (Debian: nats-server; "
                    "scripts/lib/common.sh installs it)";
  }
  ASSERT_NE(cluster_, nullptr) << "the suite's NATS cluster did not start";
}

}  // namespace outbox::testing
