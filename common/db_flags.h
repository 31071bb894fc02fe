#pragma once
// The database session limits every binary takes as flags (and as
// OUTBOX_STATEMENT_TIMEOUT, ... from the environment). Read them in main and
// hand the result to Database, Connect and Migrate.

#include "absl/flags/declare.h"
#include "absl/time/time.h"
#include "common/db.h"

ABSL_DECLARE_FLAG(absl::Duration, statement_timeout);
ABSL_DECLARE_FLAG(absl::Duration, lock_timeout);
ABSL_DECLARE_FLAG(absl::Duration, idle_in_transaction_session_timeout);

namespace outbox {

// The session limits the flags ask for.
DbSession DbSessionFromFlags();

}  // namespace outbox
