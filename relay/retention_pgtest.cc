// Retention against a real PostgreSQL: what it deletes stays a prefix of
// the outbox when a transaction commits its event after events with
// larger seqs, however long it stays open; a transaction that wrote
// nothing does not hold it back, nor does one prepared for two-phase
// commit once it ends; and it refuses a snapshot older than its
// own statements.

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <stdexcept>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/db_identity.h"
#include "common/schema.h"
#include "relay/log_testing.h"
#include "relay/retention.h"
#include "relay/retention_testing.h"
#include "tests/testing/pg.h"

namespace outbox::relay {
namespace {

class RetentionTest : public ::testing::Test {
 protected:
  // No subscription: every event may go as soon as retention allows.
  RetentionTest() : db_("retention", {OutboxSchema()}), conn_(db_.url()) {}

  int64_t AppendCommitted(const std::string& aggregate) {
    pqxx::work tx(conn_);
    const int64_t seq = Append(tx, aggregate);
    tx.commit();
    return seq;
  }

  // One step of retention with none kept for age, with a mark of its own
  // (at most one per 50 ms is taken); checks after it that what is gone
  // lies below all that is retained.
  int64_t Prune() { return RetentionStep(conn_, absl::ZeroDuration()); }

  int64_t Retained() { return db_.Scalar("SELECT count(*) FROM outbox"); }
  int64_t DeletedThrough() {
    return db_.Scalar("SELECT deleted_through FROM outbox_retention_state");
  }

  testing::TestDatabase db_;
  pqxx::connection conn_;
};

// A heal due holds every delete back, whatever the events' age, and says
// so: after a failover it tells lost events from deleted ones by what
// retention deleted, and after a consumer's restore it owes again what
// the consumer lost.
TEST_F(RetentionTest, ADueHealHoldsEveryDeleteBack) {
  for (int i = 0; i < 3; ++i) AppendCommitted("a");
  db_.Exec(
      "INSERT INTO subscriptions (name, heal_requested_at, heal_reason) "
      "VALUES ('billing', now(), 'the outbox database was restored')");
  absl::SleepFor(absl::Milliseconds(55));
  {
    pqxx::work tx(conn_);
    std::string held_back;
    EXPECT_EQ(PruneOutbox(tx, absl::ZeroDuration(), 1000, &held_back), 0);
    tx.commit();
    EXPECT_TRUE(absl::StrContains(held_back, "heal of subscription billing"))
        << held_back;
    EXPECT_TRUE(absl::StrContains(held_back, "was restored")) << held_back;
  }
  EXPECT_EQ(Retained(), 3);
  EXPECT_EQ(DeletedThrough(), 0);
  db_.Exec("UPDATE subscriptions SET healed_at = heal_requested_at");
  EXPECT_EQ(Prune(), 3);
  // Nothing holds it back now.
  pqxx::work tx(conn_);
  std::string held_back = "unset";
  EXPECT_EQ(PruneOutbox(tx, absl::ZeroDuration(), 1000, &held_back), 0);
  EXPECT_EQ(held_back, "");
}

// A failover or a restore that no binary has recorded yet (every relay of
// every subscription down, say) is recorded by retention itself before it
// deletes anything: every subscription's heal is then due, and the delete
// waits for them. Whichever binary records a new identity requests them
// all, so none is missed by a relay that was away.
TEST_F(RetentionTest, AnUnrecordedFailoverRequestsEveryHealFirst) {
  for (int i = 0; i < 3; ++i) AppendCommitted("a");
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing'), ('audit')");
  DatabaseIdentity now;
  {
    pqxx::work tx(conn_);
    now = ReadIdentity(tx);
  }
  ASSERT_TRUE(now.known());
  DatabaseIdentity before = now;
  before.timeline = now.timeline + 41;  // as the old primary recorded it
  db_.Exec(absl::StrCat(
      "INSERT INTO outbox_database_identity (id, identity) VALUES (1, '",
      before.Key(), "') ON CONFLICT (id) DO NOTHING"));
  ASSERT_EQ(db_.Scalar("SELECT count(*) FROM subscriptions WHERE "
                       "heal_requested_at IS NOT NULL"),
            0);
  absl::SleepFor(absl::Milliseconds(55));
  {
    pqxx::work tx(conn_);
    std::string held_back;
    EXPECT_EQ(PruneOutbox(tx, absl::ZeroDuration(), 1000, &held_back), 0);
    tx.commit();
    EXPECT_TRUE(absl::StrContains(held_back, "the outbox database changed"))
        << held_back;
  }
  EXPECT_EQ(Retained(), 3);
  EXPECT_EQ(db_.Query("SELECT identity FROM outbox_database_identity")[0][0]
                .as<std::string>(),
            now.Key());
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM subscriptions WHERE "
                       "heal_requested_at IS NOT NULL AND heal_reason LIKE "
                       "'%failover or restore%'"),
            2);
  db_.Exec("UPDATE subscriptions SET healed_at = heal_requested_at");
  EXPECT_EQ(Prune(), 3);
  // The same identity again requests nothing.
  db_.Exec(absl::StrCat("UPDATE outbox_database_identity SET identity = '",
                        now.Key(), "'"));
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM subscriptions WHERE healed_at < "
                       "heal_requested_at"),
            0);
}

// The classic trap: a transaction draws its seq, others with larger seqs
// commit and age, then it commits. Deleting them first left a retained
// event below deleted ones, so verify and heal took the deleted ones for
// lost, and a new subscription's chains started at the late event.
TEST_F(RetentionTest, AnEventCommittedLateKeepsWhatIsAboveIt) {
  EXPECT_EQ(DeletedThrough(), 0);
  const int64_t early = AppendCommitted("early");
  EXPECT_EQ(Prune(), 1);
  EXPECT_EQ(DeletedThrough(), early);
  pqxx::connection slow_conn(db_.url());
  pqxx::work slow(slow_conn);
  const int64_t late = Append(slow, "late");
  const int64_t a = AppendCommitted("a");
  const int64_t b = AppendCommitted("b");
  ASSERT_LT(early, late);
  ASSERT_LT(late, a);
  EXPECT_EQ(Prune(), 0);
  EXPECT_EQ(Prune(), 0);
  EXPECT_EQ(Retained(), 2);
  EXPECT_EQ(DeletedThrough(), early);  // what went, not what was seen
  slow.commit();
  EXPECT_EQ(Prune(), 3);
  EXPECT_EQ(Retained(), 0);
  EXPECT_LT(late, b);
  EXPECT_EQ(DeletedThrough(), b);
}

// A prepared transaction (two-phase commit) drops its virtual id, so no
// mark can name it: while one exists in the database, nothing goes, and
// the step says why. Once it commits, its event and all above it go, and
// what went is still a prefix.
TEST_F(RetentionTest, APreparedTransactionHoldsEveryDeleteBack) {
  if (db_.Scalar("SELECT current_setting('max_prepared_transactions')::int") ==
      0) {
    GTEST_SKIP() << "the server allows no prepared transactions "
                    "(./scripts/test starts one that does)";
  }
  const std::string gid = absl::StrCat("retention-test-", db_.name());
  // Whatever happens below, the prepared transaction does not outlive the
  // test (it would hold the database, and its locks, for good).
  struct Cleanup {
    const std::string& url;
    const std::string& gid;
    ~Cleanup() {
      try {
        pqxx::connection c(url);
        pqxx::nontransaction n(c);
        if (!n.exec_params("SELECT 1 FROM pg_prepared_xacts WHERE gid = $1",
                           gid)
                 .empty()) {
          n.exec(absl::StrCat("ROLLBACK PREPARED ", n.quote(gid)));
        }
      } catch (const std::exception&) {
      }
    }
  } cleanup{db_.url(), gid};
  const int64_t before = AppendCommitted("before");
  int64_t prepared = 0;
  {
    pqxx::connection c(db_.url());
    pqxx::nontransaction n(c);
    n.exec("BEGIN");
    prepared = Append(n, "prepared");
    n.exec(absl::StrCat("PREPARE TRANSACTION ", n.quote(gid)));
  }  // its session is gone; the transaction is not
  const int64_t after = AppendCommitted("after");
  ASSERT_LT(before, prepared);
  ASSERT_LT(prepared, after);
  absl::SleepFor(absl::Milliseconds(55));
  {
    pqxx::work tx(conn_);
    std::string held_back;
    EXPECT_EQ(PruneOutbox(tx, absl::ZeroDuration(), 1000, &held_back), 0);
    tx.commit();
    EXPECT_TRUE(absl::StrContains(held_back, "prepared transaction"))
        << held_back;
  }
  EXPECT_EQ(Prune(), 0);
  EXPECT_EQ(Retained(), 2);
  EXPECT_EQ(DeletedThrough(), 0);
  db_.Exec(absl::StrCat("COMMIT PREPARED '", gid, "'"));
  EXPECT_EQ(Prune(), 3);
  EXPECT_EQ(Retained(), 0);
  EXPECT_EQ(DeletedThrough(), after);
}

// The same for one that aborts: its seq is never filled, and what lies
// above it goes once it has ended.
TEST_F(RetentionTest, AnAbortedWriterHoldsRetentionOnlyWhileOpen) {
  pqxx::connection slow_conn(db_.url());
  auto slow = std::make_unique<pqxx::work>(slow_conn);
  Append(*slow, "aborted");
  AppendCommitted("a");
  EXPECT_EQ(Prune(), 0);
  slow->abort();
  slow.reset();
  EXPECT_EQ(Prune(), 1);
  EXPECT_EQ(Retained(), 0);
}

// A writer that has drawn its seq in its statement and has no xid yet
// (nextval takes one only when it logs the sequence, once per 32 values,
// or first after a checkpoint began): its statement runs, and it holds
// retention back.
TEST_F(RetentionTest, ASeqDrawnBeforeTheWriterHasAnXidHoldsRetentionBack) {
  // Other tests' WAL may start a checkpoint between the two appends, and
  // then the writer's nextval logs the sequence and takes an xid: not the
  // case tested. A checkpoint of its own first makes that unlikely, and
  // the case is set up again when it happens all the same.
  for (int attempt = 1;; ++attempt) {
    for (int i = 0; i < 10 && Retained() > 0; ++i) Prune();
    ASSERT_EQ(Retained(), 0);
    db_.Exec("CHECKPOINT");
    const int64_t early = AppendCommitted("early");  // the sequence logged
    std::atomic<int64_t> late{0};
    std::thread writer([&] {
      pqxx::connection c(db_.url());
      pqxx::nontransaction tx(c);
      late = tx.exec(
                   "WITH s AS (SELECT nextval('outbox_seq_seq') AS seq), w "
                   "AS (SELECT s.seq, pg_sleep(1.5) FROM s) INSERT INTO "
                   "outbox (seq, event_id, aggregate_type, aggregate_id, "
                   "prev_seq, event_type, schema_version, payload, "
                   "partition) SELECT w.seq, gen_random_uuid(), 'order', "
                   "'late', 0, 'order.created', 1, ''::bytea, 0 FROM w "
                   "RETURNING seq")[0][0]
                 .as<int64_t>();
    });
    // Until the seq is drawn.
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (db_.Scalar("SELECT last_value FROM outbox_seq_seq") == early &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    const int64_t a = AppendCommitted("a");
    // Of this database: tests of others share the server.
    const int64_t with_xid = db_.Scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE backend_xid IS NOT NULL "
        "AND pid <> pg_backend_pid() AND datname = current_database()");
    if (with_xid != 0) {
      writer.join();
      ASSERT_LT(attempt, 5) << "the writer had an xid already each time: "
                               "the case tested never came about";
      continue;
    }
    EXPECT_EQ(Prune(), 0);
    writer.join();
    EXPECT_LT(late, a);
    EXPECT_EQ(Retained(), 3);
    EXPECT_EQ(Prune(), 3);
    return;
  }
}

// A transaction that has written nothing (a report, a session left idle in
// a transaction) holds nothing back; nor does one idle after an error.
TEST_F(RetentionTest, TransactionsThatWroteNothingHoldNothingBack) {
  pqxx::connection reader_conn(db_.url());
  pqxx::work reader(reader_conn);
  reader.exec("SELECT count(*) FROM outbox");
  pqxx::connection failed_conn(db_.url());
  pqxx::work failed(failed_conn);
  Append(failed, "failed");
  EXPECT_THROW(failed.exec("SELECT 1/0"), std::exception);
  AppendCommitted("a");
  AppendCommitted("b");
  EXPECT_EQ(Prune(), 2);
  EXPECT_EQ(Retained(), 0);
}

// Many steps while a writer stays open: the marks stay few, and once it
// ends retention catches up.
TEST_F(RetentionTest, AWriterOpenForLongLeavesFewMarks) {
  pqxx::connection slow_conn(db_.url());
  auto slow = std::make_unique<pqxx::work>(slow_conn);
  Append(*slow, "slow");
  constexpr int kSteps = 70;
  for (int i = 0; i < kSteps; ++i) {
    AppendCommitted(absl::StrCat("o", i));
    EXPECT_EQ(Prune(), 0);
  }
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_retention_marks"), 64);
  slow->commit();
  slow.reset();
  // The newest mark, taken 6 steps before the end, first; then the rest.
  const int64_t first = Prune();
  EXPECT_GT(first, 60);
  EXPECT_EQ(first + Prune(), kSteps + 1);
  EXPECT_EQ(Retained(), 0);
  EXPECT_LE(db_.Scalar("SELECT count(*) FROM outbox_retention_marks"), 2);
}

// Steps with nothing new to delete keep one mark, and events written
// after them go.
TEST_F(RetentionTest, IdleStepsKeepOneMark) {
  AppendCommitted("a");
  for (int i = 0; i < 70; ++i) Prune();
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_retention_marks"), 1);
  AppendCommitted("b");
  EXPECT_EQ(Prune(), 1);
  EXPECT_EQ(Retained(), 0);
}

TEST_F(RetentionTest, ARepeatableReadTransactionIsRefused) {
  AppendCommitted("a");
  pqxx::work tx(conn_);
  tx.exec("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ");
  EXPECT_THROW(PruneOutbox(tx, absl::ZeroDuration(), 1000), std::logic_error);
}

}  // namespace
}  // namespace outbox::relay
