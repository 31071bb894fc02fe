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

std::string SessionSettingsSql(const DbSession& session) {
  auto ms = [](absl::Duration d) {
    return absl::StrCat(std::max<int64_t>(0, absl::ToInt64Milliseconds(d)));
  };
  return absl::StrCat("SET statement_timeout = ", ms(session.statement_timeout),
                      "; SET lock_timeout = ", ms(session.lock_timeout),
                      "; SET idle_in_transaction_session_timeout = ",
                      ms(session.idle_in_transaction_timeout),
                      session.generic_plans
                          ? "; SET plan_cache_mode = force_generic_plan"
                          : "");
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

absl::StatusOr<std::unique_ptr<pqxx::connection>> Connect(
    const std::string& url, const std::string& application_name,
    const DbSession& session) {
  try {
    auto conn = std::make_unique<pqxx::connection>(WithConnectionDefaults(url));
    // A silent reconnect would drop session state such as advisory locks.
    // (Deprecated in libpqxx 6.4, where reactivation still exists.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    conn->inhibit_reactivation(true);
#pragma GCC diagnostic pop
    pqxx::nontransaction tx(*conn);
    // Acknowledged work must survive a server crash, whatever the server's
    // default.
    tx.exec(absl::StrCat("SET application_name = ", tx.quote(application_name),
                         "; SET synchronous_commit = on; ",
                         SessionSettingsSql(session)));
    return conn;
  } catch (const std::exception& e) {
    absl::Status s = StatusFromException(e);
    return absl::UnavailableError(
        absl::StrCat("cannot connect to the database: ", s.message()));
  }
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

std::unique_ptr<pqxx::connection> Database::Acquire(absl::Duration timeout,
                                                    absl::Status* status) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline =
      std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  while (idle_.empty() && free_slots_ == 0) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
        idle_.empty() && free_slots_ == 0) {
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
  lock.unlock();
  auto conn = Connect(url_, application_name_, session_);
  if (conn.ok() && on_connect_) {
    try {
      on_connect_(**conn);
    } catch (const std::exception& e) {
      conn = StatusFromException(e);
    }
  }
  if (!conn.ok()) {
    lock.lock();
    ++free_slots_;
    cv_.notify_one();
    *status = conn.status();
    return nullptr;
  }
  return std::move(*conn);
}

void Database::Release(std::unique_ptr<pqxx::connection> conn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (conn != nullptr && conn->is_open()) {
    idle_.push_back(std::move(conn));
  } else {
    ++free_slots_;
  }
  cv_.notify_one();
}

absl::Status Database::Run(
    const std::function<absl::Status(pqxx::connection&)>& fn,
    absl::Duration acquire_timeout) {
  absl::Status status;
  std::unique_ptr<pqxx::connection> conn = Acquire(acquire_timeout, &status);
  if (conn == nullptr) return status;
  try {
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
    if (conn.ok()) {
      try {
        pqxx::work tx(**conn);
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
