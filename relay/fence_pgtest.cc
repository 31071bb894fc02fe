// The fence's WAL position against a real PostgreSQL: past the commit of
// every transaction a read could see, asynchronous commits included.

#include <gtest/gtest.h>

#include <pqxx/pqxx>
#include <string>

#include "absl/strings/str_cat.h"
#include "relay/fence.h"
#include "tests/testing/pg.h"

namespace outbox::relay {
namespace {

uint64_t Lsn(const std::string& text) {
  const std::optional<uint64_t> lsn = ParseLsn(text);
  EXPECT_TRUE(lsn.has_value()) << text;
  return lsn.value_or(0);
}

// A transaction committed with synchronous_commit = off is visible before
// its WAL is written: the position must still lie past its commit record
// (the write position, pg_current_wal_lsn, need not until the WAL writer
// catches up).
TEST(WalPastVisibleCommits, LiesPastAnAsynchronousCommit) {
  testing::TestDatabase db("fence", {});
  db.Exec("CREATE TABLE t (v int)");
  pqxx::connection writer(db.url());
  pqxx::connection reader(db.url());
  for (int i = 0; i < 20; ++i) {
    std::string committed;
    {
      pqxx::work tx(writer);
      tx.exec("SET LOCAL synchronous_commit = off");
      tx.exec_params("INSERT INTO t VALUES ($1)", i);
      tx.commit();
      // In the writer's session, after its commit: past the commit record.
      pqxx::nontransaction after(writer);
      committed = after.exec1("SELECT pg_current_wal_insert_lsn()::text")[0]
                      .as<std::string>();
    }
    pqxx::work read(reader);
    ASSERT_EQ(read.exec1("SELECT count(*) FROM t")[0].as<int>(), i + 1);
    EXPECT_GE(Lsn(WalPastVisibleCommits(read)), Lsn(committed)) << "row " << i;
  }
}

// Read on a connection: a server without standbys makes delivery wait,
// saying why; a lost connection is a status, not an exception.
TEST(ReplicationFence, ReadsOnAConnectionAndReturnsAFailure) {
  testing::TestDatabase db("fence_read", {});
  const ReplicationFence fence({.standbys = 1});
  pqxx::connection conn(db.url());
  const absl::StatusOr<FenceState> state = fence.Read(conn);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->eligible, 0);
  EXPECT_NE(state->why_waiting, "");
  pqxx::connection lost(db.url());
  db.Exec(absl::StrCat("SELECT pg_terminate_backend(", lost.backendpid(), ")"));
  EXPECT_FALSE(fence.Read(lost).ok());
}

}  // namespace
}  // namespace outbox::relay
