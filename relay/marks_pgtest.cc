// What the consumer's answers leave (pure: each outcome's mark, the
// events a HELD answer shows lost) and what they write, against a real
// PostgreSQL: a delivered row goes only while it holds the event answered;
// a rejection counts an attempt, backs off, and the last one makes a dead
// letter; a divergence waits for an operator; an event from the log that
// was not delivered becomes an exception; and the pure plan of which
// statements a set of marks needs.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/db.h"
#include "common/schema.h"
#include "relay/delivery_store.h"
#include "relay/log_testing.h"
#include "relay/marks.h"
#include "relay/subscribe.h"
#include "tests/testing/pg.h"

namespace outbox::relay {
namespace {

Mark Of(int64_t seq, Mark::Kind kind, bool from_log = false) {
  Mark m{.seq = seq,
         .event_id = "e" + std::to_string(seq),
         .chain = OutboxChain("order", "a"),
         .kind = kind};
  m.from_log = from_log;
  return m;
}

TEST(PlanMarks, DeliveriesOfRowsAreDeletedAndTheLogsOthersOwed) {
  const std::vector<Mark> marks = {
      Of(1, Mark::kDelivered),       Of(2, Mark::kRejected),
      Of(3, Mark::kDelivered, true), Of(4, Mark::kRejected, true),
      Of(5, Mark::kOwed, true),      Of(6, Mark::kDiverged),
      Of(7, Mark::kDelivered)};
  const MarkPlan plan = PlanMarks(marks);
  EXPECT_EQ(plan.delivered, (std::vector<int64_t>{1, 7}));
  EXPECT_EQ(plan.delivered_ids, (std::vector<std::string>{"e1", "e7"}));
  EXPECT_EQ(plan.owed, (std::vector<int64_t>{4, 5}));
  EXPECT_FALSE(plan.only_deliveries);
  EXPECT_FALSE(plan.nothing());
  const MarkTally tally = TallyMarks(marks);
  EXPECT_EQ(tally.delivered, 3);
  EXPECT_EQ(tally.rejected, 2);
  EXPECT_EQ(tally.rows_deleted, 2);
}

TEST(PlanMarks, DeliveriesFromTheLogWriteNothing) {
  const MarkPlan plan =
      PlanMarks({Of(1, Mark::kDelivered, true), Of(2, Mark::kDelivered, true)});
  EXPECT_TRUE(plan.only_deliveries);
  EXPECT_TRUE(plan.nothing());
  EXPECT_TRUE(PlanMarks({}).nothing());
  const MarkPlan rows = PlanMarks({Of(1, Mark::kDelivered)});
  EXPECT_TRUE(rows.only_deliveries);
  EXPECT_FALSE(rows.nothing());
}

// A batch of events 1..n of aggregate "a" in a chain, the first after 0.
InFlight Batch(int n, bool from_log = false) {
  InFlight batch{.batch_id = 7};
  for (int seq = 1; seq <= n; ++seq) {
    batch.seqs.push_back(seq);
    batch.prev_seqs.push_back(seq - 1);
    batch.events.push_back({.event_id = "e" + std::to_string(seq),
                            .aggregate_id = "a",
                            .aggregate_type = "order"});
  }
  batch.from_log = from_log;
  return batch;
}

v1::DeliverResponse Answers(
    const std::vector<std::pair<int64_t, v1::DeliveryOutcome>>& outcomes) {
  v1::DeliverResponse response;
  response.set_batch_id(7);
  for (const auto& [seq, outcome] : outcomes) {
    v1::EventResult* r = response.add_results();
    r->set_seq(seq);
    r->set_outcome(outcome);
    if (outcome == v1::REJECTED) r->set_reason("amount: must be positive");
  }
  return response;
}

TEST(AnswerOf, EachOutcomeMakesItsMark) {
  v1::DeliverResponse response = Answers({{1, v1::APPLIED},
                                          {2, v1::DUPLICATE},
                                          {3, v1::REJECTED},
                                          {4, v1::DEFERRED},
                                          {5, v1::DIVERGED}});
  response.mutable_results(4)->set_applied_seq(9);
  const Answer answer = AnswerOf(Batch(6), response);  // 6 unanswered
  ASSERT_EQ(answer.marks.size(), 4u);
  EXPECT_EQ(answer.marks[0].kind, Mark::kDelivered);
  EXPECT_EQ(answer.marks[0].event_id, "e1");
  EXPECT_EQ(answer.marks[0].chain, OutboxChain("order", "a"));
  EXPECT_EQ(answer.marks[1].kind, Mark::kDelivered);
  EXPECT_EQ(answer.marks[2].kind, Mark::kRejected);
  EXPECT_EQ(answer.marks[2].reason, "amount: must be positive");
  EXPECT_EQ(answer.marks[2].log_fields.event_id, "e3");
  EXPECT_EQ(answer.marks[3].kind, Mark::kDiverged);
  EXPECT_EQ(answer.marks[3].seq, 5);
  EXPECT_EQ(answer.marks[3].applied_seq, 9);
  // The deferred and the unanswered rows stay pending: nothing to write.
  EXPECT_EQ(answer.unanswered,
            (std::vector<std::string>{OutboxChain("order", "a"),
                                      OutboxChain("order", "a")}));
  EXPECT_TRUE(answer.reowe.empty());
}

TEST(AnswerOf, FromTheLogAnUnansweredEventBecomesAnException) {
  const Answer answer =
      AnswerOf(Batch(3, true), Answers({{1, v1::APPLIED}, {2, v1::DEFERRED}}));
  ASSERT_EQ(answer.marks.size(), 3u);
  EXPECT_TRUE(answer.marks[0].delivered());
  EXPECT_EQ(answer.marks[1].kind, Mark::kOwed);
  EXPECT_EQ(answer.marks[2].kind, Mark::kOwed);
  for (const Mark& m : answer.marks) EXPECT_TRUE(m.from_log);
  EXPECT_TRUE(answer.unanswered.empty());
}

TEST(AnswerOf, AHeldEventWhosePredecessorTheConsumerLostIsOwedAgain) {
  v1::DeliverResponse response =
      Answers({{1, v1::APPLIED}, {2, v1::HELD}, {3, v1::HELD}});
  // 2 waits for 1, which the consumer has: a plain hold. 3 waits for 2
  // while the consumer's cursor says 0: it lost 1 and 2 after answering.
  response.mutable_results(1)->set_applied_seq(1);
  response.mutable_results(2)->set_applied_seq(0);
  const Answer answer = AnswerOf(Batch(3), response);
  ASSERT_EQ(answer.marks.size(), 3u);
  for (const Mark& m : answer.marks) EXPECT_TRUE(m.delivered());
  ASSERT_EQ(answer.reowe.size(), 1u);
  EXPECT_EQ(answer.reowe[0].chain, OutboxChain("order", "a"));
  EXPECT_EQ(answer.reowe[0].after, 0);
  EXPECT_EQ(answer.reowe[0].through, 2);
}

class MarksTest : public ::testing::Test {
 protected:
  MarksTest() : db_("marks", {OutboxSchema()}), conn_(db_.url()) {
    EXPECT_TRUE(
        TakeUpSubscription(conn_, {.subscription = "billing", .actor = "test"})
            .ok());
  }

  // An event of aggregate `aggregate`, as a mark of `kind` would carry it.
  Mark Event(const std::string& aggregate, Mark::Kind kind) {
    pqxx::work tx(conn_);
    const int64_t seq = Append(tx, aggregate);
    const std::string id =
        tx.exec_params("SELECT event_id::text FROM outbox WHERE seq = $1",
                       seq)[0][0]
            .as<std::string>();
    tx.commit();
    return {.seq = seq,
            .event_id = id,
            .chain = OutboxChain("order", aggregate),
            .kind = kind,
            .reason = "amount: must be positive"};
  }

  WrittenMarks Write(const std::vector<Mark>& marks, int max_attempts = 3) {
    pqxx::work tx(conn_);
    const WrittenMarks w = WriteMarks(tx, "billing", marks, PlanMarks(marks),
                                      {.max_attempts = max_attempts,
                                       .backoff = absl::Seconds(30),
                                       .backoff_max = absl::Seconds(60)});
    tx.commit();
    return w;
  }

  // The delivery row of `seq`: "status attempts", or "none".
  std::string Row(int64_t seq) {
    pqxx::work tx(conn_);
    const pqxx::result r = tx.exec_params(
        "SELECT status || ' ' || attempts FROM outbox_delivery WHERE "
        "subscription = 'billing' AND seq = $1",
        seq);
    return r.empty() ? "none" : r[0][0].as<std::string>();
  }

  // Seconds until the row of `seq` is claimed again.
  double BackoffOf(int64_t seq) {
    return db_.Scalar(absl::StrCat(
        "SELECT extract(epoch FROM available_at - now())::bigint FROM "
        "outbox_delivery WHERE subscription = 'billing' AND seq = ",
        seq));
  }

  testing::TestDatabase db_;
  pqxx::connection conn_;
};

TEST_F(MarksTest, ADeliveredRowGoesOnlyWhileItHoldsTheEventAnswered) {
  const Mark a = Event("a", Mark::kDelivered);
  Mark b = Event("b", Mark::kDelivered);
  ASSERT_EQ(Row(a.seq), "pending 0");
  ASSERT_EQ(Row(b.seq), "pending 0");
  b.event_id = "00000000-0000-0000-0000-000000000001";  // another event's
  Write({a, b});
  EXPECT_EQ(Row(a.seq), "none");
  EXPECT_EQ(Row(b.seq), "pending 0");
}

TEST_F(MarksTest, StoredMarksAreCommittedAndAFailureIsReturnedNotThrown) {
  const Mark delivered = Event("a", Mark::kDelivered);
  const Mark rejected = Event("b", Mark::kRejected);
  const RejectPolicy policy{.max_attempts = 3};
  // Deliveries alone: one statement in autocommit.
  absl::StatusOr<WrittenMarks> w =
      StoreMarks(conn_, "billing", {delivered}, PlanMarks({delivered}), policy);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Row(delivered.seq), "none");
  // With a rejection: one transaction.
  const Mark again = Event("c", Mark::kDelivered);
  const std::vector<Mark> both = {again, rejected};
  w = StoreMarks(conn_, "billing", both, PlanMarks(both), policy);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Row(again.seq), "none");
  EXPECT_EQ(Row(rejected.seq), "pending 1");
  // A lost connection is a status for the caller to act on.
  pqxx::connection lost(db_.url());
  db_.Exec(
      absl::StrCat("SELECT pg_terminate_backend(", lost.backendpid(), ")"));
  w = StoreMarks(lost, "billing", both, PlanMarks(both), policy);
  EXPECT_FALSE(w.ok());
  EXPECT_EQ(Row(rejected.seq), "pending 1");
}

TEST_F(MarksTest, ARejectionBacksOffAndTheLastAttemptMakesADeadLetter) {
  const Mark m = Event("a", Mark::kRejected);
  EXPECT_EQ(Write({m}, 2).dead, 0);
  EXPECT_EQ(Row(m.seq), "pending 1");
  // 30 s, jittered down to half (policy.h RandomJitter), whole seconds.
  EXPECT_GE(BackoffOf(m.seq), 14);
  EXPECT_LE(BackoffOf(m.seq), 31);
  EXPECT_EQ(Write({m}, 2).dead, 1);
  EXPECT_EQ(Row(m.seq), "dead 2");
  // A dead letter is not marked again.
  EXPECT_EQ(Write({m}, 2).dead, 0);
  EXPECT_EQ(Row(m.seq), "dead 2");
}

TEST_F(MarksTest, ADivergenceWaitsForAnOperatorWithNoAttemptCounted) {
  Mark first = Event("a", Mark::kDiverged);
  first.reason = "chain broken: the consumer has applied 9";
  first.applied_seq = 9;
  EXPECT_EQ(Write({first}).diverged, 1);
  EXPECT_EQ(Row(first.seq), "diverged 0");
  Mark second = Event("a", Mark::kDiverged);
  second.reason = first.reason;
  EXPECT_EQ(Write({second}).diverged, 0);  // the aggregate's is open
  EXPECT_EQ(Row(second.seq), "diverged 0");
  pqxx::work tx(conn_);
  EXPECT_EQ(OpenDivergences(tx, "billing"), 1);
}

// Rejections and divergences of many rows are written in one flush, each
// kind in one statement: every row its mark, one divergence per aggregate,
// nothing for a row that holds another event now.
TEST_F(MarksTest, ManyRejectionsAndDivergencesInOneFlush) {
  std::vector<Mark> marks;
  for (int i = 0; i < 20; ++i) {
    marks.push_back(Event("r" + std::to_string(i), Mark::kRejected));
  }
  for (const char* aggregate : {"x", "x", "y"}) {
    Mark m = Event(aggregate, Mark::kDiverged);
    m.reason = "chain broken: the consumer has applied 9";
    marks.push_back(m);
  }
  Mark other = Event("z", Mark::kRejected);
  other.event_id = "00000000-0000-0000-0000-000000000001";  // another event's
  marks.push_back(other);
  const WrittenMarks w = Write(marks, 1);  // one attempt: dead at once
  EXPECT_EQ(w.dead, 20);
  EXPECT_EQ(w.diverged, 2);  // x's first, and y's
  for (int i = 0; i < 20; ++i) EXPECT_EQ(Row(marks[i].seq), "dead 1");
  for (int i = 20; i < 23; ++i) EXPECT_EQ(Row(marks[i].seq), "diverged 0");
  EXPECT_EQ(Row(other.seq), "pending 0");
  pqxx::work tx(conn_);
  EXPECT_EQ(OpenDivergences(tx, "billing"), 2);
}

// A consumer's reason may hold any bytes: a NUL, bytes that are no UTF-8,
// a multi-byte character where it is cut. PostgreSQL's text takes none of
// them, and a flush that failed on one would fail again on every retry, the
// relay's marks stopped for good. What is stored is valid text, cut short.
TEST_F(MarksTest, AnyBytesOfAReasonAreStoredAsValidText) {
  Mark m = Event("a", Mark::kRejected);
  m.reason = std::string("bad\0answer \xFF\xC3 ", 15);
  for (int i = 0; i < 1500; ++i) m.reason += "\xC3\xA9";  // 3000 bytes of é
  Mark d = Event("b", Mark::kDiverged);
  d.reason = m.reason;
  const WrittenMarks w = Write({m, d});
  EXPECT_EQ(Row(m.seq), "pending 1");
  EXPECT_EQ(Row(d.seq), "diverged 0");
  EXPECT_EQ(w.diverged, 1);
  const std::string stored =
      db_.Query(absl::StrCat("SELECT last_error FROM outbox_delivery WHERE "
                             "subscription = 'billing' AND seq = ",
                             m.seq))[0][0]
          .as<std::string>();
  EXPECT_LE(stored.size(), 2000u);
  EXPECT_EQ(stored.substr(0, 3), "bad");
  EXPECT_EQ(stored.substr(3, 3), "\xEF\xBF\xBD");  // the NUL
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_divergences WHERE "
                       "detail LIKE 'bad%' AND octet_length(detail) <= 2000"),
            1);
}

TEST_F(MarksTest, AnEventFromTheLogNotDeliveredBecomesAnException) {
  ASSERT_TRUE(EnsureLogDelivery(conn_, "billing", true).ok());
  Mark delivered = Event("a", Mark::kDelivered);
  Mark rejected = Event("b", Mark::kRejected);
  Mark unanswered = Event("c", Mark::kOwed);
  for (Mark* m : {&delivered, &rejected, &unanswered}) {
    m->from_log = true;
    ASSERT_EQ(Row(m->seq), "none");  // on the log: no row per event
  }
  Write({delivered, rejected, unanswered});
  EXPECT_EQ(Row(delivered.seq), "none");
  EXPECT_EQ(Row(rejected.seq), "pending 1");
  EXPECT_EQ(Row(unanswered.seq), "pending 0");
}

}  // namespace
}  // namespace outbox::relay
