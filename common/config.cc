#include "common/config.h"

#include <signal.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"

ABSL_FLAG(std::string, log_format, "text", "Log format: text or json.");
ABSL_FLAG(std::string, log_level, "info",
          "Log level: trace, debug, info, warn or error.");

namespace outbox {

std::string EnvNameForFlag(const std::string& flag) {
  std::string name = "OUTBOX_";
  for (char c : flag) {
    name.push_back(c == '-' ? '_'
                            : static_cast<char>(
                                  std::toupper(static_cast<unsigned char>(c))));
  }
  return name;
}

absl::Status ApplyFlagsFromEnvironment() {
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const char* value = std::getenv(EnvNameForFlag(std::string(name)).c_str());
    if (value == nullptr) continue;
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat(
          EnvNameForFlag(std::string(name)), "=\"", value, "\": ", error));
    }
  }
  return absl::OkStatus();
}

namespace {
sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}
}  // namespace

std::vector<char*> InitProcess(int argc, char** argv, const char* usage) {
  // Blocked before any thread starts, so every thread inherits the mask and
  // only WaitForTerminationSignal receives them.
  sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // A peer that disappears mid-write must not kill the process.
  signal(SIGPIPE, SIG_IGN);

  // Abseil checks every mutex acquisition for lock-order cycles unless told
  // not to: a cost on every lock in gRPC's hot paths, for a debugging aid.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(usage);
  if (absl::Status s = ApplyFlagsFromEnvironment(); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], std::string(s.message()).c_str());
    std::exit(2);
  }
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (absl::Status s = InitLogging(absl::GetFlag(FLAGS_log_format),
                                   absl::GetFlag(FLAGS_log_level));
      !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], std::string(s.message()).c_str());
    std::exit(2);
  }
  return positional;
}

bool TerminationRequested() {
  sigset_t pending;
  sigemptyset(&pending);
  sigpending(&pending);
  return sigismember(&pending, SIGINT) == 1 ||
         sigismember(&pending, SIGTERM) == 1;
}

std::optional<std::string> WaitForTerminationSignal(absl::Duration timeout) {
  sigset_t set = TerminationSignals();
  const timespec ts = absl::ToTimespec(timeout);
  const int sig = sigtimedwait(&set, nullptr, &ts);
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  return std::nullopt;
}

std::string WaitForTerminationSignal() {
  sigset_t set = TerminationSignals();
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig == SIGINT ? "SIGINT" : "SIGTERM";
}

}  // namespace outbox
