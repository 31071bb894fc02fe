// The inbox engine against a real PostgreSQL, with a handler that records
// each event it applies (its effect, one ledger row), through real gRPC on
// loopback where the stream matters: dedup, chain order and held events,
// the one-call write, inbox retention, replicas racing, identity (reused
// ids and positions, forks, chains by source and type), and the database
// misbehaving (gray failures), each costing time and never an event.
// Tests of a domain's handler on the engine (billing's effects, its query
// service) are in consumer/consumer_pgtest.cc.

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/schema.h"
#include "common/server.h"
#include "common/watchdog.h"
#include "inbox/engine.h"
#include "inbox/handler.h"
#include "inbox/retention.h"
#include "inbox/sink_service.h"
#include "tests/testing/grpc.h"
#include "tests/testing/inbox.h"
#include "tests/testing/pg.h"

namespace outbox::inbox {
namespace {

// Records every event it is given, one ledger row each, in the batch's
// transaction: a count of its rows is a count of effects, so a lost or
// doubled effect shows. Tests make it fail by constraints on its table.
class LedgerHandler final : public Handler {
 public:
  std::string name() const override { return "ledger"; }
  const std::vector<Migration>& migrations() const override {
    static const std::vector<Migration> kMigrations = {
        {1, "the ledger of applied events", R"sql(
CREATE TABLE ledger (
  event_id       uuid PRIMARY KEY,
  aggregate_type text NOT NULL,
  aggregate_id   text NOT NULL,
  seq            bigint NOT NULL,
  event_type     text NOT NULL
);
)sql"}};
    return kMigrations;
  }
  absl::Status Validate(const v1::Event&) const override {
    return absl::OkStatus();
  }
  std::vector<Rejection> Apply(
      pqxx::work& tx, const std::vector<const v1::Event*>& events) override {
    ArrayLiteral id, type, agg, seq, event_type;
    for (const v1::Event* e : events) {
      id.Add(e->event_id());
      type.Add(e->aggregate_type());
      agg.Add(e->aggregate_id());
      seq.Add(e->seq());
      event_type.Add(e->event_type());
    }
    ExecPrepared(tx, "insert_ledger",
                 "INSERT INTO ledger SELECT * FROM unnest($1::uuid[], "
                 "$2::text[], $3::text[], $4::bigint[], $5::text[])",
                 id.str(), type.str(), agg.str(), seq.str(), event_type.str());
    return {};
  }
};

LedgerHandler* Ledger() {
  static LedgerHandler handler;
  return &handler;
}

// The engine's tables, then the ledger.
std::vector<Schema> LedgerSchemas() {
  return {InboxSchema(), {"ledger", &Ledger()->migrations()}};
}

// The three events of one order, seqs first_seq, + step, + 2 * step; no
// payload (the ledger takes any).
std::vector<v1::Event> Chain(int64_t first_seq, int64_t step = 1) {
  const std::string id = NewUuid();
  std::vector<v1::Event> chain(3);
  const char* types[] = {"OrderCreated", "OrderPaid", "OrderCancelled"};
  for (int i = 0; i < 3; ++i) {
    v1::Event& e = chain[i];
    e.set_event_id(NewUuid());
    e.set_aggregate_type("order");
    e.set_aggregate_id(id);
    e.set_seq(first_seq + i * step);
    e.set_prev_seq(i == 0 ? 0 : first_seq + (i - 1) * step);
    e.set_event_type(types[i]);
    e.set_schema_version(1);
    ToTimestamp(absl::Now(), e.mutable_occurred_at());
  }
  return chain;
}

std::vector<v1::DeliveryOutcome> Outcomes(
    const std::vector<v1::EventResult>& results) {
  std::vector<v1::DeliveryOutcome> out;
  for (const auto& r : results) out.push_back(r.outcome());
  return out;
}

class EngineTest : public ::testing::Test {
 protected:
  EngineTest()
      : tdb_("engine", LedgerSchemas()),
        db_(tdb_.url(), 4, "engine-test"),
        applier_(&db_, Ledger(), &metrics_),
        sink_(&applier_) {
    auto server = GrpcServer::Start(
        {"127.0.0.1:0", absl::Seconds(2), nullptr, kMaxDeliverMessageBytes},
        {{&sink_, v1::EventSink::service_full_name()}});
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = testing::Loopback(server_->port());
  }

  // Sends `batches` over one Deliver stream; returns the outcomes in order.
  std::vector<v1::EventResult> Deliver(
      const std::vector<std::vector<v1::Event>>& batches,
      grpc::Status* status = nullptr) {
    return testing::DeliverBatches(channel_, batches, status);
  }

  // Every aggregate's inbox rows are in seq order by apply_id, and each
  // applied seq is the chain's next.
  void ExpectAppliedInOrder() { EXPECT_EQ(testing::InboxOutOfOrder(tdb_), 0); }

  testing::TestDatabase tdb_;
  Database db_;
  Metrics metrics_;
  Engine applier_;
  EventSinkImpl sink_;
  std::unique_ptr<GrpcServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

using V = std::vector<v1::DeliveryOutcome>;

TEST_F(EngineTest, DuplicatesAreAnsweredAndHaveNoSecondEffect) {
  auto chain = Chain(1);
  Deliver({chain});
  auto again = Deliver({chain, {chain[1]}});
  EXPECT_EQ(Outcomes(again),
            (V{v1::DUPLICATE, v1::DUPLICATE, v1::DUPLICATE, v1::DUPLICATE}));
  // Also inside one batch.
  auto other = Chain(10);
  auto twice = Deliver({{other[0], other[0], other[1], other[1]}});
  EXPECT_EQ(Outcomes(twice),
            (V{v1::APPLIED, v1::DUPLICATE, v1::APPLIED, v1::DUPLICATE}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 5);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger"), 5);
}

// The common batch (each event next in its chain, nothing held) is written
// by the statement that locks its chains; any other goes the planned way,
// with the same answers. An id the inbox holds elsewhere makes the
// one-call write take its rows back: nothing of it stays.
TEST_F(EngineTest, TheCommonBatchIsWrittenInOneCallAndOthersArePlanned) {
  auto written = [&](const char* how) {
    return metrics_
        .AddCounter(absl::StrCat("outbox_consumer_batches_total{write=\"", how,
                                 "\"}"),
                    "")
        ->value();
  };
  auto a = Chain(1), b = Chain(1);
  EXPECT_EQ(Outcomes(Deliver({{a[0], b[0], a[1], a[2], b[1]}})),
            (V{v1::APPLIED, v1::APPLIED, v1::APPLIED, v1::APPLIED,
               v1::APPLIED}));
  EXPECT_EQ(written("foreseen"), 1);
  EXPECT_EQ(written("planned"), 0);
  // Next in its chain with a cursor already there: foreseen too.
  EXPECT_EQ(Outcomes(Deliver({{b[2]}})), (V{v1::APPLIED}));
  EXPECT_EQ(written("foreseen"), 2);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 6);
  EXPECT_EQ(tdb_.Scalar("SELECT sum(last_seq) FROM aggregate_cursors"), 6);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger"), 6);

  // Redelivered, early, or out of order: planned, with the usual answers.
  auto c = Chain(1);
  EXPECT_EQ(Outcomes(Deliver({{a[2]}, {c[1]}, {c[0]}})),
            (V{v1::DUPLICATE, v1::HELD, v1::APPLIED}));
  EXPECT_EQ(written("foreseen"), 2);
  EXPECT_EQ(written("planned"), 3);

  // d's second event carries a's first event's id: Foresee cannot know,
  // the one-call write meets it in the inbox and takes d[0]'s row back.
  auto d = Chain(1);
  d[1].set_event_id(a[0].event_id());
  const std::vector<v1::EventResult> reused = Deliver({{d[0], d[1]}});
  ASSERT_EQ(reused.size(), 2u);
  EXPECT_EQ(reused[0].outcome(), v1::APPLIED);
  EXPECT_NE(reused[1].outcome(), v1::APPLIED);
  EXPECT_EQ(written("foreseen"), 2);
  EXPECT_EQ(tdb_.Scalar(absl::StrCat(
                "SELECT count(*) FROM inbox WHERE event_id = '",
                a[0].event_id(), "' AND aggregate_id = '",
                a[0].aggregate_id(), "'")),
            1);
  EXPECT_EQ(tdb_.Scalar(absl::StrCat(
                "SELECT count(*) FROM inbox WHERE aggregate_id = '",
                d[0].aggregate_id(), "'")),
            1);
  ExpectAppliedInOrder();
}

// The one-call write itself: it writes only where every chain stands where
// the caller expects, answers for every chain, and on an id the inbox
// holds takes back what it inserted.
TEST_F(EngineTest, ApplyChainsWritesOnlyWhereEveryChainStandsAsExpected) {
  const std::string x = NewUuid(), y = NewUuid(), e1 = NewUuid(),
                    e2 = NewUuid(), e3 = NewUuid();
  auto call = [&](const std::string& from, const std::string& through,
                  const std::string& ids, const std::string& aggs,
                  const std::string& seqs) {
    return tdb_.Query(absl::StrCat(
        "SELECT aggregate_id, last_seq, applied_from > 0 AS wrote FROM "
        "outbox_inbox_apply_chains('{s,s}', '{order,order}', '{", x, ",", y,
        "}', 2832, '", from, "', '", through, "', '", ids,
        "', '{s,s}', '{order,order}', '", aggs, "', '", seqs,
        "', '{E,E}', ARRAY[now(), now()]) ORDER BY aggregate_id = '", x,
        "' DESC"));
  };
  // y expects a cursor at 4 and has none: nothing is written.
  pqxx::result r = call("{0,4}", "{1,5}", absl::StrCat("{", e1, ",", e2, "}"),
                        absl::StrCat("{", x, ",", y, "}"), "{1,5}");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_FALSE(r[0]["wrote"].as<bool>());
  EXPECT_EQ(r[1]["last_seq"].as<int64_t>(), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM aggregate_cursors"), 0);
  // Both new: written, with the cursors as they were (none: 0).
  r = call("{0,0}", "{1,5}", absl::StrCat("{", e1, ",", e2, "}"),
           absl::StrCat("{", x, ",", y, "}"), "{1,5}");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_TRUE(r[0]["wrote"].as<bool>());
  EXPECT_EQ(r[0]["last_seq"].as<int64_t>(), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 2);
  EXPECT_EQ(tdb_.Scalar("SELECT sum(last_seq) FROM aggregate_cursors"), 6);
  // Where they stand now, but y's event reuses e1: x's row is taken back.
  r = call("{1,5}", "{2,6}", absl::StrCat("{", e3, ",", e1, "}"),
           absl::StrCat("{", x, ",", y, "}"), "{2,6}");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_FALSE(r[0]["wrote"].as<bool>());
  EXPECT_EQ(r[0]["last_seq"].as<int64_t>(), 1);
  EXPECT_EQ(r[1]["last_seq"].as<int64_t>(), 5);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 2);
  EXPECT_EQ(tdb_.Scalar(absl::StrCat("SELECT count(*) FROM inbox WHERE "
                                     "event_id = '", e3, "'")),
            0);
  EXPECT_EQ(tdb_.Scalar("SELECT sum(last_seq) FROM aggregate_cursors"), 6);
}

// Inbox retention deletes old rows in batches; a redelivery of a pruned
// event is still a DUPLICATE without a second effect, while a different
// event at a passed position the inbox still covers is still REJECTED.
TEST_F(EngineTest, InboxRetentionKeepsDedup) {
  auto old_chain = Chain(1);
  auto new_chain = Chain(10);
  Deliver({old_chain});
  // The first two events of the chain were applied two hours ago.
  tdb_.Exec(absl::StrCat(
      "UPDATE inbox SET applied_at = now() - interval '2 hours' WHERE "
      "event_id IN ('",
      old_chain[0].event_id(), "', '", old_chain[1].event_id(), "')"));
  Deliver({new_chain});
  int64_t deleted = 0;
  ASSERT_TRUE(db_.Run([&](pqxx::connection& c) {
                   deleted =
                       PruneInboxOnce(c, absl::Hours(1), 1);  // batches
                   deleted += PruneInboxOnce(c, absl::Hours(1), 1000);
                   deleted += PruneInboxOnce(c, absl::Hours(1), 1000);
                   return absl::OkStatus();
                 })
                  .ok());
  EXPECT_EQ(deleted, 2);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 4);
  EXPECT_EQ(tdb_.Scalar(absl::StrCat(
                "SELECT pruned_through FROM aggregate_cursors WHERE "
                "aggregate_id = '",
                old_chain[0].aggregate_id(), "'")),
            2);
  EXPECT_EQ(Outcomes(Deliver({old_chain, new_chain})),
            (V{v1::DUPLICATE, v1::DUPLICATE, v1::DUPLICATE, v1::DUPLICATE,
               v1::DUPLICATE, v1::DUPLICATE}));
  v1::Event reused = old_chain[2];  // seq 3: above the pruned rows
  reused.set_event_id(NewUuid());
  EXPECT_EQ(Outcomes(Deliver({{reused}})), (V{v1::REJECTED}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger"), 6);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 4);
}

// Inbox retention prunes while batches apply and redeliveries arrive: two
// appliers (as two consumer replicas) each take their chains one event a
// batch, each followed by redeliveries of it and of earlier events, while
// a third session prunes every row already applied, in small batches, as
// fast as it can. No effect may be lost or doubled, every new event must
// be APPLIED and every redelivery (of a pruned row or not) DUPLICATE, never
// REJECTED: a redelivery read between a prune's delete and its mark would
// look like a different event at a passed position.
TEST_F(EngineTest, InboxRetentionRacingWithApplyingLosesAndDoublesNothing) {
  constexpr int kChains = 40;
  std::vector<std::vector<v1::Event>> chains;
  for (int i = 0; i < kChains; ++i) chains.push_back(Chain(1 + i * 3));
  Database db2(tdb_.url(), 4, "engine-test-2");
  Metrics m2;
  Engine second(&db2, Ledger(), &m2);
  std::atomic<bool> applying{true};
  std::atomic<int64_t> pruned_meanwhile{0};
  std::thread pruner([&] {
    Database prune_db(tdb_.url(), 1, "engine-test-retention");
    while (applying) {
      absl::Status s = prune_db.Run([&](pqxx::connection& c) {
        const int64_t n = PruneInboxOnce(c, absl::ZeroDuration(), 3);
        if (applying) pruned_meanwhile += n;
        return absl::OkStatus();
      });
      EXPECT_TRUE(s.ok()) << s;
    }
  });
  std::atomic<int> applied{0}, duplicates{0}, wrong{0};
  auto run = [&](Engine* engine, int first) {
    std::mt19937 rng(first);
    for (int step = 0; step < 3; ++step) {
      for (int c = first; c < kChains; c += 2) {
        for (int round = 0; round < 4; ++round) {
          std::vector<const v1::Event*> batch;
          if (round == 0) {
            batch.push_back(&chains[c][step]);  // the next, fresh
          } else {
            // Again: the one just applied (most likely the row the other
            // session is pruning right now), and an earlier one.
            batch.push_back(&chains[c][step]);
            batch.push_back(
                &chains[c][std::uniform_int_distribution<int>(0, step)(rng)]);
          }
          auto r = engine->ApplyBatch(batch);
          ASSERT_TRUE(r.ok()) << r.status();
          for (size_t i = 0; i < batch.size(); ++i) {
            const bool fresh = round == 0;
            const v1::DeliveryOutcome want =
                fresh ? v1::APPLIED : v1::DUPLICATE;
            if ((*r)[i].outcome() == want) {
              ++(fresh ? applied : duplicates);
            } else {
              ++wrong;
              ADD_FAILURE()
                  << "seq " << batch[i]->seq() << " of chain " << c << ": "
                  << v1::DeliveryOutcome_Name((*r)[i].outcome()) << " "
                  << (*r)[i].reason();
            }
          }
        }
      }
    }
  };
  std::thread t1(run, &applier_, 0), t2(run, &second, 1);
  t1.join();
  t2.join();
  applying = false;
  pruner.join();
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(applied, 3 * kChains);
  EXPECT_GT(duplicates, 0);
  // Retention did run among the batches, not only after them.
  EXPECT_GT(pruned_meanwhile, 0);
  ASSERT_TRUE(db_.Run([&](pqxx::connection& c) {
                   while (PruneInboxOnce(c, absl::ZeroDuration(), 100) >
                          0) {
                   }
                   return absl::OkStatus();
                 })
                  .ok());
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 0);
  // Everything once more, after retention deleted every inbox row: all
  // DUPLICATE, and still each event's effect exactly once.
  std::vector<v1::Event> all;
  for (const auto& chain : chains)
    all.insert(all.end(), chain.begin(), chain.end());
  auto again = Deliver({all});
  EXPECT_EQ(Outcomes(again), V(all.size(), v1::DUPLICATE));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger"), 3 * kChains);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM (SELECT aggregate_id FROM "
                        "ledger GROUP BY 1 HAVING count(DISTINCT seq) = 3) x"),
            kChains);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM aggregate_cursors WHERE "
                        "pruned_through <> last_seq"),
            0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 0);
}

TEST_F(EngineTest, ShuffledDeliveryEndsInOrder) {
  std::vector<v1::Event> all;
  for (int i = 0; i < 40; ++i) {
    for (auto& e : Chain(1 + i * 3)) all.push_back(e);
  }
  std::mt19937 rng(20261129);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<std::vector<v1::Event>> batches;
  for (size_t i = 0; i < all.size(); i += 7) {
    batches.emplace_back(all.begin() + i,
                         all.begin() + std::min(all.size(), i + 7));
  }
  auto results = Deliver(batches);
  EXPECT_EQ(results.size(), all.size());
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 120);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger"), 120);
  ExpectAppliedInOrder();
}

TEST_F(EngineTest, TwoReplicasRacingOnOneAggregateNeverStrandAnEvent) {
  // Two appliers with their own connections, as two consumer processes
  // sharing the database. Each gets every event of each chain, in its own
  // random order, one event per transaction, so holds and applies of the
  // same aggregate interleave in every way.
  Database db2(tdb_.url(), 4, "engine-test-2");
  Metrics m2;
  Engine second(&db2, Ledger(), &m2);
  std::vector<std::vector<v1::Event>> chains;
  for (int i = 0; i < 60; ++i) chains.push_back(Chain(1 + i * 10, 3));
  auto run = [&](Engine* a, unsigned seed) {
    std::vector<const v1::Event*> mine;
    for (const auto& c : chains)
      for (const auto& e : c) mine.push_back(&e);
    std::mt19937 rng(seed);
    std::shuffle(mine.begin(), mine.end(), rng);
    for (const v1::Event* e : mine) {
      auto r = a->ApplyBatch({e});
      ASSERT_TRUE(r.ok()) << r.status();
    }
  };
  std::thread t1(run, &applier_, 1), t2(run, &second, 2);
  t1.join();
  t2.join();
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 180);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger"), 180);
  ExpectAppliedInOrder();
}

TEST_F(EngineTest, OversizedBatchEndsTheStreamWithInvalidArgument) {
  std::vector<v1::Event> big;
  for (int i = 0; i < kMaxBatchEvents + 1; ++i) big.push_back(Chain(1)[0]);
  grpc::Status status;
  Deliver({big}, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 0);
}

TEST(EngineDown, UnreachableDatabaseEndsTheStreamUnavailable) {
  Database db("postgresql://127.0.0.1:1/outbox_billing", 1, "t");
  Metrics metrics;
  Engine applier(&db, Ledger(), &metrics);
  EventSinkImpl sink(&applier);
  auto server =
      GrpcServer::Start({"127.0.0.1:0", absl::Seconds(1)},
                        {{&sink, v1::EventSink::service_full_name()}});
  ASSERT_TRUE(server.ok());
  auto stub = v1::EventSink::NewStub(testing::Loopback((*server)->port()));
  grpc::ClientContext ctx;
  auto stream = stub->Deliver(&ctx);
  v1::DeliverRequest req;
  *req.add_events() = Chain(1)[0];
  stream->Write(req);
  v1::DeliverResponse resp;
  EXPECT_FALSE(stream->Read(&resp));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

// -- Gray failures: the database misbehaves, every process stays up. ------

// A session of its own, as a rogue client or an operator would have.
class Session {
 public:
  explicit Session(const std::string& url) : conn_(url) {}
  void Exec(const std::string& sql) {
    pqxx::nontransaction tx(conn_);
    tx.exec(sql);
  }
  // Opens a transaction that holds `lock_sql`'s lock until Release.
  void Hold(const std::string& lock_sql) {
    tx_ = std::make_unique<pqxx::work>(conn_);
    tx_->exec(lock_sql);
  }
  void Release() { tx_.reset(); }

 private:
  pqxx::connection conn_;
  std::unique_ptr<pqxx::work> tx_;
};

// Ends every other session of the database: a pooled connection then
// reconnects, as after a failover.
void TerminateOthers(testing::TestDatabase& tdb) {
  tdb.Exec(
      absl::StrCat("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                   "WHERE datname = '",
                   tdb.name(), "' AND pid <> pg_backend_pid()"));
}

class GrayFailureTest : public ::testing::Test {
 protected:
  GrayFailureTest() : tdb_("gray", LedgerSchemas()) {}

  // An applier with its own pool and session limits (short, for tests).
  std::unique_ptr<Engine> MakeApplier(const std::string& url,
                                      Watchdog* watchdog = nullptr) {
    DbSession session;
    session.statement_timeout = absl::Milliseconds(1500);
    session.lock_timeout = absl::Milliseconds(300);
    pools_.push_back(std::make_unique<Database>(url, 2, "gray-test", session));
    return std::make_unique<Engine>(pools_.back().get(), Ledger(), &metrics_,
                                    EngineOptions{}, watchdog);
  }

  static std::vector<const v1::Event*> Ptrs(const std::vector<v1::Event>& v) {
    std::vector<const v1::Event*> out;
    for (const auto& e : v) out.push_back(&e);
    return out;
  }
  int64_t Rejected() {
    return metrics_
        .AddCounter("outbox_consumer_events_total{outcome=\"rejected\"}", "")
        ->value();
  }
  int64_t Inbox() { return tdb_.Scalar("SELECT count(*) FROM inbox"); }

  // A trigger on inbox that raises `sqlstate` for every row (or only for
  // rows of `event_type`).
  void RaiseOnInbox(const std::string& sqlstate,
                    const std::string& event_type = "") {
    tdb_.Exec(absl::StrCat(
        "CREATE OR REPLACE FUNCTION gray_fail() RETURNS trigger LANGUAGE "
        "plpgsql AS $$ BEGIN IF '",
        event_type, "' = '' OR NEW.event_type = '", event_type,
        "' THEN RAISE EXCEPTION 'injected' USING ERRCODE = '", sqlstate,
        "'; END IF; RETURN NEW; END $$; "
        "CREATE TRIGGER gray_fail BEFORE INSERT ON inbox FOR EACH ROW "
        "EXECUTE FUNCTION gray_fail()"));
  }
  void StopRaising() { tdb_.Exec("DROP TRIGGER gray_fail ON inbox"); }

  // The batch fails as unavailable, nothing is written or counted against
  // the events; once `heal` ran, the same batch applies.
  void ExpectCostsTimeNotEvents(Engine* applier,
                                const std::function<void()>& heal,
                                const std::string& expect_in_message) {
    auto chain = Chain(1);
    auto failed = applier->ApplyBatch(Ptrs(chain));
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable)
        << failed.status();
    EXPECT_NE(failed.status().message().find(expect_in_message),
              std::string::npos)
        << failed.status();
    EXPECT_EQ(Rejected(), 0);
    heal();  // first: a rogue lock would block the counts, too
    EXPECT_EQ(Inbox(), 0);
    EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger"), 0);
    auto applied = applier->ApplyBatch(Ptrs(chain));
    ASSERT_TRUE(applied.ok()) << applied.status();
    EXPECT_EQ(Outcomes(*applied), (V{v1::APPLIED, v1::APPLIED, v1::APPLIED}));
    EXPECT_EQ(Inbox(), 3);
  }

  testing::TestDatabase tdb_;
  Metrics metrics_;
  std::vector<std::unique_ptr<Database>> pools_;
};

TEST_F(GrayFailureTest, ReadOnlyDatabase) {
  auto applier = MakeApplier(tdb_.url());
  tdb_.Exec(absl::StrCat("ALTER DATABASE ", tdb_.name(),
                         " SET default_transaction_read_only = on"));
  TerminateOthers(tdb_);
  ExpectCostsTimeNotEvents(
      applier.get(),
      [&] {
        tdb_.Exec(absl::StrCat("ALTER DATABASE ", tdb_.name(),
                               " RESET default_transaction_read_only"));
      },
      "25006");
}

TEST_F(GrayFailureTest, MissingPrivilege) {
  const std::string role = absl::StrCat("gray_", NewUuid().substr(0, 8));
  tdb_.Exec(absl::StrCat("CREATE ROLE ", role,
                         " LOGIN; GRANT ALL ON ALL TABLES "
                         "IN SCHEMA public TO ",
                         role,
                         "; REVOKE INSERT ON inbox "
                         "FROM ",
                         role));
  std::string url = tdb_.url();
  url.replace(url.find("postgres@"), 9, role + "@");
  auto applier = MakeApplier(url);
  ExpectCostsTimeNotEvents(
      applier.get(),
      [&] { tdb_.Exec(absl::StrCat("GRANT INSERT ON inbox TO ", role)); },
      "42501");
  pools_.clear();
  tdb_.Exec(absl::StrCat("DROP OWNED BY ", role, "; DROP ROLE ", role));
}

TEST_F(GrayFailureTest, DiskFull) {
  auto applier = MakeApplier(tdb_.url());
  RaiseOnInbox("53100");
  ExpectCostsTimeNotEvents(
      applier.get(), [&] { StopRaising(); }, "53100");
}

TEST_F(GrayFailureTest, TooManyConnectionsAndOutOfMemory) {
  auto applier = MakeApplier(tdb_.url());
  RaiseOnInbox("53300");
  ExpectCostsTimeNotEvents(
      applier.get(), [&] { StopRaising(); }, "53300");
  tdb_.Exec("TRUNCATE inbox, aggregate_cursors, ledger");
  RaiseOnInbox("53200");
  ExpectCostsTimeNotEvents(
      applier.get(), [&] { StopRaising(); }, "53200");
}

TEST_F(GrayFailureTest, LockTimeout) {
  auto applier = MakeApplier(tdb_.url());
  Session rogue(tdb_.url());
  rogue.Hold("LOCK TABLE inbox IN ACCESS EXCLUSIVE MODE");
  ExpectCostsTimeNotEvents(
      applier.get(), [&] { rogue.Release(); }, "55P03");
}

TEST_F(GrayFailureTest, StatementTimeout) {
  auto applier = MakeApplier(tdb_.url());
  tdb_.Exec(
      "CREATE FUNCTION gray_slow() RETURNS trigger LANGUAGE plpgsql AS $$ "
      "BEGIN PERFORM pg_sleep(3); RETURN NEW; END $$; CREATE TRIGGER gray_slow "
      "BEFORE INSERT ON inbox FOR EACH ROW EXECUTE FUNCTION gray_slow()");
  ExpectCostsTimeNotEvents(
      applier.get(), [&] { tdb_.Exec("DROP TRIGGER gray_slow ON inbox"); },
      "57014");
}

TEST_F(GrayFailureTest,
       SerializationFailuresAndDeadlocksAreRetriedThenUnavailable) {
  auto applier = MakeApplier(tdb_.url());
  RaiseOnInbox("40001");
  ExpectCostsTimeNotEvents(
      applier.get(), [&] { StopRaising(); }, "40001");
  tdb_.Exec("TRUNCATE inbox, aggregate_cursors, ledger");
  RaiseOnInbox("40P01");
  ExpectCostsTimeNotEvents(
      applier.get(), [&] { StopRaising(); }, "40P01");
}

// A transaction conflict (class 40) is retried at once, exactly
// conflict_retries times, and only then answered as unavailable; one that
// clears up within them costs nothing at all.
TEST_F(GrayFailureTest, ASerializationFailureIsRetriedExactlyConflictRetries) {
  tdb_.Exec(
      "CREATE SEQUENCE gray_attempts; CREATE TABLE gray_fail_until (n int); "
      "INSERT INTO gray_fail_until VALUES (1000000); "
      "CREATE FUNCTION gray_conflict() RETURNS trigger LANGUAGE plpgsql AS $$ "
      "BEGIN IF nextval('gray_attempts') <= (SELECT n FROM gray_fail_until) "
      "THEN RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END IF; "
      "RETURN NEW; END $$; CREATE TRIGGER gray_conflict BEFORE INSERT ON "
      "inbox FOR EACH ROW EXECUTE FUNCTION gray_conflict()");
  // nextval is not rolled back: it counts every attempt.
  const auto attempts = [&] {
    return tdb_.Scalar(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM "
        "gray_attempts");
  };
  pools_.push_back(std::make_unique<Database>(tdb_.url(), 2, "gray-test"));
  EngineOptions options;
  ASSERT_EQ(options.conflict_retries, 5);  // the documented default
  Engine engine(pools_.back().get(), Ledger(), &metrics_, options);
  auto chain = Chain(1);
  auto failed = engine.ApplyBatch(Ptrs(chain));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable)
      << failed.status();
  EXPECT_EQ(attempts(), 1 + options.conflict_retries);
  EXPECT_EQ(Rejected(), 0);
  EXPECT_EQ(Inbox(), 0);

  // Two conflicts, then none: applied by the third try, nothing answered
  // as unavailable.
  tdb_.Exec(
      "ALTER SEQUENCE gray_attempts RESTART; UPDATE gray_fail_until "
      "SET n = 2");
  auto applied = engine.ApplyBatch(Ptrs(chain));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(Outcomes(*applied), (V{v1::APPLIED, v1::APPLIED, v1::APPLIED}));
  EXPECT_EQ(attempts(), 2 + 3);  // two failed tries, then a row each
  EXPECT_EQ(Inbox(), 3);
}

TEST_F(GrayFailureTest, ServerEndsTheSessionMidBatch) {
  // The server terminates the session while it applies (a shutdown, an
  // operator, a failover): the connection is lost mid-transaction.
  auto applier = MakeApplier(tdb_.url());
  tdb_.Exec(
      "CREATE FUNCTION gray_kill() RETURNS trigger LANGUAGE plpgsql AS $$ "
      "BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NEW; END "
      "$$; CREATE TRIGGER gray_kill BEFORE INSERT ON inbox FOR EACH ROW "
      "EXECUTE FUNCTION gray_kill()");
  // The connection is gone, not the event at fault.
  ExpectCostsTimeNotEvents(
      applier.get(), [&] { tdb_.Exec("DROP TRIGGER gray_kill ON inbox"); },
      "database unreachable");
}

TEST_F(GrayFailureTest, DatabaseRefusingConnections) {
  auto applier = MakeApplier(tdb_.url());
  Session admin(testing::TestServerUrl() + "/postgres");
  admin.Exec(absl::StrCat("ALTER DATABASE ", tdb_.name(),
                          " WITH ALLOW_CONNECTIONS false"));
  TerminateOthers(tdb_);
  ExpectCostsTimeNotEvents(
      applier.get(),
      [&] {
        admin.Exec(absl::StrCat("ALTER DATABASE ", tdb_.name(),
                                " WITH ALLOW_CONNECTIONS true"));
      },
      "cannot connect");
}

TEST_F(GrayFailureTest, BadDataIsPinnedOnItsEventAlone) {
  // A value the database refuses (class 22) for one event of the batch:
  // the batch is split and only that event is REJECTED.
  auto applier = MakeApplier(tdb_.url());
  RaiseOnInbox("22023", "OrderPaid");
  auto chain = Chain(1);
  auto other = Chain(10);
  std::vector<v1::Event> batch = {chain[0], chain[1], other[0]};
  auto results = applier->ApplyBatch(Ptrs(batch));
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ(Outcomes(*results), (V{v1::APPLIED, v1::REJECTED, v1::APPLIED}));
  EXPECT_NE((*results)[1].reason().find("22023"), std::string::npos)
      << (*results)[1].reason();
  EXPECT_EQ(Inbox(), 2);
  StopRaising();
  // A constraint violation (class 23) on the handler's effect: the same.
  tdb_.Exec(
      "ALTER TABLE ledger ADD CONSTRAINT sane CHECK (event_type <> "
      "'OrderPaid')");
  auto results2 = applier->ApplyBatch(Ptrs({chain[1], other[1]}));
  ASSERT_TRUE(results2.ok()) << results2.status();
  EXPECT_EQ(Outcomes(*results2), (V{v1::REJECTED, v1::REJECTED}));
  EXPECT_NE((*results2)[0].reason().find("23514"), std::string::npos);
  EXPECT_EQ(Rejected(), 3);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger WHERE event_type = "
                        "'OrderPaid'"),
            0);
}

TEST_F(GrayFailureTest, AHeldEventThatFailsAsItDrainsIsChargedNotItsPredecessor) {
  // OrderPaid and OrderCancelled arrive first and are held; the effect
  // OrderPaid writes breaks a constraint. When OrderCreated arrives, it
  // applies (it is innocent), OrderPaid stays held with the failure and
  // an attempt, and OrderCancelled waits behind it.
  auto applier = MakeApplier(tdb_.url());
  tdb_.Exec(
      "ALTER TABLE ledger ADD CONSTRAINT sane CHECK (event_type <> "
      "'OrderPaid')");
  auto chain = Chain(1);
  auto other = Chain(10);
  auto held = applier->ApplyBatch(Ptrs({chain[1], chain[2]}));
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(Outcomes(*held), (V{v1::HELD, v1::HELD}));
  for (int round = 1; round <= 2; ++round) {
    // Its predecessor, twice (a redelivery too): never charged.
    auto results = applier->ApplyBatch(Ptrs({chain[0], other[0]}));
    ASSERT_TRUE(results.ok()) << results.status();
    EXPECT_EQ(Outcomes(*results),
              round == 1 ? (V{v1::APPLIED, v1::APPLIED})
                         : (V{v1::DUPLICATE, v1::DUPLICATE}));
  }
  EXPECT_EQ(tdb_.Scalar("SELECT last_seq FROM aggregate_cursors WHERE "
                        "aggregate_id = '" + chain[0].aggregate_id() + "'"),
            1);
  EXPECT_EQ(tdb_.Scalar("SELECT attempts FROM held_events WHERE event_id = '" +
                        chain[1].event_id() + "'"),
            1);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events WHERE last_error "
                        "LIKE '%23514%' AND event_id = '" +
                        chain[1].event_id() + "'"),
            1);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 2);
  EXPECT_EQ(Rejected(), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger WHERE event_type <> "
                        "'OrderCreated'"),
            0);

  // Only the next event of a chain can be released or skipped.
  auto early = applier->ReleaseHeld(chain[2].event_id(), "ops", "try");
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(early.status().message().find("gap"), std::string::npos)
      << early.status();
  EXPECT_EQ(applier->SkipHeld(NewUuid(), "ops", "x").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(applier->SkipHeld("nope", "ops", "x").status().code(),
            absl::StatusCode::kInvalidArgument);

  // Released while the constraint holds: charged again, still held.
  auto again = applier->ReleaseHeld(chain[1].event_id(), "ops", "retry");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->applied);
  EXPECT_NE(again->last_error.find("23514"), std::string::npos)
      << again->last_error;
  EXPECT_EQ(tdb_.Scalar("SELECT attempts FROM held_events WHERE event_id = '" +
                        chain[1].event_id() + "'"),
            2);
  // Fixed, released: it applies and its successor drains behind it.
  tdb_.Exec("ALTER TABLE ledger DROP CONSTRAINT sane");
  auto fixed = applier->ReleaseHeld(chain[1].event_id(), "ops", "fixed");
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_TRUE(fixed->applied);
  EXPECT_EQ(fixed->cursor, 3);
  EXPECT_EQ(fixed->drained, 1);
  EXPECT_EQ(fixed->held_left, 0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger WHERE event_type <> "
                        "'OrderCreated'"),
            2);  // paid, cancelled
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_actions WHERE action = "
                        "'release' AND actor = 'ops'"),
            2);
  EXPECT_EQ(Rejected(), 0);
}

TEST_F(GrayFailureTest, ASkippedHeldEventIsDoneWithoutItsEffect) {
  auto applier = MakeApplier(tdb_.url());
  tdb_.Exec(
      "ALTER TABLE ledger ADD CONSTRAINT sane CHECK (event_type <> "
      "'OrderPaid')");
  auto chain = Chain(1);
  ASSERT_TRUE(applier->ApplyBatch(Ptrs({chain[1], chain[2]})).ok());
  ASSERT_TRUE(applier->ApplyBatch(Ptrs({chain[0]})).ok());
  tdb_.Exec("ALTER TABLE ledger DROP CONSTRAINT sane");
  auto skipped = applier->SkipHeld(chain[1].event_id(), "ops", "refunded by hand");
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_EQ(skipped->cursor, 3);     // OrderCancelled drained behind it
  EXPECT_EQ(skipped->drained, 1);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger WHERE event_type = "
                        "'OrderPaid'"),
            0);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 0);
  // A redelivery of the skipped event is a duplicate, with no effect.
  auto redelivered = applier->ApplyBatch(Ptrs({chain[1]}));
  ASSERT_TRUE(redelivered.ok());
  EXPECT_EQ(Outcomes(*redelivered), (V{v1::DUPLICATE}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_actions WHERE action = "
                        "'skip' AND reason = 'refunded by hand'"),
            1);
}

TEST_F(GrayFailureTest, StalledApplyTurnsTheWatchdogAndRecovers) {
  Watchdog watchdog("consumer apply path", absl::Milliseconds(400));
  auto applier = MakeApplier(tdb_.url(), &watchdog);
  Session rogue(tdb_.url());
  rogue.Hold("LOCK TABLE aggregate_cursors IN ACCESS EXCLUSIVE MODE");
  auto chain = Chain(1);
  EXPECT_FALSE(applier->ApplyBatch(Ptrs(chain)).ok());
  EXPECT_FALSE(applier->ApplyBatch(Ptrs(chain)).ok());  // 2 x 300 ms waits
  auto why = watchdog.Stalled();
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("lock timeout"), std::string::npos) << *why;
  rogue.Release();
  ASSERT_TRUE(applier->ApplyBatch(Ptrs(chain)).ok());
  EXPECT_FALSE(watchdog.Stalled().has_value());
}

// -- Identity: duplicates, reused positions, forks. --------------------------

TEST_F(EngineTest, AnEventReusingAPassedPositionIsRejectedAndChangesNothing) {
  auto chain = Chain(1);
  Deliver({chain});
  // What a restored backup of the outbox would send: seq 2 again, but a
  // different event.
  v1::Event restored = chain[1];
  restored.set_event_id(NewUuid());
  restored.set_event_type("OrderRefunded");
  auto results = Deliver({{restored}});
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].outcome(), v1::REJECTED);
  EXPECT_NE(results[0].reason().find("reused a position"), std::string::npos)
      << results[0].reason();
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM ledger"), 3);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 3);
  EXPECT_EQ(
      metrics_.AddCounter("outbox_consumer_position_reused_total", "")->value(),
      1);
  // The real one is still a duplicate.
  EXPECT_EQ(Outcomes(Deliver({{chain[1]}})), (V{v1::DUPLICATE}));
}

TEST_F(EngineTest, AForkOfAHeldLinkIsRejectedNotSilentlyDropped) {
  auto chain = Chain(1);
  EXPECT_EQ(Outcomes(Deliver({{chain[2]}})), (V{v1::HELD}));
  v1::Event fork = chain[2];
  fork.set_event_id(NewUuid());
  fork.set_seq(9);
  auto results = Deliver({{fork}});
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].outcome(), v1::REJECTED);
  EXPECT_NE(results[0].reason().find("fork"), std::string::npos);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 1);
  EXPECT_EQ(tdb_.Scalar("SELECT held_count FROM aggregate_cursors"), 1);
  Deliver({{chain[0], chain[1]}});
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 3);
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT held_count FROM aggregate_cursors"), 0);
  ExpectAppliedInOrder();
}

TEST_F(EngineTest, AHeldForkThatTheChainPassesIsDiscardedAndCounted) {
  auto chain = Chain(1, 4);  // seqs 1, 5, 9
  v1::Event fork = chain[2];
  fork.set_event_id(NewUuid());
  fork.set_seq(7);
  fork.set_prev_seq(3);  // waits for a seq 3 that this chain never has
  EXPECT_EQ(Outcomes(Deliver({{fork}})), (V{v1::HELD}));
  EXPECT_EQ(Outcomes(Deliver({{chain[0], chain[1], chain[2]}})),
            (V{v1::APPLIED, v1::APPLIED, v1::APPLIED}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(tdb_.Scalar("SELECT held_count FROM aggregate_cursors"), 0);
  EXPECT_EQ(
      metrics_.AddCounter("outbox_consumer_held_discarded_total", "")->value(),
      1);
  ExpectAppliedInOrder();
}

TEST_F(EngineTest, AnEventIdAppliedBeforeCannotApplyAgainAtANewPosition) {
  auto chain = Chain(1);
  Deliver({{chain[0]}});
  v1::Event again = chain[1];
  again.set_event_id(chain[0].event_id());  // the id of an applied event
  auto results = Deliver({{again, chain[1]}});
  EXPECT_EQ(Outcomes(results), (V{v1::REJECTED, v1::APPLIED}));
  EXPECT_NE(results[0].reason().find("applied before"), std::string::npos)
      << results[0].reason();
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 2);
}

// A DUPLICATE would tell the relay that the event took effect: only the
// same event at the same place is one.
TEST_F(EngineTest, AnEventIdAppliedToAnotherOrderIsNoDuplicateAtAPassedSeq) {
  auto a = Chain(1);
  auto b = Chain(100);
  Deliver({{a[0]}, {b[0], b[1]}});
  v1::Event reused = b[1];  // b has passed seq 101
  reused.set_event_id(a[0].event_id());
  auto results = Deliver({{reused}});
  EXPECT_EQ(Outcomes(results), (V{v1::REJECTED}));
  EXPECT_NE(results[0].reason().find("was applied as seq 1 of aggregate"),
            std::string::npos)
      << results[0].reason();
  // The real copies still are duplicates.
  EXPECT_EQ(Outcomes(Deliver({{a[0], b[1]}})),
            (V{v1::DUPLICATE, v1::DUPLICATE}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 3);
}

TEST_F(EngineTest, OneEventIdOnTwoAggregatesInABatchAppliesOnce) {
  // The second copy names another order: the stream goes on, the first is
  // applied, the second is REJECTED (a fault of the event: it counts
  // toward its dead letter), and its aggregate's successor defers.
  auto a = Chain(1);
  auto b = Chain(1);
  b[0].set_event_id(a[0].event_id());
  grpc::Status status;
  auto results = Deliver({{a[0], b[0], b[1]}, {a[1]}}, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Outcomes(results),
            (V{v1::APPLIED, v1::REJECTED, v1::DEFERRED, v1::APPLIED}));
  ASSERT_EQ(results.size(), 4u);
  EXPECT_NE(results[1].reason().find("is applied in this batch"),
            std::string::npos)
      << results[1].reason();
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 2);
  EXPECT_EQ(tdb_.Scalar("SELECT count(DISTINCT aggregate_id) FROM ledger"), 1);
  // Sent again, it is rejected again, never applied.
  auto again = Deliver({{b[0]}});
  EXPECT_EQ(Outcomes(again), (V{v1::REJECTED}));
  EXPECT_EQ(tdb_.Scalar("SELECT count(*) FROM inbox"), 2);
  ExpectAppliedInOrder();
}

TEST(EngineHeldCap, BeyondTheCapEventsAreRejected) {
  testing::TestDatabase tdb("heldcap", LedgerSchemas());
  Database db(tdb.url(), 2, "cap-test");
  Metrics metrics;
  EngineOptions options;
  options.plan.max_held_per_aggregate = 2;
  Engine applier(&db, Ledger(), &metrics, options);
  auto chain = Chain(1);  // seqs 1, 2, 3
  v1::Event fourth = chain[2];
  fourth.set_event_id(NewUuid());
  fourth.set_seq(4);
  fourth.set_prev_seq(3);
  auto r = applier.ApplyBatch({&chain[1], &chain[2], &fourth});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].outcome(), v1::HELD);
  EXPECT_EQ((*r)[1].outcome(), v1::HELD);
  EXPECT_EQ((*r)[2].outcome(), v1::REJECTED);
  EXPECT_NE((*r)[2].reason().find("max_held_per_aggregate"), std::string::npos);
  EXPECT_EQ(tdb.Scalar("SELECT held_count FROM aggregate_cursors"), 2);
  r = applier.ApplyBatch({&chain[0]});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM inbox"), 3);
  EXPECT_EQ(tdb.Scalar("SELECT held_count FROM aggregate_cursors"), 0);
}

TEST(EngineSink, AReadOnlyDatabaseEndsTheStreamUnavailable) {
  testing::TestDatabase tdb("sinkro", LedgerSchemas());
  Database db(tdb.url(), 2, "sink-ro");
  Metrics metrics;
  Engine applier(&db, Ledger(), &metrics);
  EventSinkImpl sink(&applier);
  auto server =
      GrpcServer::Start({"127.0.0.1:0", absl::Seconds(1)},
                        {{&sink, v1::EventSink::service_full_name()}});
  ASSERT_TRUE(server.ok());
  tdb.Exec(absl::StrCat("ALTER DATABASE ", tdb.name(),
                        " SET default_transaction_read_only = on"));
  TerminateOthers(tdb);
  auto stub = v1::EventSink::NewStub(testing::Loopback((*server)->port()));
  grpc::ClientContext ctx;
  auto stream = stub->Deliver(&ctx);
  v1::DeliverRequest req;
  for (const auto& e : Chain(1)) *req.add_events() = e;
  stream->Write(req);
  v1::DeliverResponse resp;
  EXPECT_FALSE(stream->Read(&resp));
  grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM inbox"), 0);
}

// An event of chain (source, type, id) at seq after prev, without a
// payload (the ledger takes any); a new id unless `event_id` is given.
v1::Event ChainEvent(const std::string& source, const std::string& type,
                     const std::string& id, int64_t seq, int64_t prev,
                     const std::string& event_id = "") {
  v1::Event e;
  e.set_event_id(event_id.empty() ? NewUuid() : event_id);
  e.set_source(source);
  e.set_aggregate_type(type);
  e.set_aggregate_id(id);
  e.set_seq(seq);
  e.set_prev_seq(prev);
  e.set_event_type("Happened");
  return e;
}

// A chain is (source, aggregate_type, aggregate_id): the same id under
// another type, or from another outbox, starts a chain of its own, and
// their seqs and prev_seqs never meet.
TEST(ChainIdentity, OneIdUnderTwoTypesAndTwoSourcesIsFourChains) {
    testing::TestDatabase tdb("chains", LedgerSchemas());
  Database db(tdb.url(), 2, "chains-test");
  Metrics metrics;
  Engine engine(&db, Ledger(), &metrics);
  auto event = [](const std::string& source, const std::string& type,
                  int64_t seq, int64_t prev) {
    return ChainEvent(source, type, "X", seq, prev);
  };
  // Shard a's order X (seqs 1, 3), its parcel X (2, 4), and shard b's
  // order X, whose seqs collide with shard a's (1, 2).
  v1::Event a_order1 = event("a", "order", 1, 0);
  v1::Event a_parcel2 = event("a", "parcel", 2, 0);
  v1::Event a_order3 = event("a", "order", 3, 1);
  v1::Event a_parcel4 = event("a", "parcel", 4, 2);
  v1::Event b_order1 = event("b", "order", 1, 0);
  v1::Event b_order2 = event("b", "order", 2, 1);
  auto r = engine.ApplyBatch({&a_order1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].outcome(), v1::APPLIED);
  // Successors first: each is held for its own chain's predecessor only.
  r = engine.ApplyBatch({&a_parcel4, &b_order2});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Outcomes(*r),
            std::vector<v1::DeliveryOutcome>({v1::HELD, v1::HELD}));
  r = engine.ApplyBatch({&a_parcel2, &b_order1, &a_order3});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Outcomes(*r), std::vector<v1::DeliveryOutcome>(
                              {v1::APPLIED, v1::APPLIED, v1::APPLIED}));
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM held_events"), 0);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM inbox"), 6);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM aggregate_cursors"), 3);
  EXPECT_EQ(tdb.Scalar("SELECT last_seq FROM aggregate_cursors WHERE source "
                       "= 'a' AND aggregate_type = 'parcel'"),
            4);
  EXPECT_EQ(tdb.Scalar("SELECT last_seq FROM aggregate_cursors WHERE source "
                       "= 'b' AND aggregate_type = 'order'"),
            2);
  v1::Event again = b_order1;
  r = engine.ApplyBatch({&again});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].outcome(), v1::DUPLICATE);
  // A bad source name is the event's fault.
  v1::Event bad = event("no spaces", "order", 9, 0);
  r = engine.ApplyBatch({&bad});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].outcome(), v1::REJECTED);
  EXPECT_NE((*r)[0].reason().find("source"), std::string::npos);
}

// A database from before chains had a source and a type: its rows keep ''
// for both, and the first source to send one of their ids takes them over
// (cursor, inbox rows, held events); another source never does.
TEST(ChainIdentity, RowsFromBeforeAreTakenOverByTheFirstSource) {
    testing::TestDatabase tdb("legacy", LedgerSchemas());
  Database db(tdb.url(), 2, "legacy-test");
  Metrics metrics;
  Engine engine(&db, Ledger(), &metrics);
  const std::string e1 = NewUuid(), e2 = NewUuid();
  // As the previous release left them: X applied through 2 (and inbox
  // rows for both), seq 5 held for seq 4; Y applied through 7.
  v1::Event held;
  held.set_event_id(NewUuid());
  held.set_aggregate_type("order");
  held.set_aggregate_id("X");
  held.set_seq(5);
  held.set_prev_seq(4);
  held.set_event_type("Happened");
  tdb.Exec("INSERT INTO inbox (event_id, aggregate_id, seq, event_type) "
           "VALUES ('" + e1 + "', 'X', 1, 'A'), ('" + e2 + "', 'X', 2, 'B')");
  tdb.Exec("INSERT INTO aggregate_cursors (aggregate_id, last_seq, "
           "held_count) VALUES ('X', 2, 1), ('Y', 7, 0)");
  tdb.Exec("INSERT INTO held_events (event_id, aggregate_id, seq, prev_seq, "
           "payload) VALUES ('" + held.event_id() + "', 'X', 5, 4, decode('" +
           [&] {
             static const char kHex[] = "0123456789abcdef";
             std::string hex;
             for (unsigned char c : held.SerializeAsString()) {
               hex.push_back(kHex[c >> 4]);
               hex.push_back(kHex[c & 15]);
             }
             return hex;
           }() + "', 'hex'))");
  auto event = [](const std::string& source, const std::string& id,
                  int64_t seq, int64_t prev, const std::string& event_id) {
    return ChainEvent(source, "order", id, seq, prev, event_id);
  };
  // A redelivery of an applied event from source s: a duplicate of the
  // adopted chain; then its successor drains the held one.
  v1::Event dup = event("s", "X", 2, 1, e2);
  v1::Event next = event("s", "X", 4, 2, "");
  auto r = engine.ApplyBatch({&dup, &next});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Outcomes(*r),
            std::vector<v1::DeliveryOutcome>({v1::DUPLICATE, v1::APPLIED}));
  EXPECT_EQ(tdb.Scalar("SELECT last_seq FROM aggregate_cursors WHERE source "
                       "= 's' AND aggregate_type = 'order' AND aggregate_id "
                       "= 'X'"),
            5);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM inbox WHERE source = 's'"), 4);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM held_events"), 0);
  // Y belongs to s too: another source's Y is a new chain.
  v1::Event other = event("t", "Y", 8, 7, "");
  r = engine.ApplyBatch({&other});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].outcome(), v1::HELD);
  v1::Event mine = event("s", "Y", 8, 7, "");
  r = engine.ApplyBatch({&mine});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].outcome(), v1::APPLIED);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM aggregate_cursors WHERE "
                       "aggregate_type = ''"),
            0);
}

// Relays not upgraded yet send no source: their events take over a row's
// type only, and a named source takes those rows over afterwards.
TEST(ChainIdentity, RowsOfRelaysWithoutASourceGoToTheFirstNamedOne) {
    testing::TestDatabase tdb("unnamed", LedgerSchemas());
  Database db(tdb.url(), 2, "unnamed-test");
  Metrics metrics;
  Engine engine(&db, Ledger(), &metrics);
  tdb.Exec("INSERT INTO aggregate_cursors (aggregate_id, last_seq) VALUES "
           "('Z', 2), ('W', 5)");
  auto event = [](const std::string& source, const std::string& id,
                  int64_t seq, int64_t prev) {
    return ChainEvent(source, "order", id, seq, prev);
  };
  v1::Event old_relay = event("", "Z", 3, 2);
  v1::Event upgraded = event("s", "Z", 4, 3);
  v1::Event other = event("t", "W", 6, 5);
  for (v1::Event* e : {&old_relay, &upgraded}) {
    auto r = engine.ApplyBatch({e});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].outcome(), v1::APPLIED) << e->source();
  }
  EXPECT_EQ(tdb.Scalar("SELECT last_seq FROM aggregate_cursors WHERE source "
                       "= 's' AND aggregate_type = 'order' AND aggregate_id "
                       "= 'Z'"),
            4);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM inbox_legacy_source WHERE "
                       "source = 's'"),
            1);
  // Another named source takes nothing over: its W is a chain of its own.
  auto r = engine.ApplyBatch({&other});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].outcome(), v1::HELD);
  EXPECT_EQ(tdb.Scalar("SELECT last_seq FROM aggregate_cursors WHERE source "
                       "= '' AND aggregate_id = 'W'"),
            5);
}

// A handler that refuses, at apply time, the events whose type is
// "Refused" (a rule that needs its tables to decide).
class RefusingHandler final : public Handler {
 public:
  std::string name() const override { return "refusing"; }
  const std::vector<Migration>& migrations() const override {
    static const std::vector<Migration> none;
    return none;
  }
  absl::Status Validate(const v1::Event&) const override {
    return absl::OkStatus();
  }
  std::vector<Rejection> Apply(
      pqxx::work& tx, const std::vector<const v1::Event*>& events) override {
    std::vector<Rejection> out;
    for (size_t i = 0; i < events.size(); ++i) {
      if (events[i]->event_type() == "Refused") out.push_back({i, "no funds"});
    }
    return out;
  }
};

TEST(HandlerRefusal, RejectsTheEventDefersItsSuccessorsAndKeepsTheRest) {
  RefusingHandler handler;
  testing::TestDatabase tdb("refuse", {InboxSchema()});
  Database db(tdb.url(), 2, "refuse-test");
  Metrics metrics;
  Engine engine(&db, &handler, &metrics);
  auto a = Chain(1);
  auto b = Chain(10);
  a[1].set_event_type("Refused");
  auto r = engine.ApplyBatch({&a[0], &b[0], &a[1], &b[1], &a[2], &b[2]});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Outcomes(*r), std::vector<v1::DeliveryOutcome>(
                              {v1::APPLIED, v1::APPLIED, v1::REJECTED,
                               v1::APPLIED, v1::DEFERRED, v1::APPLIED}));
  EXPECT_EQ((*r)[2].reason(), "no funds");
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM inbox"), 4);
  // A refused held event stays held; its predecessor applies.
  auto c = Chain(20);
  c[1].set_event_type("Refused");
  r = engine.ApplyBatch({&c[1]});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0].outcome(), v1::HELD);
  r = engine.ApplyBatch({&c[0]});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].outcome(), v1::APPLIED);
  EXPECT_EQ(tdb.Scalar("SELECT count(*) FROM held_events"), 1);
  EXPECT_EQ(tdb.Scalar("SELECT last_seq FROM aggregate_cursors WHERE "
                       "aggregate_id = '" +
                       c[0].aggregate_id() + "'"),
            20);
}

}  // namespace
}  // namespace outbox::inbox
