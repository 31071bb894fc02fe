#pragma once
// PostgreSQL access shared by the services: connections that know what
// they reached (the database's identity, a connection pooler), a small pool
// that survives database restarts and failovers, translation of libpqxx
// exceptions into absl::Status (SQLSTATE kept), and versioned migrations.
//
// Behind a connection pooler in transaction mode (PgBouncer's
// pool_mode=transaction) each transaction may run on another server
// session, so nothing may live in a session: a connection made by Connect
// then sets no session settings (ApplyLimits sets them per transaction),
// and ExecPrepared runs its statement unnamed.

#include <functional>
#include <memory>
#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/db_identity.h"

namespace outbox {

// `url` with client-side liveness settings added (connect timeout, TCP
// keepalives, TCP user timeout) unless the caller set them (in `url`, or
// the connect timeout as PGCONNECT_TIMEOUT), so that a dead or unreachable
// server surfaces as an error instead of a hang.
std::string WithConnectionDefaults(const std::string& url);

// `url` (a postgresql:// URL or a key=value string) with `password` as its
// password, over one in `url` and over PGPASSWORD; `url` itself if
// `password` is empty. For a process with two databases whose roles have
// different passwords: libpq's PGPASSWORD is one for every connection.
std::string WithPassword(const std::string& url, const std::string& password);

// The status for a libpqxx (or other) exception. A server error gets the
// code of its SQLSTATE (CodeForSqlState in common/sql_state.h: the one rule
// of whose fault an error is), keeps the SQLSTATE (SqlStateOf) and ends
// with "[SQLSTATE xxxxx]"; a broken connection or an in-doubt commit is
// Unavailable; anything else Internal.
absl::Status StatusFromException(const std::exception& e);

// The SQLSTATE that StatusFromException recorded in `s`, or "".
std::string SqlStateOf(const absl::Status& s);

// How sessions reach the database.
enum class Pooler {
  // Each connection finds out: a pooler is between it and the server when
  // the backend pid the server reports differs from the connection's (a
  // pooler hands out keys of its own); then it works as kTransaction.
  kAuto,
  kNone,         // direct; a pooler found anyway is refused
  kSession,      // a pooler in session mode: a server session per connection
  kTransaction,  // a pooler in transaction mode: nothing in the session
};

// "auto", "none", "session" or "transaction"; InvalidArgument otherwise.
absl::StatusOr<Pooler> ParsePooler(absl::string_view name);

// Limits every session sets, so that no statement, lock wait or forgotten
// transaction can hold a connection (and the work behind it) forever. A
// statement that hits one fails with a kWorld error (57014, 55P03, 25P03):
// it costs a retry, never data. Zero leaves the server's setting.
struct DbSession {
  absl::Duration statement_timeout = absl::Seconds(30);
  absl::Duration lock_timeout = absl::Seconds(5);
  absl::Duration idle_in_transaction_timeout = absl::Seconds(60);
  // plan_cache_mode = force_generic_plan: each prepared statement is
  // planned once per connection. Only for sessions whose every statement is
  // written to stay a lookup by key in a generic plan (the services' hot
  // paths; their tests force generic plans to check it). Left to itself,
  // PostgreSQL plans such a statement again on every call whenever the
  // generic plan's estimate (10 rows for the unnest of an array parameter)
  // exceeds that of a plan for the 1-3 elements actually passed, and that
  // planning cost more than the execution.
  bool generic_plans = false;
  Pooler pooler = Pooler::kAuto;
  // Hears the identity of the database each new connection reached (and,
  // for a pooled one, of every Database::Run now and then). Not owned; may
  // be null.
  IdentityWatch* identity_watch = nullptr;
};

// The SET statements that apply `session` (one string, for one round trip):
// synchronous_commit on (unless `durable_already`: the server's setting
// waits at least as long, e.g. remote_apply for a synchronous standby) and
// the limits; with `local`, SET LOCAL (for one transaction).
std::string SessionSettingsSql(const DbSession& session, bool local = false,
                               bool durable_already = false);

// What Connect learned about a connection's session.
struct SessionInfo {
  // Through a pooler that may run each transaction on another server
  // session: no session settings, no named prepared statements.
  bool pooled = false;
  bool pooler = false;         // any pooler between it and the server
  std::string local_settings;  // what ApplyLimits runs when pooled
  DatabaseIdentity identity;   // of the database, when it connected
};

// A connection opened by Connect: a pqxx::connection that carries its
// SessionInfo.
class Connection : public pqxx::connection {
 public:
  explicit Connection(const std::string& conninfo);
  ~Connection();
  const SessionInfo& info() const;

 private:
  friend absl::StatusOr<std::unique_ptr<Connection>> Connect(const std::string&,
                                                             const std::string&,
                                                             const DbSession&);
  friend const SessionInfo* SessionOf(const pqxx::connection_base& conn);
  class Tag;  // carries the info where SessionOf finds it
  std::unique_ptr<Tag> tag_;
};

// The SessionInfo of a connection Connect opened; null for any other (a
// caller's own connection: direct, as far as this code can tell).
const SessionInfo* SessionOf(const pqxx::connection_base& conn);

// True when `conn` is pooled (see SessionInfo).
bool IsPooled(const pqxx::connection_base& conn);

// The session's limits for the rest of `tx`, when its connection is pooled
// (SET LOCAL: one round trip); nothing otherwise, where Connect set them for
// the session. Call it first in each transaction a binary opens.
void ApplyLimits(pqxx::transaction_base& tx);

// A unit of statements that would run in autocommit: on a direct
// connection a pqxx::nontransaction; on a pooled one a transaction that
// applies the limits first, so that no statement runs without them. Call
// commit() at the end either way.
std::unique_ptr<pqxx::transaction_base> OpenUnit(pqxx::connection_base& conn);
// Runs `fn` in a unit of `conn` (OpenUnit) and commits it. What `fn` or the
// commit throws is returned as a status (StatusFromException).
absl::Status InUnit(pqxx::connection_base& conn,
                    const std::function<void(pqxx::transaction_base&)>& fn);

// Opens a connection, reads the identity of the database it reached (and
// tells session.identity_watch), finds out whether a pooler is in between
// (see Pooler) and, unless pooled, applies the session settings
// (synchronous_commit on and `session`'s limits); application_name goes in
// the connection string, which poolers pass on. Unavailable on failure;
// FailedPrecondition when the pooler cannot give this code what it needs
// (statement mode: no transactions; or a pooler with Pooler::kNone), which
// a binary must refuse to start with.
absl::StatusOr<std::unique_ptr<Connection>> Connect(
    const std::string& url, const std::string& application_name,
    const DbSession& session = {});

// A fixed-size pool of connections opened on demand. A connection that
// breaks is dropped and reopened by a later caller, so the pool recovers by
// itself when the database comes back. Thread-safe.
class Database {
 public:
  // `on_connect` runs once on each new connection (e.g. to prepare
  // statements).
  Database(std::string url, int pool_size, std::string application_name,
           DbSession session = {},
           std::function<void(pqxx::connection&)> on_connect = nullptr);
  ~Database();
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  // Runs `fn` on a pooled connection. Exceptions thrown by `fn` become
  // statuses (see StatusFromException). Waits up to `acquire_timeout` for a
  // free connection. `fn` owns transactions; it must not keep the reference.
  // On a pooled connection the database's identity is read again when it
  // was last read over 5 s ago (behind a pooler a failover breaks no
  // connection of ours).
  absl::Status Run(const std::function<absl::Status(pqxx::connection&)>& fn,
                   absl::Duration acquire_timeout = absl::Seconds(5));

  const std::string& url() const { return url_; }
  const DbSession& session() const { return session_; }

 private:
  std::unique_ptr<Connection> Acquire(absl::Duration timeout,
                                      absl::Status* status);
  void Release(std::unique_ptr<Connection> conn);

  const std::string url_;
  const std::string application_name_;
  const DbSession session_;
  const std::function<void(pqxx::connection&)> on_connect_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::vector<std::unique_ptr<Connection>> idle_ ABSL_GUARDED_BY(mu_);
  absl::Time next_identity_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int free_slots_ ABSL_GUARDED_BY(mu_);  // connections that may still be opened
};

// A PostgreSQL array literal, to pass a whole batch as one parameter:
//
//   ArrayLiteral ids;
//   for (const auto& id : batch) ids.Add(id);
//   tx.exec_params("... unnest($1::text[]) ...", ids.str());
//
// Every element is quoted, so the literal casts to text[], uuid[] or
// bigint[] alike.
class ArrayLiteral {
 public:
  ArrayLiteral() = default;
  template <typename C>
  explicit ArrayLiteral(const C& values) {
    for (const auto& v : values) Add(v);
  }
  void Add(absl::string_view v);
  void Add(int64_t v);
  // Bytes as hex, for a text[] parameter the SQL turns back with
  // decode(x, 'hex') (bytea[] literals would need escaping).
  void AddHex(absl::string_view bytes);
  std::string str() const { return out_.empty() ? "{}" : out_ + "}"; }
  bool empty() const { return out_.empty(); }

 private:
  std::string out_;
};

// Runs `sql` as the prepared statement `name` of tx's connection: parsed
// and planned once per connection (on first use), then only executed.
// `name` must always name the same `sql`.
//
//   pqxx::result r = ExecPrepared(tx, "cursors", kCursorsSql, ids.str());
//
// On a pooled connection (IsPooled) the statement runs unnamed instead: a
// named one prepared in one server session may not exist in the next.
template <typename... Args>
pqxx::result ExecPrepared(pqxx::transaction_base& tx, const char* name,
                          const char* sql, Args&&... args) {
  if (IsPooled(tx.conn())) {
    return tx.exec_params(sql, std::forward<Args>(args)...);
  }
  tx.conn().prepare(name, sql);  // registers once; then a lookup
  return tx.exec_prepared(name, std::forward<Args>(args)...);
}

// One schema change. Versions start at 1 and never change once released.
struct Migration {
  int version;
  const char* name;
  const char* sql;
};

// A named list of migrations: schema_migrations records each name's
// versions apart, so several owners (the outbox, the inbox engine, a
// handler, an application) share one database.
struct Schema {
  std::string name;
  const std::vector<Migration>* migrations;
};

// Applies the migrations not yet recorded in schema_migrations, in version
// order, in one transaction under an advisory lock, so that replicas
// starting at once apply each migration exactly once. Retries kWorld errors
// (an unreachable or read-only database, a lock wait that timed out behind
// another replica's migration) up to `wait`; Cancelled if SIGINT or SIGTERM
// arrives meanwhile; FailedPrecondition at once when Connect refuses the
// database (a pooler that cannot serve it). The migration's statements may
// run longer than `session.statement_timeout` (a migration may rewrite a
// large table), up to kMigrationStatementTimeout.
absl::Status Migrate(const std::string& url, const std::string& schema_name,
                     const std::vector<Migration>& migrations,
                     absl::Duration wait = absl::Seconds(30),
                     const DbSession& session = {});

inline constexpr absl::Duration kMigrationStatementTimeout = absl::Minutes(10);

}  // namespace outbox
