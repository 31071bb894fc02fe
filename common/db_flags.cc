#include "common/db_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(absl::Duration, statement_timeout,
          outbox::DbSession{}.statement_timeout,
          "PostgreSQL statement_timeout of every session: a statement running "
          "longer fails and is retried later. 0 keeps the server's setting.");
ABSL_FLAG(absl::Duration, lock_timeout, outbox::DbSession{}.lock_timeout,
          "PostgreSQL lock_timeout of every session: a lock wait longer than "
          "this fails and is retried later. 0 keeps the server's setting.");
ABSL_FLAG(absl::Duration, idle_in_transaction_session_timeout,
          outbox::DbSession{}.idle_in_transaction_timeout,
          "PostgreSQL idle_in_transaction_session_timeout of every session: "
          "the server ends a session left idle inside a transaction this "
          "long. 0 keeps the server's setting.");

namespace outbox {

DbSession DbSessionFromFlags() {
  DbSession s;
  s.statement_timeout = absl::GetFlag(FLAGS_statement_timeout);
  s.lock_timeout = absl::GetFlag(FLAGS_lock_timeout);
  s.idle_in_transaction_timeout =
      absl::GetFlag(FLAGS_idle_in_transaction_session_timeout);
  return s;
}

}  // namespace outbox
