// The dispatcher against a real PostgreSQL and a sink that records what it
// was sent: a round sends what the outbox log owes on a serving lane; the
// answers, once their marks and the log's positions are written, settle it
// for good (a dispatcher of a new session sends none of it again); a
// broken stream sends its events again; a paused round sends nothing.

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/db.h"
#include "common/metrics.h"
#include "common/schema.h"
#include "relay/dispatcher.h"
#include "relay/lane_testing.h"
#include "relay/log_testing.h"
#include "tests/testing/pg.h"

namespace outbox::relay {
namespace {

RelayOptions OneLane() {
  RelayOptions o;
  o.subscription = "billing";
  o.lanes = 1;
  return o;
}

class DispatcherTest : public ::testing::Test {
 protected:
  DispatcherTest()
      : db_("dispatcher", {OutboxSchema()}),
        counters_(&metrics_),
        listener_(CommitListener::Options{.url = db_.url()}) {
    dispatcher_ = NewSession(&conn_);
  }

  // A session as a relay's worker opens it: the subscription taken up (on
  // the log), every partition leased, the lane's stream open.
  std::unique_ptr<Dispatcher> NewSession(std::unique_ptr<Connection>* conn) {
    absl::StatusOr<WorkerSession> s = OpenWorkerSession(
        db_.url(), "dispatcher-test", DbSession{},
        {.subscription = "billing", .actor = "test"}, /*move_onto_log=*/true);
    EXPECT_TRUE(s.ok()) << s.status();
    *conn = std::move(s->conn);
    auto d = std::make_unique<Dispatcher>(options_, "test", &counters_, &sink_,
                                          [](int64_t) {});
    d->TakeUp(s->up);
    auto tx = OpenUnit(**conn);
    ownership_.Round(*tx, /*unlinked=*/false, [](int) { return false; });
    tx->commit();
    d->lanes().Open(
        sink_, [] {}, absl::Now());
    return d;
  }

  // Events of `aggregates` (one each), committed; their seqs.
  std::vector<int64_t> Commit(const std::vector<std::string>& aggregates) {
    pqxx::connection c(db_.url());
    pqxx::work tx(c);
    std::vector<int64_t> seqs;
    for (const std::string& a : aggregates) seqs.push_back(Append(tx, a));
    tx.commit();
    return seqs;
  }

  // Rounds of `d` until `wire` was sent `batches` batches, or 400 rounds
  // passed (a round may wait for a tick to age).
  void RoundsUntil(Dispatcher& d, Connection& conn, const Wire& wire,
                   size_t batches, bool paused = false) {
    for (int i = 0; i < 400 && wire.requests.size() < batches; ++i) {
      bool all_held = false;
      const absl::Status s =
          d.Round(conn, ownership_, listener_, paused, &all_held);
      ASSERT_TRUE(s.ok()) << s;
      absl::SleepFor(absl::Milliseconds(2));
    }
  }

  static std::set<int64_t> Seqs(const std::vector<v1::DeliverRequest>& sent) {
    std::set<int64_t> seqs;
    for (const v1::DeliverRequest& r : sent) {
      for (const v1::Event& e : r.events()) seqs.insert(e.seq());
    }
    return seqs;
  }

  testing::TestDatabase db_;
  const RelayOptions options_ = OneLane();
  Metrics metrics_;
  const RelayCounters counters_;
  FakeSink sink_;
  PartitionOwnership ownership_{"billing", "test", absl::Seconds(30)};
  CommitListener listener_;  // never started: no LISTEN, as behind a pooler
  std::unique_ptr<Connection> conn_;
  std::unique_ptr<Dispatcher> dispatcher_;
};

TEST_F(DispatcherTest, WhatWasAnsweredAndStoredIsNotSentAgain) {
  const std::vector<int64_t> seqs = Commit({"a", "b", "c"});
  RoundsUntil(*dispatcher_, *conn_, *sink_.wire, 1);
  ASSERT_EQ(sink_.wire->requests.size(), 1u);
  EXPECT_EQ(Seqs(sink_.wire->requests),
            std::set<int64_t>(seqs.begin(), seqs.end()));
  EXPECT_FALSE(dispatcher_->settled());
  EXPECT_EQ(dispatcher_->lanes().events_in_flight(), 3);

  sink_.wire->answers.push_back(AllApplied(sink_.wire->requests[0]));
  dispatcher_->TakeAnswers();
  ASSERT_TRUE(dispatcher_->FlushMarks(*conn_).ok());
  ASSERT_TRUE(dispatcher_->FlushLog(*conn_, /*now=*/true).ok());
  EXPECT_TRUE(dispatcher_->settled());
  EXPECT_EQ(counters_.delivered->value(), 3);

  // A new session (a relay restarted) reads on from the stored positions:
  // the next event goes, none of the three again.
  const std::vector<int64_t> next = Commit({"d"});
  std::unique_ptr<Connection> conn;
  std::unique_ptr<Dispatcher> again = NewSession(&conn);
  const std::shared_ptr<Wire> wire = sink_.wire;
  RoundsUntil(*again, *conn, *wire, 1);
  ASSERT_EQ(wire->requests.size(), 1u);
  EXPECT_EQ(Seqs(wire->requests), std::set<int64_t>(next.begin(), next.end()));
}

TEST_F(DispatcherTest, ABrokenStreamSendsItsEventsAgain) {
  const std::vector<int64_t> seqs = Commit({"a", "b"});
  RoundsUntil(*dispatcher_, *conn_, *sink_.wire, 1);
  ASSERT_EQ(Seqs(sink_.wire->requests),
            std::set<int64_t>(seqs.begin(), seqs.end()));
  sink_.wire->broken = true;
  dispatcher_->TakeAnswers();  // the break is seen: nothing is in flight
  EXPECT_EQ(dispatcher_->lanes().events_in_flight(), 0);
  EXPECT_EQ(counters_.stream_failures->value(), 1);

  // A stream again once its backoff passed: the same events on it.
  dispatcher_->lanes().Open(
      sink_, [] {}, absl::Now() + absl::Seconds(30));
  ASSERT_EQ(sink_.opened, 2);
  RoundsUntil(*dispatcher_, *conn_, *sink_.wire, 1);
  EXPECT_EQ(Seqs(sink_.wire->requests),
            std::set<int64_t>(seqs.begin(), seqs.end()));
}

TEST_F(DispatcherTest, APausedRoundSendsNothing) {
  Commit({"a"});
  RoundsUntil(*dispatcher_, *conn_, *sink_.wire, 1, /*paused=*/true);
  EXPECT_TRUE(sink_.wire->requests.empty());
  RoundsUntil(*dispatcher_, *conn_, *sink_.wire, 1);
  EXPECT_EQ(sink_.wire->requests.size(), 1u);
}

}  // namespace
}  // namespace outbox::relay
