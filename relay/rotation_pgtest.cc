// Rotation against a real PostgreSQL: an outbox made partitioned by seq
// range keeps its events, its views and its writers; retention then
// empties a whole child, and only once every event in it may go (old
// enough, delivered, no transaction that may still commit below its
// bound, no read of it in progress); an id a caller
// gives stays unique across children; an insert past the last child is
// the world's fault, not the event's; a replay across a dropped child
// owes again what is retained.

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/db.h"
#include "common/ids.h"
#include "common/schema.h"
#include "common/sql_state.h"
#include "relay/delivery_store.h"
#include "relay/log_testing.h"
#include "relay/retention.h"
#include "relay/retention_testing.h"
#include "tests/testing/pg.h"
#include "writer/writer.h"

namespace outbox::relay {
namespace {

class RotationTest : public ::testing::Test {
 protected:
  RotationTest() : db_("rotation", {OutboxSchema()}), conn_(db_.url()) {}

  // Partitions the outbox in children of `span` seqs, `ahead` made ahead.
  std::string Partition(int64_t span, int ahead) {
    pqxx::work tx(conn_);
    const std::string said =
        tx.exec_params1("SELECT outbox_partition_outbox($1, $2)", span,
                        ahead)[0]
            .as<std::string>();
    tx.commit();
    return said;
  }

  int64_t AppendCommitted(const std::string& aggregate) {
    pqxx::work tx(conn_);
    const int64_t seq = Append(tx, aggregate);
    tx.commit();
    return seq;
  }

  // One step of retention (none kept for age unless `retention`),
  // checked to leave what went a prefix.
  int64_t Rotate(absl::Duration retention = absl::ZeroDuration(),
                 std::string* held_back = nullptr) {
    return RetentionStep(conn_, retention, held_back);
  }

  std::set<int64_t> Seqs() { return OutboxSeqs(conn_); }

  // The children, oldest first, as "name [lo, hi)".
  std::vector<std::string> Children() {
    std::vector<std::string> out;
    for (const auto& row :
         db_.Query("SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM "
                   "pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE "
                   "i.inhparent = 'outbox'::regclass ORDER BY c.relname")) {
      out.push_back(absl::StrCat(row[0].as<std::string>(), " ",
                                 row[1].as<std::string>()));
    }
    return out;
  }

  int64_t DeletedThrough() {
    return db_.Scalar("SELECT deleted_through FROM outbox_retention_state");
  }

  testing::TestDatabase db_;
  pqxx::connection conn_;
};

NewEvent EventOf(const std::string& aggregate, const std::string& id = "") {
  NewEvent e;
  e.aggregate_type = "order";
  e.aggregate_id = aggregate;
  e.event_type = "OrderCreated";
  e.event_id = id;
  return e;
}

// The events written before stay where they are (the old table becomes the
// first child), the writer appends on, the operators' view reads the
// parent, and a second call changes nothing.
TEST_F(RotationTest, PartitioningKeepsEventsViewsAndWriters) {
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  Writer writer;
  std::vector<int64_t> seqs;
  for (int i = 0; i < 3; ++i) {
    pqxx::work tx(conn_);
    auto a = writer.Append(tx, EventOf("a"));
    ASSERT_TRUE(a.ok()) << a.status();
    tx.commit();
    seqs.push_back(a->seq);
  }
  // The writer may draw more seqs than it writes (an aggregate's head
  // moved draws one more).
  const int64_t next = db_.Scalar(
      "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END "
      "FROM outbox_seq_seq");
  const std::string said = Partition(10, 2);
  EXPECT_TRUE(absl::StrContains(
      said, absl::StrCat("seqs below ", next, " in outbox_s0")))
      << said;
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM pg_partitioned_table WHERE "
                       "partrelid = 'outbox'::regclass"),
            1);
  const auto bound = [](int64_t lo) {
    return absl::StrCat("outbox_s", lo, " FOR VALUES FROM ('", lo, "') TO ('",
                        lo + 10, "')");
  };
  EXPECT_EQ(Children(),
            (std::vector<std::string>{
                absl::StrCat("outbox_s0 FOR VALUES FROM (MINVALUE) TO ('", next,
                             "')"),
                bound(next + 10), bound(next)}));
  pqxx::work tx(conn_);
  auto b = writer.Append(tx, EventOf("a"));
  ASSERT_TRUE(b.ok()) << b.status();
  tx.commit();
  EXPECT_GE(b->seq, next);
  EXPECT_EQ(b->prev_seq, seqs.back());
  // The view was made again on the parent: it shows the new event too.
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_deliveries WHERE "
                       "subscription = 'billing'"),
            4);
  // The delivery trigger fires on the parent.
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_delivery"), 4);
  EXPECT_EQ(Partition(10, 2), "the outbox is partitioned already");
}

// Roles other than the owner keep what they were granted on the outbox
// (on the table and on columns), and no more: the parent is a new table, and
// the sequence that seq draws from a new one, which a role that may insert
// needs USAGE on.
TEST_F(RotationTest, PartitioningKeepsTheOutboxsGrants) {
  const std::string suffix = NewUuid().substr(0, 8);  // roles are the server's
  const std::string writes = "rotation_writer_" + suffix;
  const std::string reads = "rotation_reader_" + suffix;
  db_.Exec(absl::StrCat(
      "CREATE ROLE ", writes, " LOGIN; CREATE ROLE ", reads,
      " LOGIN; GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO ",
      writes, "; GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO ", writes,
      "; GRANT SELECT (seq, event_id) ON outbox TO ", reads,
      " WITH GRANT OPTION"));
  struct DropRoles {
    testing::TestDatabase& db;
    std::vector<std::string> roles;
    ~DropRoles() {
      for (const std::string& r : roles) {
        db.Exec(absl::StrCat("DROP OWNED BY ", r, "; DROP ROLE ", r));
      }
    }
  } drop{db_, {writes, reads}};
  const auto url_of = [&](const std::string& role) {
    std::string url = db_.url();
    url.replace(url.find("postgres@"), 9, role + "@");
    return url;
  };
  const auto append_as_writer = [&]() -> absl::StatusOr<int64_t> {
    try {
      pqxx::connection c(url_of(writes));
      pqxx::work tx(c);
      absl::StatusOr<Appended> a = Writer().Append(tx, EventOf("g"));
      if (!a.ok()) return a.status();
      tx.commit();
      return a->seq;
    } catch (const std::exception& e) {
      return StatusFromException(e);
    }
  };
  const auto privilege = [&](const std::string& role, const std::string& what) {
    return db_.Scalar(absl::StrCat("SELECT has_table_privilege('", role,
                                   "', 'outbox', '", what, "')::int"));
  };
  absl::StatusOr<int64_t> before = append_as_writer();
  ASSERT_TRUE(before.ok()) << before.status();
  Partition(10, 2);
  absl::StatusOr<int64_t> after = append_as_writer();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GT(*after, *before);
  {
    pqxx::connection c(url_of(reads));
    pqxx::work tx(c);
    EXPECT_EQ(tx.exec1("SELECT count(event_id) FROM outbox")[0].as<int>(), 2);
  }
  EXPECT_EQ(db_.Scalar(absl::StrCat(
                "SELECT has_column_privilege('", reads,
                "', 'outbox', 'event_id', 'SELECT WITH GRANT OPTION')::int")),
            1);
  EXPECT_EQ(db_.Scalar(absl::StrCat("SELECT has_column_privilege('", reads,
                                    "', 'outbox', 'payload', 'SELECT')::int")),
            0);
  EXPECT_EQ(privilege(reads, "INSERT"), 0);
  EXPECT_EQ(privilege(writes, "INSERT"), 1);
  EXPECT_EQ(privilege(writes, "DELETE"), 0);
  EXPECT_EQ(privilege(writes, "SELECT WITH GRANT OPTION"), 0);
  // What version 16 runs on an outbox partitioned without them.
  db_.Exec(absl::StrCat("REVOKE ALL ON outbox FROM ", writes,
                        "; REVOKE ALL ON SEQUENCE outbox_seq_seq FROM ",
                        writes));
  EXPECT_FALSE(append_as_writer().ok());
  EXPECT_GE(db_.Scalar("SELECT outbox_partition_grants(to_regclass("
                       "'outbox_s0'))"),
            4);
  absl::StatusOr<int64_t> again = append_as_writer();
  EXPECT_TRUE(again.ok()) << again.status();
}

// What the writers draw next.
int64_t NextSeq(testing::TestDatabase& db) {
  return db.Scalar(
      "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END "
      "FROM outbox_seq_seq");
}

// The server's messages to a connection (notices, and debug ones when its
// client_min_messages asks for them).
class Notices : public pqxx::errorhandler {
 public:
  explicit Notices(pqxx::connection_base& c) : pqxx::errorhandler(c) {}
  bool operator()(const char msg[]) noexcept override {
    seen.emplace_back(msg);
    return true;
  }
  std::vector<std::string> seen;
};

// With a bound prepared and validated (a scan that holds up no writer),
// the conversion does not scan the old table under its exclusive lock:
// the old table holds the seqs below the bound, new ones too, and no
// constraint of it is left behind.
TEST_F(RotationTest, APreparedBoundSparesTheScanUnderTheLock) {
  for (int i = 0; i < 3; ++i) AppendCommitted(absl::StrCat("a", i));
  const int64_t next = NextSeq(db_);
  const int64_t bound = db_.Scalar("SELECT outbox_partition_prepare(1000)");
  EXPECT_EQ(bound, next + 1000);
  // Prepared again: the same bound while it has room.
  EXPECT_EQ(db_.Scalar("SELECT outbox_partition_prepare(1000)"), bound);
  const int64_t during = AppendCommitted("b");
  db_.Exec("ALTER TABLE outbox VALIDATE CONSTRAINT outbox_s0_bound");
  Notices notices(conn_);
  std::string said;
  {
    pqxx::work tx(conn_);
    tx.exec("SET LOCAL client_min_messages = debug1");
    said =
        tx.exec1("SELECT outbox_partition_outbox(10, 2)")[0].as<std::string>();
    tx.commit();
  }
  EXPECT_TRUE(absl::StrContains(
      said, absl::StrCat("seqs below ", bound,
                         " in outbox_s0 (its bound checked before")))
      << said;
  bool implied = false;
  for (const std::string& n : notices.seen) {
    implied |= absl::StrContains(n,
                                 "partition constraint for table \"outbox_s0\" "
                                 "is implied by existing constraints");
  }
  EXPECT_TRUE(implied) << "ATTACH scanned the old table";
  // The old table takes the seqs up to the bound: no child yet.
  const std::string first =
      absl::StrCat("outbox_s0 FOR VALUES FROM (MINVALUE) TO ('", bound, "')");
  EXPECT_EQ(Children(), std::vector<std::string>{first});
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM pg_constraint WHERE conname = "
                       "'outbox_s0_bound'"),
            0);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_partition_bound"), 0);
  const int64_t after = AppendCommitted("c");
  EXPECT_GT(after, during);
  EXPECT_LT(after, bound);
  EXPECT_EQ(db_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox_s0 WHERE seq = ", after)),
            1);
  // Children begin at the bound, once the writers near it.
  db_.Exec(absl::StrCat("SELECT setval('outbox_seq_seq', ", bound - 15, ")"));
  db_.Exec("SELECT outbox_extend_partitions()");
  EXPECT_EQ(Children(),
            (std::vector<std::string>{
                first, absl::StrCat("outbox_s", bound, " FOR VALUES FROM ('",
                                    bound, "') TO ('", bound + 10, "')")}));
}

// A bound prepared and never used (the command was stopped between its
// steps) goes once the writers draw past half its margin, long before an
// insert could meet it; one prepared and not validated is not used, and
// goes with the conversion.
TEST_F(RotationTest, AnUnusedBoundGoesBeforeAWriterCouldMeetIt) {
  AppendCommitted("a");
  const int64_t bound = db_.Scalar("SELECT outbox_partition_prepare(1000)");
  const auto constraints = [&] {
    return db_.Scalar(
        "SELECT count(*) FROM pg_constraint WHERE conname = "
        "'outbox_s0_bound'");
  };
  // What `outboxctl partition-outbox` builds next (concurrently).
  db_.Exec("CREATE INDEX outbox_s0_event_id_idx ON outbox (event_id)");
  const auto index = [&] {
    return db_.Scalar(
        "SELECT count(*) FROM pg_class WHERE relname = "
        "'outbox_s0_event_id_idx'");
  };
  db_.Exec("SELECT outbox_extend_partitions()");
  EXPECT_EQ(constraints(), 1);  // room left: it stays
  EXPECT_EQ(index(), 1);
  db_.Exec(absl::StrCat("SELECT setval('outbox_seq_seq', ", bound - 500, ")"));
  db_.Exec("SELECT outbox_extend_partitions()");
  EXPECT_EQ(constraints(), 0);
  EXPECT_EQ(index(), 0);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_partition_bound"), 0);
  db_.Exec(absl::StrCat("SELECT setval('outbox_seq_seq', ", bound + 5, ")"));
  EXPECT_GT(AppendCommitted("past"), bound);

  const int64_t again = db_.Scalar("SELECT outbox_partition_prepare(1000)");
  EXPECT_GT(again, bound);
  const int64_t next = NextSeq(db_);
  const std::string said = Partition(10, 1);
  EXPECT_TRUE(absl::StrContains(
      said, absl::StrCat("seqs below ", next, " in outbox_s0")))
      << said;
  EXPECT_EQ(constraints(), 0);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_partition_bound"), 0);
}

// A child goes whole: not while the writers may still draw a seq in it,
// nor while any event in it is younger than the retention; then at once,
// dropped, with what retention records as deleted. New children are made
// ahead as the sequence moves on.
TEST_F(RotationTest, AChildGoesWholeOnceEveryEventInItMay) {
  Partition(10, 2);  // [1, 11), [11, 21): an empty outbox keeps no child below
  for (int i = 0; i < 15; ++i) AppendCommitted(absl::StrCat("a", i));
  EXPECT_EQ(Rotate(absl::Hours(1)), 0);  // all too young
  EXPECT_EQ(Seqs().size(), 15u);
  EXPECT_EQ(Rotate(), 10);
  EXPECT_EQ(*Seqs().begin(), 11);
  EXPECT_EQ(DeletedThrough(), 10);
  // The full child is dropped.
  EXPECT_EQ(Children(), (std::vector<std::string>{
                            "outbox_s11 FOR VALUES FROM ('11') TO ('21')"}));
  // [11, 21) is not full: a writer may still draw a seq in it.
  EXPECT_EQ(Rotate(), 0);
  EXPECT_EQ(Seqs().size(), 5u);
  // Children ahead: 15 drawn, two spans beyond.
  EXPECT_EQ(db_.Scalar("SELECT outbox_extend_partitions()"), 25);
  EXPECT_EQ(Children().size(), 3u);
  for (int i = 0; i < 5; ++i) AppendCommitted(absl::StrCat("b", i));
  EXPECT_EQ(Rotate(), 10);
  EXPECT_EQ(DeletedThrough(), 20);
  EXPECT_TRUE(Seqs().empty());
}

// A transaction that drew a seq in the child and has not committed holds
// the whole child, however old the rest: its event may still commit.
TEST_F(RotationTest, ATransactionThatMayStillCommitHoldsItsChild) {
  Partition(10, 2);
  pqxx::connection late_conn(db_.url());
  pqxx::work late(late_conn);
  const int64_t late_seq = Append(late, "late");
  EXPECT_EQ(late_seq, 1);
  for (int i = 0; i < 12; ++i) AppendCommitted(absl::StrCat("a", i));
  EXPECT_EQ(Rotate(), 0);
  EXPECT_EQ(Rotate(), 0);
  late.commit();
  EXPECT_EQ(Rotate(), 10);
  EXPECT_EQ(*Seqs().begin(), 11);
}

// An event a subscription has not been given (its delivery row) holds its
// child; once answered, the child goes.
TEST_F(RotationTest, AnUndeliveredEventHoldsItsChild) {
  Partition(10, 2);
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  for (int i = 0; i < 12; ++i) AppendCommitted(absl::StrCat("a", i));
  db_.Exec("DELETE FROM outbox_delivery WHERE seq <> 7");
  EXPECT_EQ(Rotate(), 0);
  EXPECT_EQ(Seqs().size(), 12u);
  db_.Exec("DELETE FROM outbox_delivery WHERE seq = 7");
  EXPECT_EQ(Rotate(), 10);
}

// A read of the outbox in progress holds the child (its rows stay readable
// to it): rotation waits a moment, says what held it, changes nothing, and
// drops the child at a later step once the read has ended.
TEST_F(RotationTest, ARotationDuringAReadWaitsForIt) {
  Partition(10, 2);
  for (int i = 0; i < 12; ++i) AppendCommitted(absl::StrCat("a", i));
  pqxx::connection reader_conn(db_.url());
  {
    pqxx::work reader(reader_conn, "reader");
    reader.exec("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ");
    EXPECT_EQ(reader.exec1("SELECT count(*) FROM outbox")[0].as<int64_t>(), 12);
    std::string held_back;
    const absl::Time t0 = absl::Now();
    EXPECT_EQ(Rotate(absl::ZeroDuration(), &held_back), 0);
    EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
    EXPECT_TRUE(absl::StrContains(held_back, "reads or writes of the outbox"))
        << held_back;
    EXPECT_EQ(DeletedThrough(), 0);
    // The read goes on seeing what it saw.
    EXPECT_EQ(reader.exec1("SELECT count(*) FROM outbox")[0].as<int64_t>(), 12);
    reader.commit();
  }
  EXPECT_EQ(Rotate(), 10);
  EXPECT_EQ(DeletedThrough(), 10);
}

// A replay whose range spans a dropped child owes again the events that
// are retained, and matches nothing below them.
TEST_F(RotationTest, AReplayAcrossARotationOwesWhatIsRetained) {
  Partition(10, 2);
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  for (int i = 0; i < 15; ++i) AppendCommitted(absl::StrCat("a", i));
  db_.Exec("DELETE FROM outbox_delivery");  // all delivered
  EXPECT_EQ(Rotate(), 10);
  pqxx::work tx(conn_);
  ReplaySelector sel;
  sel.by_seq = true;
  sel.from_seq = 1;
  sel.to_seq = 15;
  const Replayed r = Replay(tx, "billing", sel);
  tx.commit();
  EXPECT_EQ(r.matched, 5);
  EXPECT_EQ(r.owed, 5);
  EXPECT_EQ(db_.Scalar("SELECT min(seq) FROM outbox_delivery"), 11);
}

// event_id is unique per child only in PostgreSQL; the writer keeps an id
// a caller gives unique across all of them, and refuses one in a snapshot
// that could miss another writer's.
TEST_F(RotationTest, AGivenIdIsRefusedInAnotherChild) {
  Partition(10, 2);
  Writer writer;
  const std::string id = "0190f3a4-1111-7000-8000-000000000001";
  {
    pqxx::work tx(conn_);
    ASSERT_TRUE(writer.Append(tx, EventOf("a", id)).ok());
    tx.commit();
  }
  for (int i = 0; i < 12; ++i) AppendCommitted(absl::StrCat("b", i));
  {
    pqxx::work tx(conn_);
    EXPECT_THROW((void)writer.Append(tx, EventOf("c", id)),
                 pqxx::unique_violation);
  }
  {
    pqxx::work tx(conn_);
    tx.exec("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ");
    try {
      (void)writer.Append(tx,
                          EventOf("c", "0190f3a4-1111-7000-8000-000000000002"));
      ADD_FAILURE() << "a given id in REPEATABLE READ was taken";
    } catch (const pqxx::sql_error& e) {
      EXPECT_EQ(e.sqlstate(), "0A000");
      EXPECT_TRUE(absl::StrContains(e.what(), "READ COMMITTED")) << e.what();
    }
  }
  // Ids the writer makes need no check, in any isolation.
  pqxx::work tx(conn_);
  tx.exec("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ");
  EXPECT_TRUE(writer.Append(tx, EventOf("c")).ok());
  tx.commit();
  EXPECT_EQ(db_.Scalar(absl::StrCat(
                "SELECT count(*) FROM outbox WHERE event_id = '", id, "'")),
            1);
}

// With no child made for the next seq (no relay made them ahead), the
// append fails as the world's fault: retried later, never blamed on the
// event. Once a child is made, it succeeds.
TEST_F(RotationTest, AnInsertPastTheLastChildIsTheWorldsFault) {
  Partition(10, 1);  // [1, 11) only
  EXPECT_EQ(db_.Scalar("SELECT outbox_extend_partitions()"), 10);
  for (int i = 0; i < 10; ++i) AppendCommitted(absl::StrCat("a", i));
  try {
    AppendCommitted("over");
    ADD_FAILURE() << "an event past the last child was written";
  } catch (const std::exception& e) {
    const absl::Status s = StatusFromException(e);
    EXPECT_TRUE(absl::IsUnavailable(s)) << s;
    EXPECT_EQ(OriginOf(s), ErrorOrigin::kWorld) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "outbox_partition_seqs_left"))
        << s;
  }
  // Three more fail; the seqs they drew are gone.
  for (int i = 0; i < 3; ++i) {
    EXPECT_THROW(AppendCommitted("over"), pqxx::sql_error);
  }
  // The next child takes the seqs the failures drew in (not a child of
  // them, empty), and keeps a span beyond the sequence.
  EXPECT_EQ(db_.Scalar("SELECT outbox_extend_partitions()"), 10);
  EXPECT_EQ(Children().back(), "outbox_s11 FOR VALUES FROM ('11') TO ('25')");
  EXPECT_EQ(AppendCommitted("over"), 15);
}

// With span_time, each child made spans what the writers drew in that
// long at the rate seen since the one before: never less than the span
// given, never more than 100 times it.
TEST_F(RotationTest, ChildrenAreSizedByTheRateWithinBounds) {
  db_.Exec("SELECT outbox_partition_outbox(10, 1, interval '10 seconds')");
  EXPECT_EQ(
      Children(),
      (std::vector<std::string>{"outbox_s1 FOR VALUES FROM ('1') TO ('11')"}));
  // `n` more events, then the rate as if the writers had drawn `seqs` in
  // the last `seconds`: the seqs left after the children made, and the
  // span chosen.
  int appended = 0;
  const auto extend_at = [&](int n, int64_t seqs, int seconds) {
    for (int i = 0; i < n; ++i) AppendCommitted(absl::StrCat("a", appended++));
    db_.Exec(absl::StrCat(
        "UPDATE outbox_rotation SET made_at = now() - make_interval(secs => ",
        seconds, "), drawn_then = (SELECT last_value FROM outbox_seq_seq) - ",
        seqs));
    const int64_t left = db_.Scalar("SELECT outbox_extend_partitions()");
    return std::make_pair(left, db_.Scalar("SELECT span FROM outbox_rotation"));
  };
  using Made = std::pair<int64_t, int64_t>;
  // 5 seqs in 5 s: 10 s of them is 10, the least.
  EXPECT_EQ(extend_at(5, 5, 5), Made(15, 10));
  // A child is made once less than `ahead` spans are left (9 after 6
  // more); 40 seqs in 2 s: 10 s of them is 200.
  EXPECT_EQ(extend_at(6, 40, 2), Made(209, 200));
  EXPECT_EQ(Children().back(), "outbox_s21 FOR VALUES FROM ('21') TO ('221')");
  // 100,000 seqs in a second: 100 times the least, no more.
  EXPECT_EQ(extend_at(10, 100000, 1), Made(1199, 1000));
  // A span_time of 0 or less is refused.
  EXPECT_THROW(
      db_.Exec("SELECT outbox_partition_outbox(10, 1, interval '-1 s')"),
      std::exception);
}

// A child that holds no event (its seqs drawn by inserts that failed or
// rolled back) is dropped once its bound is passed, and the step says so:
// the relay then takes the next step at once instead of waiting its
// interval.
TEST_F(RotationTest, AnEmptyChildIsDroppedAndTheStepSaysSo) {
  Partition(10, 2);  // [1, 11), [11, 21)
  {
    pqxx::work tx(conn_);
    for (int i = 0; i < 12; ++i) Append(tx, absl::StrCat("a", i));
    // rolled back
  }
  AppendCommitted("b");  // 13
  absl::SleepFor(absl::Milliseconds(55));
  bool dropped = false;
  {
    pqxx::work tx(conn_);
    EXPECT_EQ(PruneOutbox(tx, absl::ZeroDuration(), 1000, nullptr, &dropped),
              0);
    tx.commit();
  }
  EXPECT_TRUE(dropped);
  EXPECT_EQ(Children(), (std::vector<std::string>{
                            "outbox_s11 FOR VALUES FROM ('11') TO ('21')"}));
  EXPECT_EQ(DeletedThrough(), 10);
  // [11, 21) is not full yet: nothing goes, and the step says so.
  absl::SleepFor(absl::Milliseconds(55));
  {
    pqxx::work tx(conn_);
    EXPECT_EQ(PruneOutbox(tx, absl::ZeroDuration(), 1000, nullptr, &dropped),
              0);
    EXPECT_FALSE(dropped);
  }
  EXPECT_EQ(Seqs(), (std::set<int64_t>{13}));
}

}  // namespace
}  // namespace outbox::relay
