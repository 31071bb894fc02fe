// Delivery from the log as a relay drives it, against a real PostgreSQL:
// every event sent until settled, positions stored only as far as answers
// allow, a relay killed mid-batch resuming where its position stands,
// chains with exceptions joining them, lost leases, retention and the move
// of a subscription onto the log while writers write.

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/schema.h"
#include "relay/delivery_store.h"
#include "relay/log_reader.h"
#include "relay/log_testing.h"
#include "relay/retention.h"
#include "tests/testing/pg.h"

namespace outbox::relay {
namespace {

std::vector<int> AllPartitions() {
  std::vector<int> all;
  for (int p = 0; p < kPartitions; ++p) all.push_back(p);
  return all;
}

std::vector<int64_t> Seqs(const LogSend& send) {
  std::vector<int64_t> seqs;
  for (const LogEvent& e : send.events) seqs.push_back(e.event.seq());
  return seqs;
}

class LogReaderTest : public ::testing::Test {
 protected:
  LogReaderTest() : db_("log_reader", {OutboxSchema()}), conn_(db_.url()) {
    db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
    db_.Exec(absl::StrCat(
        "INSERT INTO outbox_partition_leases (subscription, partition, owner, "
        "token, expires_at) SELECT 'billing', p, 'relay-a', 1, now() + "
        "interval '1 hour' FROM generate_series(0, ",
        kPartitions - 1, ") p"));
  }

  // Moves billing onto the log now (its start tick).
  int64_t Subscribe() {
    return db_.Scalar("SELECT outbox_log_subscribe('billing')");
  }

  int64_t AppendCommitted(const std::string& aggregate, int partition = -1) {
    pqxx::work tx(conn_);
    const int64_t seq = Append(tx, aggregate, 0, partition);
    tx.commit();
    return seq;
  }

  LogReader NewReader() {
    return LogReader({.subscription = "billing",
                      .member = "relay-a",
                      .tick_interval = absl::ZeroDuration()});
  }

  LogSend Next(LogReader& reader, int limit,
               std::vector<int> partitions = AllPartitions()) {
    absl::StatusOr<LogSend> s = reader.Next(conn_, partitions, limit);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : LogSend{};
  }

  // Reads, settles and flushes until nothing is left; the seqs sent.
  std::vector<int64_t> Drain(LogReader& reader,
                             std::vector<int> partitions = AllPartitions()) {
    std::vector<int64_t> all;
    for (int round = 0; round < 200; ++round) {
      LogSend s = Next(reader, 64, partitions);
      for (int64_t seq : Seqs(s)) {
        EXPECT_TRUE(reader.Settle(seq)) << seq;
        all.push_back(seq);
      }
      EXPECT_TRUE(Flush(reader).empty());
      if (s.events.empty() && s.diverted == 0 && !s.more) break;
    }
    return all;
  }

  std::vector<int> Flush(LogReader& reader) {
    absl::StatusOr<std::vector<int>> lost = reader.Flush(conn_);
    EXPECT_TRUE(lost.ok()) << lost.status();
    return lost.ok() ? *lost : std::vector<int>{};
  }

  int64_t Rows() {
    return db_.Scalar(
        "SELECT count(*) FROM outbox_delivery WHERE subscription = 'billing'");
  }

  testing::TestDatabase db_;
  pqxx::connection conn_;
};

TEST_F(LogReaderTest, EveryEventOnceInOrderAndNoRowPerEvent) {
  Subscribe();
  std::vector<int64_t> written;
  for (int i = 0; i < 10; ++i) {
    written.push_back(AppendCommitted(absl::StrCat("o", i % 4)));
  }
  LogReader reader = NewReader();
  std::vector<int64_t> sent = Drain(reader);
  EXPECT_EQ(sent, written);  // one group: seq order
  EXPECT_EQ(Rows(), 0);      // the trigger owes a log subscription nothing
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox o WHERE NOT "
                       "outbox_log_delivered('billing', o.seq, o.xid, "
                       "o.partition)"),
            0);
  // Every partition's position is stored, and all at one done tick.
  EXPECT_EQ(db_.Scalar("SELECT count(DISTINCT done_tick) FROM "
                       "outbox_log_positions WHERE reading_tick = 0"),
            1);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_log_positions"),
            kPartitions);
  // A subscription the log does not deliver to still gets its rows.
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('audit')");
  AppendCommitted("o9");
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_delivery WHERE "
                       "subscription = 'audit'"),
            1);
  EXPECT_EQ(Rows(), 0);
}

// A relay asks the database for a tick only when it must show commits
// the tick it has may not: an answer's wake-up costs nothing, and a tick
// younger than tick_interval is kept until it may be replaced.
TEST_F(LogReaderTest, ATickIsAskedForOnlyWhenCommitsMayBeMissing) {
  Subscribe();
  const auto ticks = [&] {
    return db_.Scalar("SELECT count(*) FROM outbox_ticks");
  };
  const auto read = [&](LogReader& reader, absl::Time must_show) {
    absl::StatusOr<LogSend> s =
        reader.Next(conn_, AllPartitions(), 10, must_show);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : LogSend{};
  };
  LogReader reader({.subscription = "billing",
                    .member = "relay-a",
                    .tick_interval = absl::Hours(1)});
  // The first read has no tick: it asks, whatever it must show (the
  // start tick is made old enough to be replaced).
  db_.Exec("UPDATE outbox_ticks SET made_at = made_at - interval '2 hours'");
  const int64_t a = AppendCommitted("o1");
  const absl::Time before_first = absl::Now();
  LogSend first = read(reader, absl::InfinitePast());
  EXPECT_EQ(Seqs(first), (std::vector<int64_t>{a}));
  // The tick it made shows every commit before the read began.
  EXPECT_GE(first.shows_before, before_first);
  EXPECT_EQ(first.retry_in, absl::ZeroDuration());
  EXPECT_FALSE(first.exceptions);  // the statement saw none
  ASSERT_TRUE(reader.Settle(a));
  const int64_t made = ticks();

  // A commit since; a read that need show nothing new (an answer came)
  // reads on to the tick it has: no statement makes or reads a tick.
  const int64_t b = AppendCommitted("o2");
  LogSend quiet = read(reader, absl::InfinitePast());
  EXPECT_TRUE(quiet.events.empty());
  EXPECT_EQ(quiet.shows_before, first.shows_before);
  EXPECT_EQ(quiet.retry_in, absl::ZeroDuration());
  EXPECT_FALSE(quiet.exceptions);  // as the last statement saw
  EXPECT_EQ(ticks(), made);

  // A NOTIFY announced b: the tick it has is younger than tick_interval,
  // so it is kept, and a retry is due when it may be replaced.
  LogSend young = read(reader, absl::Now());
  EXPECT_TRUE(young.events.empty());
  EXPECT_GT(young.retry_in, absl::Minutes(59));
  EXPECT_LT(young.shows_before, absl::Now());
  EXPECT_EQ(ticks(), made);

  // Another relay of the subscription, whose tick is old enough: it makes
  // one, and the first reader's next ask reads it (one new tick in all).
  LogReader other({.subscription = "billing",
                   .member = "relay-a",
                   .tick_interval = absl::ZeroDuration()});
  const absl::Time announced = absl::Now();
  LogSend others = read(other, announced);
  EXPECT_GE(others.shows_before, announced);
  EXPECT_EQ(ticks(), made + 1);
  EXPECT_EQ(Seqs(others), (std::vector<int64_t>{a, b}));  // none flushed
  // A relay that starts now shares that tick: younger than its interval,
  // it is read, not made again, and kept until it may be replaced.
  LogReader later({.subscription = "billing",
                   .member = "relay-a",
                   .tick_interval = absl::Hours(1)});
  EXPECT_EQ(Seqs(read(later, absl::InfinitePast())),
            (std::vector<int64_t>{a, b}));
  EXPECT_EQ(ticks(), made + 1);
  LogSend kept = read(later, absl::Now());
  EXPECT_GT(kept.retry_in, absl::Minutes(59));
  EXPECT_EQ(ticks(), made + 1);
}

TEST_F(LogReaderTest, ARelayKilledMidBatchResumesAtItsPosition) {
  Subscribe();
  std::vector<int64_t> e;
  for (int i = 0; i < 6; ++i) e.push_back(AppendCommitted("o1"));
  {
    LogReader reader = NewReader();
    EXPECT_EQ(Seqs(Next(reader, 3)), (std::vector<int64_t>{e[0], e[1], e[2]}));
    // Pipelined: the next batch goes before the first is answered.
    EXPECT_EQ(Seqs(Next(reader, 3)), (std::vector<int64_t>{e[3], e[4], e[5]}));
    EXPECT_EQ(reader.in_flight(), 6u);
    EXPECT_TRUE(reader.Settle(e[0]));
    EXPECT_TRUE(reader.Settle(e[1]));
    EXPECT_TRUE(reader.Settle(e[3]));  // beyond an unanswered one
    EXPECT_FALSE(reader.Settle(e[3]));
    EXPECT_TRUE(Flush(reader).empty());
    EXPECT_EQ(db_.Scalar("SELECT max(after_seq) FROM outbox_log_positions"),
              e[1]);
  }  // killed: e[2] unanswered, e[4] and e[5] too
  LogReader again = NewReader();
  EXPECT_EQ(Seqs(Next(again, 10)),
            (std::vector<int64_t>{e[2], e[3], e[4], e[5]}));
}

TEST_F(LogReaderTest, ATransactionThatCommitsLateIsReadLater) {
  Subscribe();
  pqxx::connection other(db_.url());
  pqxx::work late(other);
  const int64_t early_seq = Append(late, "slow");  // drawn first
  const int64_t quick = AppendCommitted("quick");
  LogReader reader = NewReader();
  EXPECT_EQ(Drain(reader), (std::vector<int64_t>{quick}));
  late.commit();
  EXPECT_EQ(Drain(reader), (std::vector<int64_t>{early_seq}));
  EXPECT_EQ(Drain(reader), (std::vector<int64_t>{}));
}

// Ranges pipeline: the next one is read while the answers of the one
// before are coming, and the position passes a range only once it and
// every range before it are settled.
TEST_F(LogReaderTest, TheNextRangeIsReadWhileTheLastWaitsForAnswers) {
  Subscribe();
  const int64_t a = AppendCommitted("a");
  LogReader reader = NewReader();
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{a}));
  const int64_t b = AppendCommitted("b");
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{b}));
  const int64_t c = AppendCommitted("c");
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{c}));
  EXPECT_EQ(reader.in_flight(), 3u);
  ASSERT_TRUE(reader.Settle(c));
  ASSERT_TRUE(reader.Settle(b));
  EXPECT_FALSE(reader.moved());  // a holds the later ranges back
  ASSERT_TRUE(reader.Settle(a));
  EXPECT_TRUE(reader.moved());
  EXPECT_TRUE(Flush(reader).empty());
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_log_positions WHERE "
                       "reading_tick = 0 AND done_tick = (SELECT max(id) "
                       "FROM outbox_ticks)"),
            kPartitions);
  EXPECT_EQ(Drain(reader), (std::vector<int64_t>{}));
}

// A relay killed with ranges in flight: it resumes in the first range not
// settled, and what later ranges settled is delivered again, never lost.
TEST_F(LogReaderTest, ARelayKilledWithRangesInFlightResumesAtTheFirst) {
  Subscribe();
  const int64_t a1 = AppendCommitted("a");
  const int64_t a2 = AppendCommitted("a");
  int64_t b = 0;
  {
    LogReader reader = NewReader();
    EXPECT_EQ(Seqs(Next(reader, 1)), (std::vector<int64_t>{a1}));
    EXPECT_EQ(Seqs(Next(reader, 1)), (std::vector<int64_t>{a2}));
    // The range's end, found by a read of its own (the last one stopped at
    // its limit).
    EXPECT_EQ(Seqs(Next(reader, 1)), (std::vector<int64_t>{}));
    b = AppendCommitted("b");
    EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{b}));
    ASSERT_TRUE(reader.Settle(b));
    ASSERT_TRUE(reader.Settle(a1));
    EXPECT_TRUE(Flush(reader).empty());
    EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_log_positions WHERE "
                         "reading_tick > done_tick AND after_seq = " +
                         std::to_string(a1)),
              kPartitions);
  }  // killed: a2 unanswered, b answered behind it
  LogReader again = NewReader();
  EXPECT_EQ(Drain(again), (std::vector<int64_t>{a2, b}));
}

// A transaction that commits late while ranges pipeline past it is read in
// the range whose tick first sees it, after the positions moved on.
TEST_F(LogReaderTest, ALateCommitBehindPipelinedRangesIsNotSkipped) {
  Subscribe();
  pqxx::connection other(db_.url());
  pqxx::work late(other);
  const int64_t slow = Append(late, "slow");  // the lowest seq
  LogReader reader = NewReader();
  const int64_t q1 = AppendCommitted("q1");
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{q1}));
  const int64_t q2 = AppendCommitted("q2");
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{q2}));
  ASSERT_TRUE(reader.Settle(q2));
  ASSERT_TRUE(reader.Settle(q1));
  EXPECT_TRUE(Flush(reader).empty());
  late.commit();
  LogReader again = NewReader();  // from the stored positions
  EXPECT_EQ(Drain(again), (std::vector<int64_t>{slow}));
  EXPECT_EQ(Drain(again), (std::vector<int64_t>{}));
}

TEST_F(LogReaderTest, ARewindReadsEveryRangeInFlightAgain) {
  Subscribe();
  const int64_t a = AppendCommitted("a");
  LogReader reader = NewReader();
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{a}));
  const int64_t b = AppendCommitted("b");
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{b}));
  ASSERT_TRUE(reader.Settle(b));
  reader.Rewind();  // a's answer will not come
  EXPECT_FALSE(reader.Settle(a));
  EXPECT_EQ(reader.in_flight(), 0u);
  EXPECT_EQ(Drain(reader), (std::vector<int64_t>{a, b}));
  EXPECT_EQ(Drain(reader), (std::vector<int64_t>{}));
}

// Two groups about to stand at one tick stop pipelining until both are
// answered, and read as one from then on.
TEST_F(LogReaderTest, GroupsThatReachOneTickReadAsOneAgain) {
  Subscribe();
  std::vector<int> even;
  for (int p = 0; p < kPartitions; p += 2) even.push_back(p);
  LogReader reader = NewReader();
  const int64_t e0 = AppendCommitted("e0", 0);
  EXPECT_EQ(Seqs(Next(reader, 10, even)), (std::vector<int64_t>{e0}));
  const int64_t o1 = AppendCommitted("o1", 1);
  // Even partitions read on from their range's end, the odd ones from the
  // start: both ranges end at the new tick.
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{o1}));
  AppendCommitted("later", 3);
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{}));  // waiting
  ASSERT_TRUE(reader.Settle(e0));
  ASSERT_TRUE(reader.Settle(o1));
  // One group: one read in seq order across both halves.
  const int64_t o3 = AppendCommitted("o3", 3);
  const int64_t e2 = AppendCommitted("e2", 2);
  std::vector<int64_t> all = Drain(reader);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[1], o3);
  EXPECT_EQ(all[2], e2);
  EXPECT_EQ(db_.Scalar("SELECT count(DISTINCT (done_tick, reading_tick, "
                       "after_seq)) FROM outbox_log_positions"),
            1);
}

TEST_F(LogReaderTest, ChainsWithExceptionsJoinThem) {
  Subscribe();
  const int64_t a1 = AppendCommitted("a");
  const int64_t b1 = AppendCommitted("b");
  LogReader reader = NewReader();
  EXPECT_EQ(Drain(reader), (std::vector<int64_t>{a1, b1}));
  {
    // a1 was rejected: it is an exception now (the relay's mark).
    pqxx::work tx(conn_);
    ASSERT_TRUE(OweExceptions(tx, "billing", {a1}).ok());
    tx.commit();
  }
  const int64_t a2 = AppendCommitted("a");
  const int64_t b2 = AppendCommitted("b");
  const int64_t a3 = AppendCommitted("a");
  LogSend s = Next(reader, 10);
  EXPECT_EQ(Seqs(s), (std::vector<int64_t>{b2}));
  EXPECT_EQ(s.diverted, 2);
  EXPECT_EQ(db_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox_delivery WHERE subscription = "
                "'billing' AND status = 'pending' AND seq IN (",
                a2, ", ", a3, ")")),
            2);
  ASSERT_TRUE(reader.Settle(b2));
  EXPECT_TRUE(Flush(reader).empty());
  // The position passed them all: they are the exceptions' now.
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{}));
  EXPECT_EQ(Rows(), 3);
}

// Exceptions another session writes (an operator's replay, a heal) while
// the reader believes a partition has none are seen by the next read that
// asks for a tick (after a NOTIFY, or at the poll at the latest): from
// then on the chain's new events wait behind them.
TEST_F(LogReaderTest, AnExceptionWrittenElsewhereIsSeenAtTheNextTick) {
  Subscribe();
  const int64_t a1 = AppendCommitted("a");
  LogReader reader = NewReader();
  EXPECT_EQ(Drain(reader), (std::vector<int64_t>{a1}));
  {
    pqxx::connection operator_session(db_.url());
    pqxx::work tx(operator_session);
    ASSERT_TRUE(OweExceptions(tx, "billing", {a1}).ok());  // a1 replayed
    tx.commit();
  }
  const int64_t a2 = AppendCommitted("a");
  const int64_t b1 = AppendCommitted("b");
  absl::StatusOr<LogSend> s =
      reader.Next(conn_, AllPartitions(), 10, absl::Now());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->exceptions);
  EXPECT_EQ(Seqs(*s), (std::vector<int64_t>{b1}));
  EXPECT_EQ(s->diverted, 1);  // a2, behind the replayed a1
  EXPECT_EQ(db_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox_delivery WHERE subscription = "
                "'billing' AND status = 'pending' AND seq IN (",
                a1, ", ", a2, ")")),
            2);
}

TEST_F(LogReaderTest, ALostLeaseKeepsThePositionAsItWas) {
  Subscribe();
  const int64_t seq = AppendCommitted("x", 5);
  LogReader reader = NewReader();
  EXPECT_EQ(Seqs(Next(reader, 10, {5})), (std::vector<int64_t>{seq}));
  ASSERT_TRUE(reader.Settle(seq));
  db_.Exec(
      "UPDATE outbox_partition_leases SET owner = 'relay-b' WHERE partition = "
      "5");
  EXPECT_EQ(Flush(reader), (std::vector<int>{5}));
  EXPECT_TRUE(reader.known().empty());
  EXPECT_EQ(db_.Scalar("SELECT after_seq + reading_tick FROM "
                       "outbox_log_positions WHERE partition = 5"),
            0);
}

TEST_F(LogReaderTest, ARewindReadsWhatWasInFlightAgain) {
  Subscribe();
  const int64_t a = AppendCommitted("a");
  const int64_t b = AppendCommitted("b");
  LogReader reader = NewReader();
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{a, b}));
  ASSERT_TRUE(reader.Settle(a));
  reader.Rewind();  // the stream broke before b's answer
  EXPECT_FALSE(reader.Settle(b));
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{b}));
  ASSERT_TRUE(reader.Settle(b));
  EXPECT_TRUE(Flush(reader).empty());
  EXPECT_EQ(Seqs(Next(reader, 10)), (std::vector<int64_t>{}));
}

// Lanes ask for parts of the partitions; a group in flight is not split,
// an idle one is, and all of them come together again.
TEST_F(LogReaderTest, EachPartOfThePartitionsReadsItsOwnEvents) {
  Subscribe();
  std::vector<int> even, odd;
  for (int p = 0; p < kPartitions; ++p) (p % 2 == 0 ? even : odd).push_back(p);
  std::set<int64_t> in_even, in_odd;
  for (int i = 0; i < 8; ++i) {
    in_even.insert(AppendCommitted(absl::StrCat("e", i), 2 * (i % 3)));
    in_odd.insert(AppendCommitted(absl::StrCat("o", i), 2 * (i % 3) + 1));
  }
  LogReader reader = NewReader();
  // All partitions are one group, in flight: neither half can read it.
  LogSend first = Next(reader, 2);
  EXPECT_EQ(first.events.size(), 2u);
  EXPECT_TRUE(Seqs(Next(reader, 10, even)).empty());
  for (int64_t seq : Seqs(first)) {
    ASSERT_TRUE(reader.Settle(seq));
    (in_even.count(seq) ? in_even : in_odd).erase(seq);
  }
  const std::vector<int64_t> evens = Drain(reader, even);
  const std::vector<int64_t> odds = Drain(reader, odd);
  EXPECT_EQ(std::set<int64_t>(evens.begin(), evens.end()), in_even);
  EXPECT_EQ(std::set<int64_t>(odds.begin(), odds.end()), in_odd);
  const int64_t last = AppendCommitted("z", 7);
  EXPECT_EQ(Drain(reader), (std::vector<int64_t>{last}));
  EXPECT_EQ(db_.Scalar("SELECT count(DISTINCT (done_tick, reading_tick, "
                       "after_seq)) FROM outbox_log_positions"),
            1);
}

// An operator's replay of delivered events, not committed yet, and
// retention deleting those same events: the delete waits for the replay
// and then keeps what it owes. Before, it read past the replay's rows,
// deleted the events, and left rows owing events that no longer exist
// (never sent, never reported lost, and holding retention back for good).
TEST_F(LogReaderTest, AReplayInFlightHoldsRetentionBack) {
  Subscribe();
  std::vector<int64_t> e;
  for (int i = 0; i < 3; ++i) e.push_back(AppendCommitted("r"));
  db_.Exec("DELETE FROM outbox_delivery");
  LogReader reader = NewReader();
  Drain(reader);
  pqxx::connection operator_conn(db_.url());
  pqxx::work replay(operator_conn);
  ReplaySelector sel;
  sel.by_seq = true;
  sel.from_seq = e[0];
  sel.to_seq = e[1];
  EXPECT_EQ(Replay(replay, "billing", sel).owed, 2);
  std::atomic<int64_t> pruned{-1};
  std::thread retention([&] {
    pqxx::connection c(db_.url());
    pqxx::work tx(c);
    pruned = PruneOutbox(tx, absl::ZeroDuration(), 1000);
    tx.commit();
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (pruned < 0 && absl::Now() < deadline &&
         db_.Scalar("SELECT count(*) FROM pg_locks WHERE locktype = "
                    "'advisory' AND NOT granted") == 0) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(pruned, -1) << "the delete did not wait for the replay";
  replay.commit();
  retention.join();
  EXPECT_EQ(pruned, 0);  // the lowest events are owed again
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_delivery d WHERE NOT "
                       "EXISTS (SELECT 1 FROM outbox o WHERE o.seq = d.seq)"),
            0);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox"), 3);
}

TEST_F(LogReaderTest, RetentionKeepsWhatTheLogHasNotDelivered) {
  const int64_t before = AppendCommitted("old");  // owed by a row
  Subscribe();
  std::vector<int64_t> e;
  for (int i = 0; i < 4; ++i) e.push_back(AppendCommitted("o"));
  const auto prune = [&] {
    pqxx::work tx(conn_);
    const int64_t n = PruneOutbox(tx, absl::ZeroDuration(), 1000);
    tx.commit();
    return n;
  };
  const auto oldest = [&] { return db_.Scalar("SELECT min(seq) FROM outbox"); };
  EXPECT_EQ(prune(), 0);  // its row is pending
  db_.Exec("DELETE FROM outbox_delivery");
  EXPECT_EQ(prune(), 1);  // delivered: only the log's events stay
  EXPECT_EQ(oldest(), e[0]);
  LogReader reader = NewReader();
  LogSend s = Next(reader, 3);
  ASSERT_EQ(Seqs(s), (std::vector<int64_t>{e[0], e[1], e[2]}));
  ASSERT_TRUE(reader.Settle(e[0]));
  ASSERT_TRUE(reader.Settle(e[1]));
  EXPECT_TRUE(Flush(reader).empty());
  EXPECT_EQ(prune(), 0);  // within the range: kept until it is done
  ASSERT_TRUE(reader.Settle(e[2]));
  Drain(reader);
  EXPECT_EQ(prune(), 4);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox"), 0);
  EXPECT_LT(before, e[0]);
  // A partition never read holds retention at the start tick.
  db_.Exec("DELETE FROM outbox_log_positions WHERE partition = 9");
  const int64_t n = AppendCommitted("n", 3);
  std::vector<int> but_9 = AllPartitions();
  but_9.erase(but_9.begin() + 9);
  LogReader other = NewReader();
  EXPECT_EQ(Drain(other, but_9), (std::vector<int64_t>{n}));
  EXPECT_EQ(prune(), 0);
}

// Writers write while the subscription moves onto the log: every event is
// owed by a row or lies in the log after the start tick (none by neither),
// and both kinds exist.
TEST_F(LogReaderTest, MovingOntoTheLogWhileWritersWriteLosesNothing) {
  constexpr int kWriters = 3;
  constexpr int kEach = 150;
  std::atomic<int> written{0};
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      pqxx::connection c(db_.url());
      for (int i = 0; i < kEach; ++i) {
        pqxx::work tx(c);
        Append(tx, absl::StrCat("w", w, "-", i % 7));
        tx.commit();
        ++written;
      }
    });
  }
  while (written < kWriters * kEach / 3) std::this_thread::yield();
  const int64_t start = Subscribe();
  for (std::thread& t : writers) t.join();
  const std::string st = absl::StrCat(
      "(SELECT snapshot FROM outbox_ticks WHERE id = ", start, ")");
  EXPECT_EQ(db_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox o WHERE pg_visible_in_snapshot("
                "o.xid, ",
                st,
                ") AND NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE "
                "d.subscription = 'billing' AND d.seq = o.seq)")),
            0);
  const int64_t rows = Rows();
  const int64_t on_log = db_.Scalar(absl::StrCat(
      "SELECT count(*) FROM outbox o WHERE NOT pg_visible_in_snapshot(o.xid, ",
      st, ")"));
  EXPECT_GT(rows, 0);
  EXPECT_GT(on_log, 0);
  EXPECT_GE(rows + on_log, kWriters * kEach);
  // The log delivers exactly those, once the rows from before (delivered
  // as before) are gone: until then their chains' events join them.
  db_.Exec("DELETE FROM outbox_delivery");
  LogReader reader = NewReader();
  EXPECT_EQ(static_cast<int64_t>(Drain(reader).size()), on_log);
}

}  // namespace
}  // namespace outbox::relay
