#pragma once
// The database session limits every binary takes as flags (and as
// OUTBOX_STATEMENT_TIMEOUT, ... from the environment). Read them in main and
// hand the result to Database, Connect and Migrate.

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/db.h"

ABSL_DECLARE_FLAG(absl::Duration, statement_timeout);
ABSL_DECLARE_FLAG(absl::Duration, lock_timeout);
ABSL_DECLARE_FLAG(absl::Duration, idle_in_transaction_session_timeout);
ABSL_DECLARE_FLAG(std::string, db_pooler);

namespace outbox {

// The session limits and pooler mode the flags ask for; InvalidArgument
// naming the flag for a value that is not one.
absl::StatusOr<DbSession> CheckedDbSessionFromFlags();

// CheckedDbSessionFromFlags for a binary's main: a bad value is logged and
// the process exits with code 2.
DbSession DbSessionFromFlags();

}  // namespace outbox
