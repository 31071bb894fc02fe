#include "common/db_flags.h"

#include <spdlog/spdlog.h>

#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

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

ABSL_FLAG(std::string, db_pooler, "auto",
          "How the database is reached: auto (find out per connection: "
          "behind a connection pooler such as PgBouncer, work as in "
          "transaction mode), none (directly; refuse a pooler), session "
          "(a pooler in pool_mode=session) or transaction (a pooler in "
          "pool_mode=transaction: nothing kept in the server session).");

namespace outbox {

absl::StatusOr<DbSession> CheckedDbSessionFromFlags() {
  DbSession s;
  s.statement_timeout = absl::GetFlag(FLAGS_statement_timeout);
  s.lock_timeout = absl::GetFlag(FLAGS_lock_timeout);
  s.idle_in_transaction_timeout =
      absl::GetFlag(FLAGS_idle_in_transaction_session_timeout);
  auto pooler = ParsePooler(absl::GetFlag(FLAGS_db_pooler));
  if (!pooler.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--db_pooler: ", pooler.status().message()));
  }
  s.pooler = *pooler;
  return s;
}

DbSession DbSessionFromFlags() {
  absl::StatusOr<DbSession> s = CheckedDbSessionFromFlags();
  if (!s.ok()) {
    spdlog::critical("{}", std::string(s.status().message()));
    std::exit(2);
  }
  return *s;
}

}  // namespace outbox
