#include "common/config.h"

#include <signal.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
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

absl::Status CheckFlagArguments(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (!absl::StartsWith(a, "-") || a == "-") continue;  // positional
    if (a == "--") break;
    absl::string_view name = absl::StripPrefix(absl::StripPrefix(a, "-"), "-");
    std::optional<absl::string_view> value;
    if (const size_t eq = name.find('='); eq != absl::string_view::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    // Abseil's own: flags from elsewhere, and the usage flags (which it
    // does not register).
    for (absl::string_view own :
         {"flagfile", "fromenv", "tryfromenv", "undefok", "help", "helpfull",
          "helpshort", "helppackage", "helpon", "helpmatch", "version",
          "only_check_args"}) {
      if (name == own) return absl::OkStatus();
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && !value.has_value() && absl::StartsWith(name, "no")) {
      absl::CommandLineFlag* negated =
          absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) continue;
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, " (--helpfull lists them)"));
    }
    if (!value.has_value()) {
      if (flag->IsOfType<bool>()) continue;
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " needs a value"));
      }
      value = argv[++i];
    }
    std::string error;
    if (!flag->ParseFrom(*value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, "=\"", *value, "\": ", error));
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

// A flag's file as the usage shows it: "relay/main.cc", not the build's
// path to it ("/src/outbox/relay/main.cc", "../../relay/main.cc").
std::string SourceFile(absl::string_view file) {
  constexpr absl::string_view kThis = __FILE__;
  constexpr absl::string_view kHere = "common/config.cc";
  if (absl::EndsWith(kThis, kHere) &&
      absl::ConsumePrefix(&file,
                          kThis.substr(0, kThis.size() - kHere.size()))) {
    return std::string(file);
  }
  while (absl::ConsumePrefix(&file, "../") ||
         absl::ConsumePrefix(&file, "./") || absl::ConsumePrefix(&file, "/")) {
  }
  return std::string(file);
}

void SetUsage(const char* usage) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  // --help lists the binary's own flags (abseil's default: those of a file
  // named after the binary, which none is); --helpfull adds abseil's.
  config.contains_help_flags = [](absl::string_view file) {
    return !absl::StrContains(file, "absl/");
  };
  config.normalize_filename = SourceFile;
  absl::SetFlagsUsageConfig(config);
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
  SetUsage(usage);
  if (absl::Status s = ApplyFlagsFromEnvironment(); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], std::string(s.message()).c_str());
    std::exit(2);
  }
  // Before abseil's parse, which exits 1 on a bad flag.
  if (absl::Status s = CheckFlagArguments(argc, argv); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], std::string(s.message()).c_str());
    std::exit(2);
  }
  // As absl::ParseCommandLine, but the usage flags (--help, --helpfull,
  // --version ...) end the process with 0 rather than abseil's 1: help
  // that was asked for is not a failure.
  std::vector<char*> positional = absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  if (absl::flags_internal::HandleUsageFlags(
          std::cout, absl::ProgramUsageMessage()) != -1) {
    std::cout.flush();
    std::exit(0);
  }
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
