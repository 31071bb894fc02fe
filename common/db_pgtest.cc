// The database sessions every binary opens, against a real PostgreSQL:
// each carries the limits of --statement_timeout, --lock_timeout and
// --idle_in_transaction_session_timeout (README "Nothing waits forever"),
// read back with SHOW from the session itself, and the server enforces
// them.

#include <gtest/gtest.h>

#include <functional>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "common/db.h"
#include "common/db_flags.h"
#include "tests/testing/pg.h"
#include "tests/testing/wait.h"

namespace outbox {
namespace {

using ::outbox::testing::WaitFor;

std::string Show(pqxx::connection& c, const std::string& setting) {
  pqxx::nontransaction tx(c);
  return tx.exec1("SHOW " + setting)[0].as<std::string>();
}

// What a binary gets with its flags left alone: the documented 30 s, 5 s
// and 60 s, on the pooled sessions (Database) and single ones (Connect).
TEST(DbSession, TheBinariesSessionsCarryTheirLimits) {
  testing::TestDatabase tdb("db_session", {});
  const DbSession flags = DbSessionFromFlags();
  Database pool(tdb.url(), 1, "db-session-test", flags);
  ASSERT_TRUE(pool.Run([&](pqxx::connection& c) {
                    EXPECT_EQ(Show(c, "statement_timeout"), "30s");
                    EXPECT_EQ(Show(c, "lock_timeout"), "5s");
                    EXPECT_EQ(Show(c, "idle_in_transaction_session_timeout"),
                              "1min");
                    return absl::OkStatus();
                  })
                  .ok());
  auto single = Connect(tdb.url(), "db-session-test", flags);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(Show(**single, "idle_in_transaction_session_timeout"), "1min");
  // As set by the flag.
  absl::SetFlag(&FLAGS_idle_in_transaction_session_timeout, absl::Seconds(7));
  auto seven = Connect(tdb.url(), "db-session-test", DbSessionFromFlags());
  absl::SetFlag(&FLAGS_idle_in_transaction_session_timeout,
                DbSession{}.idle_in_transaction_timeout);
  ASSERT_TRUE(seven.ok()) << seven.status();
  EXPECT_EQ(Show(**seven, "idle_in_transaction_session_timeout"), "7s");
}

// A session left idle inside a transaction is ended by the server: the
// setting is in force, not only shown.
TEST(DbSession, ASessionIdleInATransactionIsEnded) {
  testing::TestDatabase tdb("db_idle", {});
  DbSession session;
  session.idle_in_transaction_timeout = absl::Seconds(1);
  auto conn = Connect(tdb.url(), "db-idle-test", session);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto tx = std::make_unique<pqxx::work>(**conn);
  tx->exec("SELECT 1");  // in a transaction, then idle
  EXPECT_TRUE(WaitFor([&] {
    return tdb.Scalar(
               "SELECT count(*) FROM pg_stat_activity WHERE "
               "application_name = 'db-idle-test'") == 0;
  })) << "the server kept a session idle in its transaction";
  EXPECT_ANY_THROW(tx->exec("SELECT 1"));
  tx.reset();
}

// InUnit commits what its function wrote; what the function throws is a
// status.
TEST(InUnit, CommitsOrReturnsWhatWasThrown) {
  testing::TestDatabase tdb("db_in_unit", {});
  tdb.Exec("CREATE TABLE t (v int)");
  pqxx::connection conn(tdb.url());
  EXPECT_TRUE(InUnit(conn, [](pqxx::transaction_base& tx) {
                tx.exec("INSERT INTO t VALUES (1)");
              }).ok());
  const absl::Status s =
      InUnit(conn, [](pqxx::transaction_base& tx) { tx.exec("SELECT 1/0"); });
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("division by zero"), absl::string_view::npos) << s;
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM t"), 1);
}

}  // namespace
}  // namespace outbox
