// outbox::Writer against a real PostgreSQL: chains per aggregate, under
// concurrent appenders, rollbacks and many events per statement.

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "common/ids.h"
#include "common/limits.h"
#include "common/schema.h"
#include "google/protobuf/wrappers.pb.h"
#include "outbox/v1/event.pb.h"
#include "tests/testing/pg.h"
#include "writer/writer.h"

namespace outbox {
namespace {

NewEvent Note(const std::string& type, const std::string& id,
              const std::string& text) {
  google::protobuf::StringValue v;
  v.set_value(text);
  return NewEvent::Of(type, id, v);
}

class WriterTest : public ::testing::Test {
 protected:
  WriterTest() : tdb_("writer", {OutboxSchema()}) {}

  // seq -> prev_seq of `id`'s events, from the outbox table.
  std::map<int64_t, int64_t> Chain(const std::string& type,
                                   const std::string& id) {
    std::map<int64_t, int64_t> chain;
    for (const auto& row : tdb_.Query(
             "SELECT seq, prev_seq FROM outbox WHERE aggregate_type = '" +
             type + "' AND aggregate_id = '" + id + "'")) {
      chain[row[0].as<int64_t>()] = row[1].as<int64_t>();
    }
    return chain;
  }

  // Every event of the chain points at the one before it, in seq order.
  static void ExpectOneChain(const std::map<int64_t, int64_t>& chain) {
    int64_t prev = 0;
    for (const auto& [seq, prev_seq] : chain) {
      EXPECT_EQ(prev_seq, prev) << "event " << seq;
      prev = seq;
    }
  }

  testing::TestDatabase tdb_;
};

TEST_F(WriterTest, AppendsChainAndStoresTheEnvelope) {
  Writer writer;
  pqxx::connection c(tdb_.url());
  Appended first, second;
  {
    pqxx::work tx(c);
    NewEvent e = Note("account", "a-1", "opened");
    e.trace_parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    e.schema_version = 2;
    auto a = writer.Append(tx, e);
    ASSERT_TRUE(a.ok()) << a.status();
    first = *a;
    tx.commit();
  }
  {
    pqxx::work tx(c);
    auto a = writer.Append(tx, Note("account", "a-1", "closed"));
    ASSERT_TRUE(a.ok()) << a.status();
    second = *a;
    tx.commit();
  }
  EXPECT_EQ(first.prev_seq, 0);
  EXPECT_EQ(second.prev_seq, first.seq);
  EXPECT_GT(second.seq, first.seq);
  pqxx::result r = tdb_.Query(
      "SELECT event_id::text, aggregate_type, event_type, schema_version, "
      "trace_parent, partition, payload FROM outbox WHERE seq = " +
      std::to_string(first.seq));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0][0].as<std::string>(), first.event_id);
  EXPECT_EQ(r[0][1].as<std::string>(), "account");
  EXPECT_EQ(r[0][2].as<std::string>(), "StringValue");
  EXPECT_EQ(r[0][3].as<int>(), 2);
  EXPECT_EQ(r[0][4].as<std::string>(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
  EXPECT_EQ(r[0][5].as<int>(), PartitionOf("a-1"));
  v1::Event stored;
  ASSERT_TRUE(stored.ParseFromString(pqxx::binarystring(r[0][6]).str()));
  EXPECT_EQ(stored.event_id(), first.event_id);
  google::protobuf::StringValue payload;
  ASSERT_TRUE(stored.payload().UnpackTo(&payload));
  EXPECT_EQ(payload.value(), "opened");
  EXPECT_TRUE(stored.has_occurred_at());
}

TEST_F(WriterTest, RolledBackAppendLeavesTheChainAsItWas) {
  Writer writer;
  pqxx::connection c(tdb_.url());
  int64_t kept;
  {
    pqxx::work tx(c);
    kept = writer.Append(tx, Note("t", "x", "1"))->seq;
    tx.commit();
  }
  {
    pqxx::work tx(c);
    ASSERT_TRUE(writer.Append(tx, Note("t", "x", "lost")).ok());
    tx.abort();
  }
  pqxx::work tx(c);
  auto a = writer.Append(tx, Note("t", "x", "2"));
  tx.commit();
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->prev_seq, kept);
  ExpectOneChain(Chain("t", "x"));
}

TEST_F(WriterTest, AggregateTypesChainApart) {
  Writer writer;
  pqxx::connection c(tdb_.url());
  pqxx::work tx(c);
  auto a = writer.Append(tx, Note("order", "same-id", "a"));
  auto b = writer.Append(tx, Note("invoice", "same-id", "b"));
  tx.commit();
  EXPECT_EQ(a->prev_seq, 0);
  EXPECT_EQ(b->prev_seq, 0);
}

TEST_F(WriterTest, AppendManyChainsRepeatedAggregatesInInputOrder) {
  Writer writer;
  pqxx::connection c(tdb_.url());
  pqxx::work tx(c);
  std::vector<NewEvent> events = {Note("t", "a", "a1"), Note("t", "b", "b1"),
                                  Note("t", "a", "a2"), Note("t", "a", "a3"),
                                  Note("t", "c", "c1"), Note("t", "b", "b2")};
  auto out = writer.AppendMany(tx, events);
  ASSERT_TRUE(out.ok()) << out.status();
  tx.commit();
  ASSERT_EQ(out->size(), events.size());
  EXPECT_EQ((*out)[0].prev_seq, 0);
  EXPECT_EQ((*out)[2].prev_seq, (*out)[0].seq);
  EXPECT_EQ((*out)[3].prev_seq, (*out)[2].seq);
  EXPECT_EQ((*out)[5].prev_seq, (*out)[1].seq);
  EXPECT_EQ((*out)[4].prev_seq, 0);
  for (const char* id : {"a", "b", "c"}) ExpectOneChain(Chain("t", id));
  // Payloads landed on their own rows.
  pqxx::result r = tdb_.Query("SELECT payload FROM outbox WHERE seq = " +
                              std::to_string((*out)[3].seq));
  v1::Event stored;
  ASSERT_TRUE(stored.ParseFromString(pqxx::binarystring(r[0][0]).str()));
  google::protobuf::StringValue v;
  ASSERT_TRUE(stored.payload().UnpackTo(&v));
  EXPECT_EQ(v.value(), "a3");
}

TEST_F(WriterTest, RefusesBadEventsNamingTheFieldAndWritesNothing) {
  Writer writer;
  pqxx::connection c(tdb_.url());
  pqxx::work tx(c);
  NewEvent no_id = Note("t", "", "x");
  EXPECT_EQ(writer.Append(tx, no_id).status().message(),
            "aggregate_id: must be 1-128 bytes");
  NewEvent bad_uuid = Note("t", "a", "x");
  bad_uuid.event_id = "not-a-uuid";
  EXPECT_TRUE(absl::StrContains(writer.Append(tx, bad_uuid).status().message(),
                                "event_id"));
  NewEvent bad_trace = Note("t", "a", "x");
  bad_trace.trace_parent = "00-zz";
  EXPECT_TRUE(absl::StrContains(writer.Append(tx, bad_trace).status().message(),
                                "trace_parent"));
  NewEvent huge = Note("t", "a", std::string(kMaxEventBytes, 'x'));
  EXPECT_TRUE(
      absl::StrContains(writer.Append(tx, huge).status().message(), "payload"));
  auto many = writer.AppendMany(tx, {Note("t", "a", "ok"), no_id});
  EXPECT_TRUE(absl::StrContains(many.status().message(), "events[1]."));
  tx.commit();
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM outbox"), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM outbox_heads"), 0);
}

TEST_F(WriterTest, AReusedEventIdIsRefusedAndMovesNoChain) {
  // The inbox drops an event whose id it holds as a duplicate, so the
  // outbox must never hold two events with one id: the second append
  // fails as its statement does (unique_violation, SQLSTATE 23505) and
  // leaves the other aggregate's chain as it was.
  Writer writer;
  pqxx::connection c(tdb_.url());
  NewEvent first = Note("account", "a-1", "opened");
  first.event_id = "0190b2a4-3c1e-7d2f-8a4b-5c6d7e8f9a0b";
  {
    pqxx::work tx(c);
    ASSERT_TRUE(writer.Append(tx, first).ok());
    tx.commit();
  }
  NewEvent again = Note("account", "a-2", "opened");
  again.event_id = first.event_id;
  {
    pqxx::work tx(c);
    EXPECT_THROW((void)writer.Append(tx, again), pqxx::unique_violation);
  }
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM outbox"), 1);
  EXPECT_TRUE(Chain("account", "a-2").empty());
  // The aggregate's first event is still its first.
  pqxx::work tx(c);
  auto a = writer.Append(tx, Note("account", "a-2", "opened"));
  ASSERT_TRUE(a.ok()) << a.status();
  tx.commit();
  EXPECT_EQ(a->prev_seq, 0);
}

TEST_F(WriterTest, RowsFeedAStatementOfTheCallersOwn) {
  // A caller's statement that writes its rows and, through the writer's
  // CTEs, their events: one round trip, one chain per aggregate.
  tdb_.Exec("CREATE TABLE notes (id text PRIMARY KEY)");
  constexpr char kSql[] =
      "WITH n AS (INSERT INTO notes SELECT * FROM unnest($1::text[]) "
      "ON CONFLICT DO NOTHING RETURNING id), "
      "input AS (SELECT * FROM unnest($2::text[], $3::text[], $4::uuid[], "
      "$5::text[], $6::int[], $7::text[], $8::text[], $9::int[]) AS "
      "t(aggregate_type, aggregate_id, event_id, event_type, schema_version, "
      "payload, trace_parent, partition) "
      "WHERE aggregate_id IN (SELECT id FROM n)), " OUTBOX_WRITER_APPEND_CTES
      " SELECT aggregate_id, last_seq, prev_seq FROM h ORDER BY 1";
  auto write = [&](const std::vector<std::string>& ids) {
    std::vector<NewEvent> events;
    for (const std::string& id : ids) events.push_back(Note("note", id, id));
    absl::StatusOr<EventRows> rows = Writer::Rows(events);
    EXPECT_TRUE(rows.ok()) << rows.status();
    EXPECT_EQ(rows->event_ids.size(), ids.size());
    pqxx::connection c(tdb_.url());
    pqxx::nontransaction tx(c);
    return ExecPrepared(tx, "notes", kSql, ArrayLiteral(ids).str(),
                        rows->aggregate_type, rows->aggregate_id,
                        rows->event_id, rows->event_type, rows->schema_version,
                        rows->payload, rows->trace_parent, rows->partition);
  };
  pqxx::result first = write({"a", "b"});
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0][2].as<int64_t>(), 0);
  // "a" exists: only "c" is written, with its event.
  pqxx::result second = write({"a", "c"});
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0][0].as<std::string>(), "c");
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM outbox"), 3);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM outbox WHERE aggregate_id = "
                        "'c' AND prev_seq = 0"),
            1);

  // Rows refuses an aggregate twice (its head moves once per statement)
  // and bad events, naming the event.
  auto twice = Writer::Rows({Note("note", "d", "1"), Note("note", "d", "2")});
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      absl::StrContains(twice.status().message(), "events[1].aggregate_id"))
      << twice.status();
  auto bad = Writer::Rows({Note("note", "e", "1"), Note("note", "", "2")});
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "events[1]."))
      << bad.status();
}

TEST_F(WriterTest, FansOutToEverySubscription) {
  tdb_.Exec("INSERT INTO subscriptions (name) VALUES ('billing'), ('audit')");
  Writer writer;
  pqxx::connection c(tdb_.url());
  pqxx::work tx(c);
  auto a = writer.Append(tx, Note("t", "a", "x"));
  tx.commit();
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM outbox_delivery WHERE seq = " +
                        std::to_string(a->seq)),
            2);
}

// Many transactions append to one aggregate at once, each committing or
// rolling back at random: the committed events form a single chain (each
// event's prev_seq is the committed event before it, seq grows along it).
TEST_F(WriterTest, ConcurrentAppendersOnOneAggregateFormOneChain) {
  constexpr int kThreads = 8;
  constexpr int kEach = 40;
  Writer writer;
  std::atomic<int> committed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      pqxx::connection c(tdb_.url());
      for (int i = 0; i < kEach; ++i) {
        for (;;) {
          try {
            pqxx::work tx(c);
            // Some transactions append twice, some roll back.
            ASSERT_TRUE(writer.Append(tx, Note("t", "hot", "x")).ok());
            if (i % 5 == 0) {
              ASSERT_TRUE(writer.Append(tx, Note("t", "hot", "y")).ok());
            }
            if ((t + i) % 7 == 0) {
              tx.abort();
            } else {
              tx.commit();
              committed += i % 5 == 0 ? 2 : 1;
            }
            break;
          } catch (const pqxx::sql_error& e) {
            ADD_FAILURE() << e.what();  // a lock wait never fails here
            return;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  std::map<int64_t, int64_t> chain = Chain("t", "hot");
  EXPECT_EQ(static_cast<int>(chain.size()), committed.load());
  ExpectOneChain(chain);
  EXPECT_EQ(tdb_.Scalar("SELECT last_seq FROM outbox_heads WHERE "
                        "aggregate_id = 'hot'"),
            chain.rbegin()->first);
}

}  // namespace
}  // namespace outbox
