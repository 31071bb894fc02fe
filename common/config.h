#pragma once
// Process start-up shared by every binary: flags (each also read from the
// environment as OUTBOX_<FLAG_IN_UPPER_SNAKE>, the flag winning), logging and
// signal handling.

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace outbox {

// The environment variable that sets `flag`: "db_pool_size" ->
// "OUTBOX_DB_POOL_SIZE".
std::string EnvNameForFlag(const std::string& flag);

// Sets every registered abseil flag whose OUTBOX_* variable is present in
// the environment. Call before absl::ParseCommandLine so that flags win.
// Returns InvalidArgument naming the variable if a value does not parse.
absl::Status ApplyFlagsFromEnvironment();

// Checks the flags on a command line (argv[1..argc), up to "--") before
// abseil parses it: each must be a registered flag, given a value it takes
// (as absl::ParseCommandLine reads them: --name=value, --name value,
// --name and --noname for a bool). Returns InvalidArgument naming the first
// that is not. From one of abseil's own flags on (--flagfile, --fromenv,
// --tryfromenv, --undefok, whose flags come from elsewhere, and the usage
// flags such as --help) it checks nothing: abseil does. Setting a flag to
// the value it checks is its only effect; the parse sets it again.
absl::Status CheckFlagArguments(int argc, char** argv);

// Everything a binary does first: blocks SIGINT/SIGTERM in every thread
// (WaitForTerminationSignal picks them up), applies the environment, parses
// the command line (exiting 2 with a message naming an unknown or bad flag,
// as a usage error: a tool's 1 means what it found, not a typo; exiting 0
// after the help that --help, --helpfull and the like ask for) and
// sets up logging from --log_format and --log_level. Returns the positional
// arguments (argv[0] first).
std::vector<char*> InitProcess(int argc, char** argv, const char* usage);

// Blocks until SIGINT or SIGTERM arrives; returns the signal's name.
std::string WaitForTerminationSignal();

// As above, but for at most `timeout`: nothing if no signal came.
std::optional<std::string> WaitForTerminationSignal(absl::Duration timeout);

// True if SIGINT or SIGTERM arrived and nobody has waited for it yet: lets
// start-up loops (migrations retrying an unreachable database) stop early.
bool TerminationRequested();

}  // namespace outbox
