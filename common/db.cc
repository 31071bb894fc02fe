#include "common/db.h"

#include <libpq-fe.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/config.h"
#include "common/sql_state.h"

namespace outbox {
namespace {

constexpr char kSqlStatePayload[] = "outbox.sqlstate";
// Advisory lock class for migrations; the second key is the schema name's
// hash, so the orders and billing schemas do not wait for each other.
constexpr int kMigrationLockClass = 0x0b0c;

bool IsUrl(const std::string& url) {
  return absl::StartsWith(url, "postgresql://") ||
         absl::StartsWith(url, "postgres://");
}

// libpqxx 6.4 throws some server errors as typed exceptions without their
// SQLSTATE (08xxx as broken_connection, 40xxx, 42501, 53300): recover it
// from the type, so that sql_state.h's rule still applies.
std::string SqlStateOfType(const std::exception& e) {
  if (dynamic_cast<const pqxx::too_many_connections*>(&e)) return "53300";
  if (dynamic_cast<const pqxx::serialization_failure*>(&e)) return "40001";
  if (dynamic_cast<const pqxx::deadlock_detected*>(&e)) return "40P01";
  if (dynamic_cast<const pqxx::statement_completion_unknown*>(&e))
    return "40003";
  if (dynamic_cast<const pqxx::transaction_rollback*>(&e)) return "40000";
  if (dynamic_cast<const pqxx::insufficient_privilege*>(&e)) return "42501";
  return "";
}

std::string FirstLine(const char* what) {
  std::string s(what);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// Appends the setting `key`=`value` to `conninfo`, a postgresql:// URL (a
// query parameter, percent-encoded) or a key=value string (quoted when it
// needs to be). libpq takes the last value of a key.
void AppendSetting(std::string* conninfo, absl::string_view key,
                   absl::string_view value) {
  const auto plain = [](unsigned char c) {
    return absl::ascii_isalnum(c) || c == '-' || c == '.' || c == '_' ||
           c == '~';
  };
  if (IsUrl(*conninfo)) {
    static const char kHex[] = "0123456789ABCDEF";
    absl::StrAppend(conninfo, absl::StrContains(*conninfo, "?") ? "&" : "?",
                    key, "=");
    for (unsigned char c : value) {
      if (plain(c)) {
        *conninfo += static_cast<char>(c);
      } else {
        *conninfo += '%';
        *conninfo += kHex[c >> 4];
        *conninfo += kHex[c & 15];
      }
    }
    return;
  }
  absl::StrAppend(conninfo, " ", key, "=");
  if (!value.empty() && std::all_of(value.begin(), value.end(), plain)) {
    absl::StrAppend(conninfo, value);
    return;
  }
  *conninfo += '\'';
  for (char c : value) {
    if (c == '\\' || c == '\'') *conninfo += '\\';
    *conninfo += c;
  }
  *conninfo += '\'';
}

}  // namespace

std::string WithConnectionDefaults(const std::string& url) {
  static const std::pair<const char*, const char*> kDefaults[] = {
      {"connect_timeout", "5"},  {"keepalives", "1"},
      {"keepalives_idle", "10"}, {"keepalives_interval", "5"},
      {"keepalives_count", "3"}, {"tcp_user_timeout", "30000"},
  };
  // What the caller set, as libpq itself reads the string (a value that
  // merely contains "connect_timeout=", such as a password, sets nothing).
  char* error = nullptr;
  PQconninfoOption* opts = PQconninfoParse(url.c_str(), &error);
  if (opts == nullptr) {
    PQfreemem(error);
    return url;  // connecting reports what is wrong with it
  }
  std::set<std::string> given;
  for (const PQconninfoOption* o = opts; o->keyword != nullptr; ++o) {
    if (o->val != nullptr && o->val[0] != '\0') given.insert(o->keyword);
  }
  PQconninfoFree(opts);
  // libpq's own default from the environment, which a setting here would
  // override.
  const char* env_timeout = std::getenv("PGCONNECT_TIMEOUT");
  if (env_timeout != nullptr && env_timeout[0] != '\0') {
    given.insert("connect_timeout");
  }
  std::string out = url;
  for (const auto& [key, value] : kDefaults) {
    if (given.count(key) == 0) AppendSetting(&out, key, value);
  }
  return out;
}

std::string WithPassword(const std::string& url, const std::string& password) {
  if (password.empty()) return url;
  std::string out = url;
  // Last, so it wins over a password in the URL's user part or earlier on.
  AppendSetting(&out, "password", password);
  return out;
}

void ArrayLiteral::Add(absl::string_view v) {
  out_ += out_.empty() ? "{\"" : ",\"";
  for (char c : v) {
    if (c == '"' || c == '\\') out_ += '\\';
    out_ += c;
  }
  out_ += '"';
}

void ArrayLiteral::Add(int64_t v) { Add(absl::StrCat(v)); }

void ArrayLiteral::AddHex(absl::string_view bytes) {
  static const char kHex[] = "0123456789abcdef";
  out_ += out_.empty() ? "{\"" : ",\"";
  for (unsigned char c : bytes) {
    out_.push_back(kHex[c >> 4]);
    out_.push_back(kHex[c & 15]);
  }
  out_ += '"';
}

absl::StatusOr<Pooler> ParsePooler(absl::string_view name) {
  if (name == "auto") return Pooler::kAuto;
  if (name == "none") return Pooler::kNone;
  if (name == "session") return Pooler::kSession;
  if (name == "transaction") return Pooler::kTransaction;
  return absl::InvalidArgumentError(absl::StrCat(
      "must be auto, none, session or transaction, not \"", name, "\""));
}

std::string SessionSettingsSql(const DbSession& session, bool local,
                               bool durable_already) {
  auto ms = [](absl::Duration d) {
    return absl::StrCat(std::max<int64_t>(0, absl::ToInt64Milliseconds(d)));
  };
  const char* set = local ? "SET LOCAL " : "SET ";
  std::string sql = absl::StrCat(
      durable_already ? "" : absl::StrCat(set, "synchronous_commit = on; "),
      set, "statement_timeout = ", ms(session.statement_timeout), "; ", set,
      "lock_timeout = ", ms(session.lock_timeout), "; ", set,
      "idle_in_transaction_session_timeout = ",
      ms(session.idle_in_transaction_timeout),
      // Every statement here is short: JIT compiling one costs far more
      // than it saves, and the planner's cost, its trigger, grows with the
      // children of a partitioned outbox (a 1 ms read of the subscriptions
      // compiled 132 functions for 470 ms there).
      "; ", set, "jit = off");
  if (!local) {
    // Every statement here is written for READ COMMITTED (a snapshot per
    // statement, taken after the locks before it): a database or role whose
    // default is stricter would, say, let a tick take its snapshot before
    // the lock that orders ticks. Behind a transaction pooler a SET would
    // stay with the server session; outbox_tick() refuses there instead.
    absl::StrAppend(&sql,
                    "; SET default_transaction_isolation = 'read committed'");
  }
  if (session.generic_plans && !local) {
    absl::StrAppend(&sql, "; SET plan_cache_mode = force_generic_plan");
  }
  return sql;
}

// libpqxx keeps no data of ours with a connection; an error handler is the
// one thing it lets us attach and find again (by its type, as libpqxx's
// documentation suggests). It passes every notice on.
class Connection::Tag : public pqxx::errorhandler {
 public:
  explicit Tag(pqxx::connection_base& c) : pqxx::errorhandler(c) {}
  bool operator()(const char[]) noexcept override { return true; }
  SessionInfo info;
};

Connection::Connection(const std::string& conninfo)
    : pqxx::connection(conninfo), tag_(std::make_unique<Tag>(*this)) {}

// The tag goes first (a member dies before its base), unregistering itself.
Connection::~Connection() = default;

const SessionInfo& Connection::info() const { return tag_->info; }

const SessionInfo* SessionOf(const pqxx::connection_base& conn) {
  for (pqxx::errorhandler* h : conn.get_errorhandlers()) {
    if (const auto* tag = dynamic_cast<const Connection::Tag*>(h)) {
      return &tag->info;
    }
  }
  return nullptr;
}

bool IsPooled(const pqxx::connection_base& conn) {
  const SessionInfo* info = SessionOf(conn);
  return info != nullptr && info->pooled;
}

void ApplyLimits(pqxx::transaction_base& tx) {
  const SessionInfo* info = SessionOf(tx.conn());
  if (info != nullptr && info->pooled && !info->local_settings.empty()) {
    tx.exec(info->local_settings);
  }
}

std::unique_ptr<pqxx::transaction_base> OpenUnit(pqxx::connection_base& conn) {
  if (!IsPooled(conn)) return std::make_unique<pqxx::nontransaction>(conn);
  auto tx = std::make_unique<pqxx::work>(conn);
  ApplyLimits(*tx);
  return tx;
}

absl::Status InUnit(pqxx::connection_base& conn,
                    const std::function<void(pqxx::transaction_base&)>& fn) {
  try {
    auto unit = OpenUnit(conn);
    fn(*unit);
    unit->commit();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

absl::Status StatusFromException(const std::exception& e) {
  if (const auto* in_doubt = dynamic_cast<const pqxx::in_doubt_error*>(&e)) {
    return absl::UnavailableError(
        absl::StrCat("database connection lost during commit; the outcome is "
                     "unknown: ",
                     FirstLine(in_doubt->what())));
  }
  std::string state = SqlStateOfType(e);
  if (const auto* sql = dynamic_cast<const pqxx::sql_error*>(&e);
      sql != nullptr && !sql->sqlstate().empty()) {
    state = sql->sqlstate();
  }
  if (state == "23514" &&
      absl::StrContains(e.what(), "no partition of relation \"outbox\"")) {
    // A partitioned outbox without a child for the next seq: no fault of
    // the events (a relay makes children ahead, and will), so none of the
    // data classes. Without the SQLSTATE payload it counts as the world's.
    return absl::UnavailableError(absl::StrCat(
        FirstLine(e.what()), " [SQLSTATE ", state,
        "]: the partitioned outbox has no child for the next events; the "
        "relay that owns partition 0 makes them ahead "
        "(outbox_partition_seqs_left)"));
  }
  if (!state.empty()) {
    absl::Status s(
        CodeForSqlState(state),
        absl::StrCat(FirstLine(e.what()), " [SQLSTATE ", state, "]"));
    s.SetPayload(kSqlStatePayload, absl::Cord(state));
    return s;
  }
  if (dynamic_cast<const pqxx::sql_error*>(&e) != nullptr) {
    return absl::UnavailableError(FirstLine(e.what()));
  }
  if (dynamic_cast<const pqxx::broken_connection*>(&e) != nullptr) {
    return absl::UnavailableError(
        absl::StrCat("database unreachable: ", FirstLine(e.what())));
  }
  return absl::InternalError(FirstLine(e.what()));
}

std::string SqlStateOf(const absl::Status& s) {
  auto payload = s.GetPayload(kSqlStatePayload);
  return payload ? std::string(*payload) : std::string();
}

absl::StatusOr<std::unique_ptr<Connection>> Connect(
    const std::string& url, const std::string& application_name,
    const DbSession& session) {
  std::unique_ptr<Connection> conn;
  DatabaseIdentity identity;
  try {
    std::string conninfo = WithConnectionDefaults(url);
    // A startup parameter, which poolers pass on (a SET would stay behind
    // in a pooled server session).
    AppendSetting(&conninfo, "application_name", application_name);
    conn = std::make_unique<Connection>(conninfo);
    // A silent reconnect would drop session state such as advisory locks.
    // (Deprecated in libpqxx 6.4, where reactivation still exists.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    conn->inhibit_reactivation(true);
#pragma GCC diagnostic pop
    SessionInfo& info = conn->tag_->info;
    pqxx::nontransaction tx(*conn);
    const pqxx::row probe = tx.exec(kIdentitySql)[0];
    identity = IdentityFromRow(probe);
    info.identity = identity;
    // A pooler answers with a cancel key of its own, not the server's pid.
    info.pooler = probe[4].as<int>() != conn->backendpid();
    if (info.pooler && session.pooler == Pooler::kNone) {
      return absl::FailedPreconditionError(
          "a connection pooler (PgBouncer?) is between this process and the "
          "database, but --db_pooler=none says it connects directly");
    }
    info.pooled = session.pooler == Pooler::kTransaction ||
                  (session.pooler == Pooler::kAuto && info.pooler);
    if (info.pooler) {
      // In statement mode every statement may run on another server
      // session: no transaction can hold, and without transactions the
      // inbox and the outbox cannot keep their promises.
      try {
        tx.exec("BEGIN");
        tx.exec("COMMIT");
      } catch (const std::exception& e) {
        // PgBouncer answers BEGIN in statement mode with a FATAL error and
        // closes the session; libpqxx may report only the lost connection.
        if (absl::StrContains(e.what(), "statement pooling mode") ||
            dynamic_cast<const pqxx::broken_connection*>(&e) != nullptr) {
          return absl::FailedPreconditionError(
              "the database is reached through a connection pooler that "
              "refused a transaction (PgBouncer in pool_mode=statement runs "
              "each statement on its own): the outbox and the inbox need "
              "transactions; use pool_mode=transaction or session");
        }
        throw;
      }
    }
    // Acknowledged work must survive a server crash, whatever the server's
    // default; a setting that waits longer (remote_write, remote_apply: a
    // synchronous standby) is kept.
    const std::string sync = probe[5].as<std::string>();
    const bool durable =
        sync == "on" || sync == "remote_write" || sync == "remote_apply";
    if (info.pooled) {
      info.local_settings =
          SessionSettingsSql(session, /*local=*/true, durable);
    } else {
      tx.exec(SessionSettingsSql(session, /*local=*/false, durable));
    }
  } catch (const std::exception& e) {
    absl::Status s = StatusFromException(e);
    return absl::UnavailableError(
        absl::StrCat("cannot connect to the database: ", s.message()));
  }
  if (session.identity_watch != nullptr) {
    session.identity_watch->Observe(identity);
  }
  return conn;
}

Database::Database(std::string url, int pool_size, std::string application_name,
                   DbSession session,
                   std::function<void(pqxx::connection&)> on_connect)
    : url_(std::move(url)),
      application_name_(std::move(application_name)),
      session_(session),
      on_connect_(std::move(on_connect)),
      free_slots_(pool_size > 0 ? pool_size : 1) {}

Database::~Database() = default;

std::unique_ptr<Connection> Database::Acquire(absl::Duration timeout,
                                              absl::Status* status) {
  {
    absl::MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + timeout;
    while (idle_.empty() && free_slots_ == 0) {
      if (cv_.WaitWithDeadline(&mu_, deadline) && idle_.empty() &&
          free_slots_ == 0) {
        *status = absl::UnavailableError(
            "all database connections are busy; try again");
        return nullptr;
      }
    }
    if (!idle_.empty()) {
      auto conn = std::move(idle_.back());
      idle_.pop_back();
      return conn;
    }
    --free_slots_;
  }
  auto conn = Connect(url_, application_name_, session_);
  if (conn.ok() && on_connect_) {
    try {
      on_connect_(**conn);
    } catch (const std::exception& e) {
      conn = StatusFromException(e);
    }
  }
  if (!conn.ok()) {
    absl::MutexLock lock(&mu_);
    ++free_slots_;
    cv_.Signal();
    *status = conn.status();
    return nullptr;
  }
  return std::move(*conn);
}

void Database::Release(std::unique_ptr<Connection> conn) {
  absl::MutexLock lock(&mu_);
  if (conn != nullptr && conn->is_open()) {
    idle_.push_back(std::move(conn));
  } else {
    ++free_slots_;
  }
  cv_.Signal();
}

absl::Status Database::Run(
    const std::function<absl::Status(pqxx::connection&)>& fn,
    absl::Duration acquire_timeout) {
  absl::Status status;
  std::unique_ptr<Connection> conn = Acquire(acquire_timeout, &status);
  if (conn == nullptr) return status;
  try {
    if (conn->info().pooled && session_.identity_watch != nullptr) {
      bool due;
      {
        absl::MutexLock lock(&mu_);
        due = absl::Now() >= next_identity_check_;
        if (due) next_identity_check_ = absl::Now() + absl::Seconds(5);
      }
      if (due) {
        pqxx::nontransaction tx(*conn);
        session_.identity_watch->Observe(ReadIdentity(tx));
      }
    }
    status = fn(*conn);
  } catch (const std::exception& e) {
    status = StatusFromException(e);
    if (OriginOf(status) == ErrorOrigin::kWorld) {
      // A fresh session may reach a new primary, or at least starts clean.
      spdlog::warn("database: {}; dropping the connection",
                   std::string(status.message()));
      conn.reset();
    }
  }
  Release(std::move(conn));
  return status;
}

absl::Status Migrate(const std::string& url, const std::string& schema_name,
                     const std::vector<Migration>& migrations,
                     absl::Duration wait, const DbSession& session) {
  const absl::Time deadline = absl::Now() + wait;
  DbSession migrating = session;
  migrating.statement_timeout =
      std::max(session.statement_timeout, kMigrationStatementTimeout);
  absl::Status last;
  for (int attempt = 0;; ++attempt) {
    auto conn = Connect(url, "outbox-migrate", migrating);
    if (absl::IsFailedPrecondition(conn.status())) return conn.status();
    if (conn.ok()) {
      try {
        pqxx::work tx(**conn);
        ApplyLimits(tx);
        tx.exec_params("SELECT pg_advisory_xact_lock($1, hashtext($2))",
                       kMigrationLockClass, schema_name);
        tx.exec(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " schema_name text NOT NULL,"
            " version int NOT NULL,"
            " name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now(),"
            " PRIMARY KEY (schema_name, version))");
        int current = tx.exec_params(
                            "SELECT coalesce(max(version), 0) FROM "
                            "schema_migrations WHERE schema_name = $1",
                            schema_name)[0][0]
                          .as<int>();
        int applied = 0;
        for (const Migration& m : migrations) {
          if (m.version <= current) continue;
          tx.exec(m.sql);
          tx.exec_params(
              "INSERT INTO schema_migrations (schema_name, version, name) "
              "VALUES ($1, $2, $3)",
              schema_name, m.version, m.name);
          ++applied;
        }
        tx.commit();
        if (applied > 0) {
          spdlog::info("migrations: {} applied {} (now at version {})",
                       schema_name, applied, migrations.back().version);
        }
        return absl::OkStatus();
      } catch (const std::exception& e) {
        last = StatusFromException(e);
        if (OriginOf(last) == ErrorOrigin::kData) return last;
      }
    } else {
      last = conn.status();
    }
    if (absl::Now() > deadline) return last;
    spdlog::warn("migrations: {}; retrying", std::string(last.message()));
    for (int i = 0; i < 10; ++i) {
      if (TerminationRequested()) {
        return absl::CancelledError(
            "terminated while waiting for the database");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
}

}  // namespace outbox
