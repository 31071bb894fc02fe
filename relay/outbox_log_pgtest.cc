// The log's reads against a real PostgreSQL: ranges between ticks hold
// each committed event once, in seq order, however late its transaction
// committed, and with concurrent writers.

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/db.h"
#include "common/ids.h"
#include "common/schema.h"
#include "relay/log_testing.h"
#include "relay/outbox_log.h"
#include "tests/testing/pg.h"

namespace outbox::relay {
namespace {

absl::StatusOr<Tick> TickIn(pqxx::connection& c) {
  pqxx::work tx(c);
  absl::StatusOr<Tick> t = MakeTick(tx);
  if (t.ok()) tx.commit();
  return t;
}

// Reads the whole range (from, to] of `partitions`, `limit` at a time.
absl::StatusOr<std::vector<LogEvent>> ReadRange(
    pqxx::connection& c, const Tick& from, const Tick& to,
    std::vector<int> partitions = {}, int limit = 3) {
  LogRead read{.from = from,
               .to = to,
               .partitions = std::move(partitions),
               .limit = limit};
  std::vector<LogEvent> all;
  for (int reads = 0; reads < 100000; ++reads) {
    pqxx::work tx(c);
    absl::StatusOr<LogBatch> batch = ReadLog(tx, read);
    if (!batch.ok()) return batch.status();
    tx.commit();
    if (static_cast<int>(batch->events.size()) > limit) {
      return absl::InternalError("a read above its limit");
    }
    for (LogEvent& e : batch->events) all.push_back(std::move(e));
    read.after_seq = batch->last_seq;
    if (batch->range_done) return all;
  }
  return absl::InternalError("the range never ended");
}

std::vector<int64_t> Seqs(const std::vector<LogEvent>& events) {
  std::vector<int64_t> seqs;
  for (const LogEvent& e : events) seqs.push_back(e.event.seq());
  return seqs;
}

class OutboxLogTest : public ::testing::Test {
 protected:
  OutboxLogTest() : db_("outbox_log", {OutboxSchema()}), conn_(db_.url()) {}

  Tick Latest() {
    pqxx::work tx(conn_);
    absl::StatusOr<Tick> t = LatestTick(tx);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : Tick{};
  }

  // billing on the log, every partition's position at a tick after three
  // events (delivered) and before two (owed).
  struct Staged {
    std::vector<int64_t> delivered, owed;
    Tick at;
  };
  Staged StageDeliveredAndOwed() {
    db_.Exec(
        "INSERT INTO subscriptions (name, start_tick) VALUES ('billing', 1)");
    Staged out;
    for (int i = 0; i < 5; ++i) {
      if (i == 3) {
        absl::StatusOr<Tick> t = TickIn(conn_);
        EXPECT_TRUE(t.ok()) << t.status();
        if (t.ok()) out.at = *t;
      }
      pqxx::work tx(conn_);
      (i < 3 ? out.delivered : out.owed)
          .push_back(Append(tx, absl::StrCat(i < 3 ? "a-" : "b-", i)));
      tx.commit();
    }
    db_.Exec(absl::StrCat(
        "INSERT INTO outbox_log_positions (subscription, partition, "
        "done_tick) SELECT 'billing', p, ",
        out.at.id, " FROM generate_series(0, ", kPartitions - 1, ") p"));
    return out;
  }

  testing::TestDatabase db_;
  pqxx::connection conn_;
};

TEST(Snapshot, ParsesWhatPostgresPrints) {
  absl::StatusOr<Snapshot> s = Snapshot::Parse("10:20:12,15");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->xmin, 10u);
  EXPECT_EQ(s->xmax, 20u);
  EXPECT_EQ(s->xip, (std::vector<uint64_t>{12, 15}));
  EXPECT_EQ(s->ToString(), "10:20:12,15");
  EXPECT_TRUE(s->Shows(9));
  EXPECT_TRUE(s->Shows(13));
  EXPECT_FALSE(s->Shows(12));
  EXPECT_FALSE(s->Shows(20));
  EXPECT_TRUE(Snapshot::Parse("7:7:").ok());
  for (const char* bad :
       {"", "1:2", "2:1:", "1:5:7", "1:5:3,2", "a:b:", "1:5:2,,3"}) {
    EXPECT_FALSE(Snapshot::Parse(bad).ok()) << bad;
  }
}

TEST_F(OutboxLogTest, TheMigrationMakesTheFirstTick) {
  Tick first = Latest();
  EXPECT_EQ(first.id, 1);
  EXPECT_EQ(first.high_seq, 0);
  pqxx::work tx(conn_);
  EXPECT_TRUE(absl::IsNotFound(ReadTick(tx, 2).status()));
}

// Relays share ticks: one younger than the asked age is read, not made
// again.
TEST_F(OutboxLogTest, ATickYoungerThanAskedIsSharedNotMadeAgain) {
  const auto since = [&](absl::Duration age) {
    pqxx::work tx(conn_);
    absl::StatusOr<TickAndExceptions> t = TickSince(tx, age, "billing", {});
    EXPECT_TRUE(t.ok()) << t.status();
    tx.commit();
    return t.ok() ? t->tick : Tick{};
  };
  const Tick made = since(absl::ZeroDuration());
  EXPECT_EQ(made.id, 2);
  EXPECT_LT(made.age, absl::Seconds(1));
  const Tick shared = since(absl::Hours(1));
  EXPECT_EQ(shared.id, 2);
  EXPECT_EQ(since(absl::InfiniteDuration()).id, 2);  // whatever its age
  EXPECT_GE(shared.age, made.age);
  EXPECT_EQ(since(absl::ZeroDuration()).id, 3);
  EXPECT_EQ(Latest().id, 3);
}

TEST_F(OutboxLogTest, ReadsARangeInSeqOrderBatchByBatch) {
  const Tick from = Latest();
  std::vector<int64_t> written;
  for (int i = 0; i < 10; ++i) {
    pqxx::work tx(conn_);
    written.push_back(Append(tx, absl::StrCat("order-", i)));
    tx.commit();
  }
  absl::StatusOr<Tick> to = TickIn(conn_);
  ASSERT_TRUE(to.ok()) << to.status();
  EXPECT_EQ(to->id, from.id + 1);
  EXPECT_EQ(to->high_seq, written.back());

  absl::StatusOr<std::vector<LogEvent>> got = ReadRange(conn_, from, *to);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(Seqs(*got), written);
  for (const LogEvent& e : *got) {
    EXPECT_TRUE(e.payload_ok);
    EXPECT_EQ(e.event.aggregate_type(), "order");
    EXPECT_GT(e.xid, 0u);
  }

  // The next range, with nothing new, is empty; a tick of ticks stays in
  // order.
  absl::StatusOr<Tick> again = TickIn(conn_);
  ASSERT_TRUE(again.ok());
  got = ReadRange(conn_, *to, *again);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->empty());

  pqxx::work tx(conn_);
  EXPECT_TRUE(absl::IsInvalidArgument(
      ReadLog(tx, LogRead{.from = *to, .to = *to}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      ReadLog(tx, LogRead{.from = from, .to = *to, .limit = 0}).status()));
}

TEST_F(OutboxLogTest, ReadsOnlyTheGivenPartitions) {
  const Tick from = Latest();
  std::map<int, int> per_partition;
  for (int i = 0; i < 40; ++i) {
    pqxx::work tx(conn_);
    Append(tx, absl::StrCat("p-", i));
    tx.commit();
  }
  absl::StatusOr<Tick> to = TickIn(conn_);
  ASSERT_TRUE(to.ok());
  absl::StatusOr<std::vector<LogEvent>> low =
      ReadRange(conn_, from, *to, {0, 1, 2, 3, 4, 5, 6, 7});
  absl::StatusOr<std::vector<LogEvent>> all = ReadRange(conn_, from, *to);
  ASSERT_TRUE(low.ok() && all.ok());
  int expected = 0;
  for (const LogEvent& e : *all) expected += e.partition < 8;
  EXPECT_EQ(static_cast<int>(low->size()), expected);
  for (const LogEvent& e : *low) EXPECT_LT(e.partition, 8);
}

// A transaction running at the tick commits after it: its event, below
// the tick's high_seq, belongs to the next range (reading "seq > the
// highest seen" would skip it).
TEST_F(OutboxLogTest, AnEventCommittedAfterTheTickIsInTheNextRange) {
  const Tick t0 = Latest();
  pqxx::connection slow_conn(db_.url());
  pqxx::work slow(slow_conn);
  const int64_t late = Append(slow, "slow");
  int64_t early = 0;
  {
    pqxx::work tx(conn_);
    early = Append(tx, "fast");
    tx.commit();
  }
  ASSERT_LT(late, early);
  absl::StatusOr<Tick> t1 = TickIn(conn_);
  ASSERT_TRUE(t1.ok());
  EXPECT_EQ(t1->high_seq, early);
  absl::StatusOr<std::vector<LogEvent>> first = ReadRange(conn_, t0, *t1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(Seqs(*first), std::vector<int64_t>{early});

  slow.commit();
  absl::StatusOr<Tick> t2 = TickIn(conn_);
  ASSERT_TRUE(t2.ok());
  absl::StatusOr<std::vector<LogEvent>> second = ReadRange(conn_, *t1, *t2);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(Seqs(*second), std::vector<int64_t>{late});
}

// A transaction that drew its seq before the tick but had no xid until
// after it (nextval needs none): its xid is at least the tick's xmax.
TEST_F(OutboxLogTest, ASeqDrawnBeforeTheTickWithAnXidAfterIt) {
  const Tick t0 = Latest();
  const int64_t drawn =
      db_.Scalar("SELECT nextval(pg_get_serial_sequence('outbox', 'seq'))");
  int64_t early = 0;
  {
    pqxx::work tx(conn_);
    early = Append(tx, "fast");
    tx.commit();
  }
  absl::StatusOr<Tick> t1 = TickIn(conn_);
  ASSERT_TRUE(t1.ok());
  ASSERT_LT(drawn, t1->high_seq);
  {
    pqxx::work tx(conn_);
    EXPECT_EQ(Append(tx, "slow", drawn), drawn);
    tx.commit();
  }
  absl::StatusOr<Tick> t2 = TickIn(conn_);
  ASSERT_TRUE(t2.ok());
  absl::StatusOr<std::vector<LogEvent>> first = ReadRange(conn_, t0, *t1);
  absl::StatusOr<std::vector<LogEvent>> second = ReadRange(conn_, *t1, *t2);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(Seqs(*first), std::vector<int64_t>{early});
  ASSERT_EQ(Seqs(*second), std::vector<int64_t>{drawn});
  EXPECT_GE(second->front().xid, t1->snapshot.xmax);
}

// The read is prepared, and a generic plan is made once, often while the
// outbox is nearly empty, then kept as it grows. Its arms that find late
// events by transaction id must stay bounded by the (xid, seq) index: a
// scan of the primary key on their seq bounds reads every event from
// after_seq (0 when a range starts) up to from's high_seq, the whole
// history. Checked on forced generic plans, before and after the history
// grows and is analysed.
TEST_F(OutboxLogTest, TheLateArmsOfAGenericReadStayOnTheXidIndex) {
  pqxx::connection generic(db_.url());
  pqxx::nontransaction(generic).exec(
      "SET plan_cache_mode = force_generic_plan");
  // Both late forms prepared on this connection by real reads: a range
  // starting below from's high_seq.
  {
    pqxx::work tx(conn_);
    Append(tx, "before");
    tx.commit();
  }
  absl::StatusOr<Tick> from_tick = TickIn(conn_);
  ASSERT_TRUE(from_tick.ok()) << from_tick.status();
  {
    pqxx::work tx(conn_);
    Append(tx, "after");
    tx.commit();
  }
  absl::StatusOr<Tick> to = TickIn(conn_);
  ASSERT_TRUE(to.ok()) << to.status();
  ASSERT_GT(from_tick->high_seq, 0);
  for (std::vector<int> partitions : {std::vector<int>{}, {0, 1, 2, 3}}) {
    absl::StatusOr<std::vector<LogEvent>> got =
        ReadRange(generic, *from_tick, *to, partitions);
    ASSERT_TRUE(got.ok()) << got.status();
  }
  pqxx::nontransaction(generic).exec(R"(
    CREATE FUNCTION pg_temp.plan_of(q text) RETURNS jsonb
    LANGUAGE plpgsql AS $$
    DECLARE j json;
    BEGIN
      EXECUTE 'EXPLAIN (FORMAT JSON) EXECUTE ' || q INTO j;
      RETURN j::jsonb;
    END $$)");
  // Each arm of the union: the indexes and node types its plan uses.
  const auto arms = [&](const std::string& execute) {
    std::vector<std::string> out;
    pqxx::nontransaction tx(generic);
    for (const auto& row : tx.exec(absl::StrCat(
             "WITH p AS (SELECT pg_temp.plan_of(", tx.quote(execute),
             ") AS j), u AS (SELECT jsonb_path_query_first(j, "
             "'lax $.** ? (@.\"Node Type\" like_regex \"Append\" && "
             "@.Plans.size() == 3)') AS a FROM p) "
             "SELECT jsonb_path_query_array(arm, 'lax $.**.\"Index Name\"')"
             "::text || ' ' || jsonb_path_query_array(arm, "
             "'lax $.**.\"Node Type\"')::text "
             "FROM u, jsonb_array_elements(u.a->'Plans') WITH ORDINALITY "
             "AS x(arm, n) ORDER BY n"))) {
      out.push_back(row[0].as<std::string>());
    }
    return out;
  };
  const auto check = [&](const std::string& when) {
    for (const std::string& execute :
         {std::string("log_read_late('0', '1', '2', '1:1:', '2:2:', '10', "
                      "'{}', '1', '2', '1', '1000000')"),
          std::string("log_read_late_parts('0', '1', '2', '1:1:', '2:2:', "
                      "'10', '{}', '1', '2', '1', '{0,1}', '1000000')")}) {
      std::vector<std::string> a = arms(execute);
      ASSERT_EQ(a.size(), 3u)
          << when << ": " << execute << ": no union of three arms in the plan";
      for (int i = 0; i < 2; ++i) {
        EXPECT_NE(a[i].find("outbox_xid_idx"), std::string::npos)
            << when << ", arm " << i << " of " << execute << ": " << a[i];
        EXPECT_EQ(a[i].find("outbox_pkey"), std::string::npos)
            << when << ", arm " << i << " of " << execute << ": " << a[i];
        EXPECT_EQ(a[i].find("Seq Scan"), std::string::npos)
            << when << ", arm " << i << " of " << execute << ": " << a[i];
      }
      // The events above from's high_seq: by the primary key.
      EXPECT_NE(a[2].find("outbox_pkey"), std::string::npos)
          << when << ": " << execute << ": " << a[2];
    }
  };
  check("nearly empty");
  db_.Exec(
      "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, prev_seq, "
      "event_type, schema_version, payload, partition) SELECT "
      "gen_random_uuid(), 'order', 'history-' || g, 0, 'OrderCreated', 1, "
      "'\\x00', g % 32 FROM generate_series(1, 20000) g");
  db_.Exec("ANALYZE outbox");
  check("behind 20,000 events");
}

// A dump restored into another cluster keeps its ticks but not their
// transaction ids: new events would look older than the ticks and be
// passed over. The log refuses to tick, as a fault of the world.
TEST_F(OutboxLogTest, TransactionIdsBehindTheLastTickStopTheLog) {
  db_.Exec(
      "INSERT INTO outbox_ticks (id, snapshot, high_seq) VALUES "
      "(2, '4000000000:4000000000:', 0)");
  pqxx::work tx(conn_);
  absl::StatusOr<Tick> t = MakeTick(tx);
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(absl::IsUnavailable(t.status())) << t.status();
  EXPECT_EQ(SqlStateOf(t.status()), "55000");
  EXPECT_NE(t.status().message().find("cannot tick"), std::string::npos)
      << t.status();
}

// The same restore, mended: what the positions had not delivered becomes
// exceptions, and the log starts again at a tick of the new ids.
TEST_F(OutboxLogTest, ARebaseOwesWhatThePositionsHadNotDelivered) {
  // Every partition delivered through t2 (and none owed by the trigger,
  // which the log replaces); then ticks of the old cluster.
  const Staged staged = StageDeliveredAndOwed();
  const std::vector<int64_t>& after = staged.owed;
  const Tick* t2 = &staged.at;
  db_.Exec("DELETE FROM outbox_delivery");
  {
    pqxx::work tx(conn_);
    absl::StatusOr<Rebased> r = RebaseLog(tx);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->rebased);  // ids not behind: nothing to do
  }
  db_.Exec(
      absl::StrCat("INSERT INTO outbox_ticks (id, snapshot, high_seq) VALUES (",
                   t2->id + 1, ", '4000000000:4000000000:', 0)"));
  pqxx::work tx(conn_);
  absl::StatusOr<Rebased> r = RebaseLog(tx);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->rebased);
  EXPECT_EQ(r->owed, 2);
  EXPECT_EQ(r->tick, t2->id + 2);
  std::vector<int64_t> owed;
  for (const auto& row : tx.exec("SELECT seq FROM outbox_delivery WHERE "
                                 "subscription = 'billing' ORDER BY seq")) {
    owed.push_back(row[0].as<int64_t>());
  }
  EXPECT_EQ(owed, after);
  absl::StatusOr<LogPosition> at = ReadPosition(tx, "billing", 0);
  ASSERT_TRUE(at.ok());
  EXPECT_EQ(at->done, r->tick);
  tx.commit();
  EXPECT_TRUE(TickIn(conn_).ok());  // the log ticks again
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_ticks"), 2);
}

// In REPEATABLE READ a transaction's snapshot is taken at its first
// statement, maybe before the lock that orders ticks is granted: a tick
// made there could show less than the one before it. Refused, as a fault
// of the world (the session's setting), with nothing written.
TEST_F(OutboxLogTest, ATickIsRefusedOutsideReadCommitted) {
  const int64_t before = db_.Scalar("SELECT count(*) FROM outbox_ticks");
  pqxx::work tx(conn_);
  tx.exec("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ");
  absl::StatusOr<Tick> t = MakeTick(tx);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnavailable) << t.status();
  EXPECT_NE(t.status().message().find("repeatable read"), std::string::npos)
      << t.status();
  tx.abort();
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_ticks"), before);
  pqxx::work ok(conn_);
  EXPECT_TRUE(MakeTick(ok).ok());
}

// A dump restored into a younger cluster, as it really comes: the old
// events keep the old cluster's transaction ids (above this cluster's),
// its ticks their snapshots, and the producer writes new events, with new
// ids below every old snapshot's xmin, before any relay ticks and finds
// the ids behind. Those new events are owed (they read as delivered to
// the old snapshots), as is the old cluster's event that no tick showed;
// the one the positions delivered is not.
TEST_F(OutboxLogTest, ARebaseOwesWhatWasWrittenSinceTheRestore) {
  pqxx::work old(conn_);
  const int64_t delivered = Append(old, "old-delivered");
  const int64_t undelivered = Append(old, "old-undelivered");
  old.exec(absl::StrCat(
      "UPDATE outbox SET xid = CASE seq WHEN ", delivered,
      " THEN '3000000100' ELSE '3000000200' END::xid8; "
      "DELETE FROM outbox_ticks; INSERT INTO outbox_ticks (id, snapshot, high_seq) VALUES "
      "(1, '3000000000:3000000000:', 0), (2, '3000000150:3000000150:', ",
      delivered, "); "
      "INSERT INTO subscriptions (name, start_tick) VALUES ('billing', 1); "
      "INSERT INTO outbox_log_positions (subscription, partition, done_tick) "
      "SELECT 'billing', p, 2 FROM generate_series(0, ",
      kPartitions - 1, ") p"));
  old.commit();
  std::vector<int64_t> since;
  for (int i = 0; i < 3; ++i) {
    pqxx::work tx(conn_);
    since.push_back(Append(tx, absl::StrCat("new-", i)));
    tx.commit();
  }
  db_.Exec("DELETE FROM outbox_delivery");  // the log owes them, not rows
  // An event in flight across the rebase: the new tick does not show it,
  // so the log reads it after the tick, and no row is owed for it.
  pqxx::connection writer(db_.url());
  pqxx::work open(writer);
  const int64_t in_flight = Append(open, "in-flight");
  pqxx::work tx(conn_);
  absl::StatusOr<Rebased> r = RebaseLog(tx);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->rebased);
  std::vector<int64_t> owed;
  for (const auto& row : tx.exec("SELECT seq FROM outbox_delivery WHERE "
                                 "subscription = 'billing' ORDER BY seq")) {
    owed.push_back(row[0].as<int64_t>());
  }
  std::vector<int64_t> want = {undelivered};
  want.insert(want.end(), since.begin(), since.end());
  EXPECT_EQ(owed, want);
  EXPECT_EQ(r->owed, static_cast<int64_t>(want.size()));
  tx.commit();
  open.commit();
  absl::StatusOr<Tick> next = TickIn(conn_);
  ASSERT_TRUE(next.ok()) << next.status();
  pqxx::work read(conn_);
  absl::StatusOr<Tick> rebased = ReadTick(read, r->tick);
  read.commit();
  ASSERT_TRUE(rebased.ok()) << rebased.status();
  absl::StatusOr<std::vector<LogEvent>> after =
      ReadRange(conn_, *rebased, *next);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(Seqs(*after), std::vector<int64_t>{in_flight});
  // The old cluster's ids, ahead of this one's, are gone: the log owes
  // only the event in flight across the rebase.
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox WHERE xid >= "
                       "pg_snapshot_xmax(pg_current_snapshot())"),
            0);
  pqxx::work owed_tx(conn_);
  absl::StatusOr<std::map<int, LogOwed>> owed_by =
      LogOwedBy(owed_tx, "billing", {}, 1000000);
  ASSERT_TRUE(owed_by.ok()) << owed_by.status();
  EXPECT_EQ(LogOwedTotal(*owed_by).events, 1);
}

// A rebase and a move off the log in flight together: the rebase takes
// the subscriptions before the positions, as the move does, so each waits
// for the other instead of deadlocking (PostgreSQL would fail one).
TEST_F(OutboxLogTest, ARebaseWaitsForAMoveOffTheLogWithoutADeadlock) {
  StageDeliveredAndOwed();
  db_.Exec("DELETE FROM outbox_delivery");
  // Everything delivered: a rebase that owes rows waits for the move at
  // their foreign key; one that owes none reached the positions first.
  absl::StatusOr<Tick> all = TickIn(conn_);
  ASSERT_TRUE(all.ok()) << all.status();
  db_.Exec(absl::StrCat(
      "UPDATE subscriptions SET start_tick = ", all->id, "; "
      "INSERT INTO outbox_log_positions (subscription, partition, done_tick) "
      "SELECT 'billing', p, ", all->id, " FROM generate_series(0, ",
      kPartitionCount - 1, ") p ON CONFLICT (subscription, partition) DO "
      "UPDATE SET done_tick = EXCLUDED.done_tick, reading_tick = 0, "
      "after_seq = 0"));
  db_.Exec(absl::StrCat(
      "INSERT INTO outbox_ticks (id, snapshot, high_seq) VALUES (",
      all->id + 1, ", '4000000000:4000000000:', 0)"));
  // The move's locks in its order: the subscription, then the positions.
  pqxx::connection mover(db_.url());
  pqxx::work move(mover);
  move.exec("SET LOCAL deadlock_timeout = '100ms'");
  move.exec("SELECT 1 FROM subscriptions WHERE name = 'billing' FOR UPDATE");
  absl::Status rebased = absl::UnknownError("not run");
  std::thread rebase([&] {
    pqxx::connection c(db_.url());
    pqxx::work tx(c);
    tx.exec("SET LOCAL deadlock_timeout = '100ms'");
    absl::StatusOr<Rebased> r = RebaseLog(tx);
    if (r.ok()) {
      tx.commit();
      rebased = absl::OkStatus();
    } else {
      rebased = r.status();
    }
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (db_.Scalar("SELECT count(*) FROM pg_stat_activity WHERE "
                    "wait_event_type = 'Lock' AND datname = "
                    "current_database()") == 0 &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  absl::Status moved = absl::OkStatus();
  try {
    move.exec("DELETE FROM outbox_log_positions WHERE subscription = "
              "'billing'");
    move.exec("UPDATE subscriptions SET start_tick = NULL WHERE name = "
              "'billing'");
    move.commit();
  } catch (const std::exception& e) {
    moved = StatusFromException(e);
  }
  rebase.join();
  EXPECT_TRUE(moved.ok()) << moved;
  EXPECT_TRUE(rebased.ok()) << rebased;
  // Moved off the log before the rebase took it: the rebase left it off.
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM subscriptions WHERE "
                       "start_tick IS NOT NULL"),
            0);
}

TEST_F(OutboxLogTest, MovingOffTheLogOwesAsRowsWhatItHadNotDelivered) {
  const Staged staged = StageDeliveredAndOwed();
  const std::vector<int64_t>& owed = staged.owed;
  // One exception row already (a rejected event): it stays as it is.
  db_.Exec(absl::StrCat(
      "INSERT INTO outbox_delivery (subscription, seq, aggregate_id, "
      "partition, attempts) SELECT 'billing', seq, aggregate_id, partition, 2 "
      "FROM outbox WHERE seq = ",
      owed[0]));
  const auto waiting = [&](int64_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (db_.Scalar("SELECT count(*) FROM pg_locks WHERE relation = "
                      "'outbox'::regclass AND NOT granted") != n) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  };

  // A producer's transaction in flight: the trigger owed it nothing (the
  // subscription was on the log when it ran).
  pqxx::connection writer(db_.url());
  pqxx::work in_flight(writer);
  const int64_t late = Append(in_flight, "late");
  EXPECT_EQ(db_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox_delivery WHERE seq = ", late)),
            0);
  std::atomic<int64_t> moved{-1};
  std::thread mover([&] {
    pqxx::connection c(db_.url());
    pqxx::work tx(c);
    moved =
        tx.exec("SELECT outbox_log_unsubscribe('billing')")[0][0].as<int64_t>();
    tx.commit();
  });
  EXPECT_TRUE(waiting(1)) << "the move did not wait for the writer";
  // A producer that begins now waits for the move, then owes it rows.
  std::atomic<int64_t> after{0};
  std::thread next([&] {
    pqxx::connection c(db_.url());
    pqxx::work tx(c);
    after = Append(tx, "after");
    tx.commit();
  });
  EXPECT_TRUE(waiting(2)) << "a new writer did not wait for the move";
  EXPECT_EQ(moved.load(), -1);
  in_flight.commit();
  mover.join();
  next.join();

  EXPECT_EQ(moved.load(), 2);  // owed[1] and the late one
  std::vector<int64_t> rows;
  for (const auto& row : db_.Query(
           "SELECT seq, attempts FROM outbox_delivery WHERE subscription = "
           "'billing' AND status = 'pending' ORDER BY seq")) {
    rows.push_back(row["seq"].as<int64_t>());
    EXPECT_EQ(row["attempts"].as<int>(),
              row["seq"].as<int64_t>() == owed[0] ? 2 : 0);
  }
  EXPECT_EQ(rows, (std::vector<int64_t>{owed[0], owed[1], late, after.load()}));
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM subscriptions WHERE name = "
                       "'billing' AND start_tick IS NULL"),
            1);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_log_positions"), 0);
}

// A writer in REPEATABLE READ reads its first snapshot to the end: one
// taken before a move off the log still shows the subscription on it.
TEST_F(OutboxLogTest, AWriterWhoseSnapshotPredatesTheMoveStillOwesRows) {
  db_.Exec(
      "INSERT INTO subscriptions (name, start_tick) VALUES ('billing', 1), "
      "('audit', 1)");
  const auto rows_of = [&](int64_t seq) {
    return db_.Scalar(absl::StrCat(
        "SELECT count(*) FROM outbox_delivery WHERE seq = ", seq));
  };
  {
    pqxx::work tx(conn_);
    const int64_t seq = Append(tx, "read-committed");
    tx.commit();
    EXPECT_EQ(rows_of(seq), 0);  // on the log: nothing per subscription
  }
  pqxx::connection writer(db_.url());
  pqxx::work old(writer);
  old.exec("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ");
  old.exec("SELECT count(*) FROM subscriptions");  // its snapshot: on the log
  {
    pqxx::connection c(db_.url());
    pqxx::work tx(c);
    tx.exec("SELECT outbox_log_unsubscribe('billing')");
    tx.commit();
  }
  const int64_t seq = Append(old, "repeatable-read");
  old.commit();
  // Owed as rows to both: to billing, which is off the log now, and to
  // audit as an exception its log reads join.
  EXPECT_EQ(rows_of(seq), 2);
}

TEST_F(OutboxLogTest, MovingOffTheLogRefusesASnapshotThatCannotSeeWriters) {
  db_.Exec(
      "INSERT INTO subscriptions (name, start_tick) VALUES ('billing', 1)");
  pqxx::connection c(db_.url());
  {
    pqxx::work tx(c);
    tx.exec("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ");
    try {
      tx.exec("SELECT outbox_log_unsubscribe('billing')");
      ADD_FAILURE() << "moved off the log in REPEATABLE READ";
    } catch (const pqxx::sql_error& e) {
      EXPECT_EQ(e.sqlstate(), "25000") << e.what();
    }
  }
  pqxx::work tx(c);
  try {
    tx.exec("SELECT outbox_log_unsubscribe('nobody')");
    ADD_FAILURE() << "moved an unknown subscription";
  } catch (const pqxx::sql_error& e) {
    EXPECT_EQ(e.sqlstate(), "42704") << e.what();
  }
}

TEST_F(OutboxLogTest, RolledBackEventsAreInNoRange) {
  const Tick t0 = Latest();
  {
    pqxx::work tx(conn_);
    Append(tx, "gone");
    tx.abort();
  }
  absl::StatusOr<Tick> t1 = TickIn(conn_);
  ASSERT_TRUE(t1.ok());
  absl::StatusOr<std::vector<LogEvent>> got = ReadRange(conn_, t0, *t1);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(got->empty());
}

TEST_F(OutboxLogTest, APositionStartsAtItsSubscriptionsStartTick) {
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  pqxx::work tx(conn_);
  EXPECT_TRUE(absl::IsNotFound(ReadPosition(tx, "nope", 0).status()));
  // Made after the migration, before the log delivers to it.
  absl::Status off = ReadPosition(tx, "billing", 0).status();
  EXPECT_TRUE(IsNotOnLog(off)) << off;
  EXPECT_TRUE(absl::IsFailedPrecondition(off));
  // A refusal of the database mapped to the same code is not that.
  EXPECT_FALSE(IsNotOnLog(absl::FailedPreconditionError("billing")));
  tx.exec("UPDATE subscriptions SET start_tick = 1");
  absl::StatusOr<LogPosition> at = ReadPosition(tx, "billing", 5);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(at->done, 1);
  EXPECT_EQ(at->reading, 0);
  at = ReadPosition(tx, "billing", 5);  // read again, not made again
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(at->done, 1);
}

// A subscription deleted and made again under its name does not inherit
// the old one's positions: they would point before its start tick, or at
// ticks pruned since.
TEST_F(OutboxLogTest, ASubscriptionMadeAgainStartsWithoutTheOldPositions) {
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  db_.Exec("SELECT outbox_log_subscribe('billing')");
  {
    pqxx::work tx(conn_);
    ASSERT_TRUE(ReadPosition(tx, "billing", 3).ok());
    tx.commit();
  }
  db_.Exec("DELETE FROM subscriptions WHERE name = 'billing'");  // by SQL
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_log_positions"), 1);
  const int64_t start = db_.Scalar("SELECT outbox_log_subscribe('billing')");
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_log_positions"), 0);
  pqxx::work tx(conn_);
  absl::StatusOr<LogPosition> at = ReadPosition(tx, "billing", 3);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(at->done, start);
}

TEST_F(OutboxLogTest, OnlyTheLeaseHolderMovesAPositionAndOnlyForward) {
  db_.Exec(
      "INSERT INTO subscriptions (name, start_tick) VALUES ('billing', 1)");
  db_.Exec(
      "INSERT INTO outbox_partition_leases (subscription, partition, owner, "
      "token, expires_at) VALUES ('billing', 3, 'relay-a', 1, now() + "
      "interval '1 minute'), ('billing', 4, 'relay-a', 1, now() - interval "
      "'1 second')");
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(TickIn(conn_).ok());
  pqxx::work tx(conn_);
  ASSERT_TRUE(ReadPosition(tx, "billing", 3).ok());
  ASSERT_TRUE(ReadPosition(tx, "billing", 4).ok());
  const LogPosition at{.done = 1};
  const LogPosition begun{.done = 1, .reading = 3, .after_seq = 40};
  const auto move = [&](int partition, const std::string& member,
                        const LogPosition& from, const LogPosition& to) {
    absl::StatusOr<bool> moved =
        MovePosition(tx, "billing", partition, member, from, to);
    EXPECT_TRUE(moved.ok()) << moved.status();
    return moved.ok() && *moved;
  };
  EXPECT_FALSE(move(3, "relay-b", at, begun));                 // not its lease
  EXPECT_FALSE(move(4, "relay-a", at, begun));                 // expired
  EXPECT_FALSE(move(3, "relay-a", {.done = 2}, {.done = 3}));  // not there
  EXPECT_TRUE(move(3, "relay-a", at, begun));
  EXPECT_FALSE(move(3, "relay-a", at, begun));  // moved already
  absl::StatusOr<LogPosition> now = ReadPosition(tx, "billing", 3);
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->reading, 3);
  EXPECT_EQ(now->after_seq, 40);
  EXPECT_TRUE(absl::IsInvalidArgument(
      MovePosition(tx, "billing", 3, "relay-a", begun,
                   {.done = 1, .reading = 3, .after_seq = 39})
          .status()));
  EXPECT_TRUE(move(3, "relay-a", begun, {.done = 3}));
}

// LogOwedBy (outbox_log_owed_by, one scan) counts what outbox_log_owed
// says of each event: partitions without a position, done at a tick, in a
// begun range, one with a transaction that committed late, the start seq.
TEST_F(OutboxLogTest, WhatTheLogOwesCountedAtOnceAsEventByEvent) {
  db_.Exec("INSERT INTO subscriptions (name, start_seq) VALUES ('billing', 3)");
  db_.Exec("SELECT outbox_log_subscribe('billing')");
  pqxx::connection other(db_.url());
  pqxx::work late(other);
  Append(late, "late", 0, 2);  // drawn early, committed after the tick
  const auto append = [&](int partition, int n) {
    pqxx::work tx(conn_);
    for (int i = 0; i < n; ++i) Append(tx, absl::StrCat("a", i), 0, partition);
    tx.commit();
  };
  for (int p = 0; p < 4; ++p) append(p, 3);
  absl::StatusOr<Tick> mid = TickIn(conn_);
  ASSERT_TRUE(mid.ok());
  late.commit();
  for (int p = 0; p < 4; ++p) append(p, 2);
  absl::StatusOr<Tick> end = TickIn(conn_);
  ASSERT_TRUE(end.ok());
  // Partition 0: no position. 1: done at `mid`. 2: reading (mid, end]
  // after its first event there. 3: done at `end`.
  db_.Exec(absl::StrCat(
      "INSERT INTO outbox_log_positions (subscription, partition, "
      "done_tick, reading_tick, after_seq) VALUES ('billing', 1, ",
      mid->id, ", 0, 0), ('billing', 2, ", mid->id, ", ", end->id,
      ", (SELECT min(seq) FROM outbox WHERE partition = 2 AND NOT "
      "pg_visible_in_snapshot(xid, (SELECT snapshot FROM outbox_ticks WHERE "
      "id = ",
      mid->id, ")))), ('billing', 3, ", end->id, ", 0, 0)"));
  std::map<int, std::pair<int64_t, int64_t>> expected;  // count, lowest
  for (const auto& row : db_.Query(
           "SELECT partition, count(*), min(seq) FROM outbox WHERE "
           "outbox_log_owed('billing', seq, xid, partition) GROUP BY 1")) {
    expected[row[0].as<int>()] = {row[1].as<int64_t>(), row[2].as<int64_t>()};
  }
  ASSERT_EQ(expected.size(), 3u);  // partition 3 owes nothing
  int64_t expected_total = 0;
  for (const auto& [p, c] : expected) expected_total += c.first;
  // The delivery state that the view, the admin API, the checker and
  // reconcile read (kDeliveryStatusSql, joined to the positions) says
  // pending of exactly those events, skipped below the start seq, and
  // delivered of the rest.
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox o JOIN subscriptions s "
                       "ON s.name = 'billing' WHERE (CASE WHEN o.seq < "
                       "s.start_seq THEN 'skipped' WHEN outbox_log_owed("
                       "'billing', o.seq, o.xid, o.partition) THEN 'pending' "
                       "ELSE 'delivered' END) IS DISTINCT FROM (SELECT "
                       "v.status FROM outbox_deliveries v WHERE "
                       "v.subscription = 'billing' AND v.seq = o.seq)"),
            0);
  EXPECT_EQ(
      db_.Scalar(absl::StrCat(
          "SELECT count(*) FROM outbox o JOIN subscriptions s ON s.name "
          "= 'billing' LEFT JOIN outbox_delivery d ON d.subscription = "
          "'billing' AND d.seq = o.seq",
          kDeliveryLogJoinsSql, "WHERE ", kDeliveryStatusSql, " = 'pending'")),
      expected_total);
  pqxx::work tx(conn_);
  absl::StatusOr<std::map<int, LogOwed>> owed =
      LogOwedBy(tx, "billing", {}, 1000);
  ASSERT_TRUE(owed.ok()) << owed.status();
  std::map<int, std::pair<int64_t, int64_t>> got;
  for (const auto& [p, o] : *owed) got[p] = {o.events, o.lowest_seq};
  EXPECT_EQ(got, expected);
  // Only the partitions asked for; and at most `cap` counted.
  owed = LogOwedBy(tx, "billing", {2, 3}, 1000);
  ASSERT_TRUE(owed.ok()) << owed.status();
  EXPECT_EQ(owed->size(), 1u);
  EXPECT_EQ(owed->count(2), 1u);
  owed = LogOwedBy(tx, "billing", {}, 2);
  ASSERT_TRUE(owed.ok()) << owed.status();
  int64_t counted = 0;
  for (const auto& [p, o] : *owed) counted += o.events;
  EXPECT_EQ(counted, 2);
  // A subscription on rows: the log owes it nothing.
  tx.exec("INSERT INTO subscriptions (name) VALUES ('rows')");
  owed = LogOwedBy(tx, "rows", {}, 1000);
  ASSERT_TRUE(owed.ok()) << owed.status();
  EXPECT_TRUE(owed->empty());
}

// outbox_log_delivered, the question the admin API, the checker and
// retention ask of an event: done iff its range is done, or the read of
// the begun range passed it.
TEST_F(OutboxLogTest, TheLogKnowsWhatItDelivered) {
  db_.Exec(
      "INSERT INTO subscriptions (name, start_tick) VALUES ('billing', 1)");
  const Tick t1 = Latest();
  std::vector<int64_t> seqs;
  for (int i = 0; i < 3; ++i) {
    pqxx::work tx(conn_);
    seqs.push_back(Append(tx, "one"));  // one aggregate: one partition
    tx.commit();
  }
  absl::StatusOr<Tick> t2 = TickIn(conn_);
  ASSERT_TRUE(t2.ok());
  {
    pqxx::work tx(conn_);
    seqs.push_back(Append(tx, "one"));  // after the tick
    tx.commit();
  }
  absl::StatusOr<std::vector<LogEvent>> range = ReadRange(conn_, t1, *t2);
  ASSERT_TRUE(range.ok());
  ASSERT_EQ(range->size(), 3u);
  const int partition = range->front().partition;
  const auto delivered = [&] {
    std::vector<bool> out;
    for (const auto& row : db_.Query(absl::StrCat(
             "SELECT outbox_log_delivered('billing', seq, xid, partition) "
             "FROM outbox ORDER BY seq"))) {
      out.push_back(row[0].as<bool>());
    }
    return out;
  };
  EXPECT_EQ(delivered(), (std::vector<bool>{false, false, false, false}));
  db_.Exec(absl::StrCat(
      "INSERT INTO outbox_log_positions (subscription, partition, done_tick, "
      "reading_tick, after_seq) VALUES ('billing', ",
      partition, ", ", t1.id, ", ", t2->id, ", ", seqs[0], ")"));
  EXPECT_EQ(delivered(), (std::vector<bool>{true, false, false, false}));
  db_.Exec(absl::StrCat("UPDATE outbox_log_positions SET done_tick = ", t2->id,
                        ", reading_tick = 0, after_seq = 0"));
  EXPECT_EQ(delivered(), (std::vector<bool>{true, true, true, false}));
  // Another subscription's position says nothing of this one's.
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox WHERE "
                       "outbox_log_delivered('audit', seq, xid, partition)"),
            0);
}

TEST_F(OutboxLogTest, PruningKeepsTheTicksPositionsNeed) {
  db_.Exec(
      "INSERT INTO subscriptions (name, start_tick) VALUES ('billing', 1)");
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(TickIn(conn_).ok());  // 2-5
  const auto prune = [&] {
    pqxx::work tx(conn_);
    absl::StatusOr<int64_t> n = PruneTicks(tx);
    EXPECT_TRUE(n.ok()) << n.status();
    tx.commit();
    return n.ok() ? *n : -1;
  };
  // No partition read yet: its start tick is needed.
  EXPECT_EQ(prune(), 0);
  db_.Exec(absl::StrCat(
      "INSERT INTO outbox_log_positions (subscription, partition, done_tick) "
      "SELECT 'billing', p, CASE WHEN p = 7 THEN 3 ELSE 4 END FROM "
      "generate_series(0, ",
      kPartitions - 1, ") p"));
  EXPECT_EQ(prune(), 2);  // 1 and 2
  EXPECT_EQ(db_.Scalar("SELECT min(id) FROM outbox_ticks"), 3);
  db_.Exec("DELETE FROM subscriptions");
  EXPECT_EQ(prune(), 2);  // all but the newest
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_ticks"), 1);
}

// Writers that commit in any order, some late, some rolled back, some
// drawing their seq before their xid, while two readers (each half of the
// partitions) tick and read range after range: every committed event is
// read exactly once, by the reader of its partition, and each aggregate's
// events in seq order. The writers lock each aggregate while appending, as
// the writer's chain head does, so an aggregate's events commit in seq
// order.
TEST_F(OutboxLogTest, ConcurrentWritersEveryEventReadOnce) {
  constexpr int kWriters = 4;
  constexpr int kTransactionsEach = 120;
  std::atomic<int> writers_left{kWriters};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      pqxx::connection c(db_.url());
      std::mt19937 rng(100 + w);
      for (int i = 0; i < kTransactionsEach; ++i) {
        try {
          pqxx::work tx(c);
          // Locked in one order, as the writer locks chain heads.
          std::set<std::string> aggregates;
          for (int n = 1 + rng() % 3; n > 0; --n) {
            aggregates.insert(absl::StrCat("agg-", rng() % 24));
          }
          for (const std::string& aggregate : aggregates) {
            tx.exec_params("SELECT pg_advisory_xact_lock(hashtext($1))",
                           aggregate);
            if (rng() % 4 == 0) {
              // The seq first, the xid only with the insert.
              const int64_t seq =
                  tx.exec(
                        "SELECT nextval(pg_get_serial_sequence('outbox', "
                        "'seq'))")[0][0]
                      .as<int64_t>();
              tx.exec("SELECT pg_sleep(0.002)");
              Append(tx, aggregate, seq);
            } else {
              Append(tx, aggregate);
            }
          }
          if (rng() % 3 == 0) {
            tx.exec(absl::StrCat("SELECT pg_sleep(", rng() % 8, " / 1000.0)"));
          }
          if (rng() % 10 == 0) {
            tx.abort();
          } else {
            tx.commit();
          }
        } catch (const std::exception& e) {
          ADD_FAILURE() << "writer " << w << ": " << e.what();
        }
      }
      --writers_left;
    });
  }

  struct Reader {
    std::vector<int> partitions;
    std::vector<LogEvent> read;
  };
  std::vector<Reader> readers(2);
  for (int p = 0; p < kPartitions; ++p) {
    readers[p < kPartitions / 2 ? 0 : 1].partitions.push_back(p);
  }
  std::vector<std::thread> reading;
  const Tick start = Latest();
  for (Reader& reader : readers) {
    reading.emplace_back([&, r = &reader] {
      pqxx::connection c(db_.url());
      Tick done = start;
      const absl::Time deadline = absl::Now() + absl::Minutes(2);
      bool last_pass = false;
      while (absl::Now() < deadline) {
        // Writers all finished before this tick: it is the last needed.
        last_pass = writers_left.load() == 0;
        absl::StatusOr<Tick> next = TickIn(c);
        if (!next.ok()) {
          ADD_FAILURE() << next.status();
          return;
        }
        absl::StatusOr<std::vector<LogEvent>> got =
            ReadRange(c, done, *next, r->partitions, 5);
        if (!got.ok()) {
          ADD_FAILURE() << got.status();
          return;
        }
        for (LogEvent& e : *got) r->read.push_back(std::move(e));
        done = *next;
        if (last_pass) return;
        absl::SleepFor(absl::Milliseconds(3));
      }
      ADD_FAILURE() << "reader did not finish in time";
    });
  }
  for (std::thread& t : threads) t.join();
  for (std::thread& t : reading) t.join();

  std::map<int64_t, int> committed;  // seq -> partition
  for (const auto& row : db_.Query("SELECT seq, partition FROM outbox")) {
    committed[row[0].as<int64_t>()] = row[1].as<int>();
  }
  ASSERT_GT(committed.size(), 300u);
  std::map<int64_t, int> seen;
  int late = 0;
  for (int i = 0; i < 2; ++i) {
    std::map<std::string, int64_t> last_of_aggregate;
    int64_t highest = 0;
    for (const LogEvent& e : readers[i].read) {
      const int64_t seq = e.event.seq();
      ++seen[seq];
      EXPECT_EQ(e.partition < kPartitions / 2 ? 0 : 1, i) << seq;
      int64_t& last = last_of_aggregate[e.event.aggregate_id()];
      EXPECT_GT(seq, last) << "aggregate " << e.event.aggregate_id();
      last = seq;
      late += seq < highest;
      highest = std::max(highest, seq);
    }
  }
  for (const auto& [seq, partition] : committed) {
    EXPECT_EQ(seen[seq], 1)
        << "event " << seq << " read " << seen[seq] << " times";
  }
  EXPECT_EQ(seen.size(), committed.size());
  // The case the log exists for happened: events read after a higher seq.
  EXPECT_GT(late, 0);
}

}  // namespace
}  // namespace outbox::relay
