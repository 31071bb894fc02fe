// What lies between an event going out and its mark: which chains stay
// busy, which marks may ride with a claim, and what writing them settles.

#include "relay/settlement.h"

#include <gtest/gtest.h>

#include "relay/delivery_store.h"

namespace outbox::relay {
namespace {

const std::string kA = OutboxChain("order", "a");
const std::string kB = OutboxChain("order", "b");

// A batch of `chains`' events (one each, seqs from `seq`), all sent.
BuiltBatch Batch(const std::vector<std::string>& ids, int64_t seq,
                 bool from_log = false) {
  BuiltBatch built;
  built.batch.from_log = from_log;
  for (const std::string& id : ids) {
    EventLogFields e{.aggregate_id = id, .seq = seq, .aggregate_type = "order"};
    built.batch.seqs.push_back(seq++);
    built.batch.events.push_back(e);
    built.busy.push_back(OutboxChain("order", id));
  }
  return built;
}

Mark MarkOf(const std::string& chain, int64_t seq, Mark::Kind kind,
            bool from_log = false) {
  return {.seq = seq,
          .event_id = "e" + std::to_string(seq),
          .chain = chain,
          .kind = kind,
          .from_log = from_log};
}

TEST(Settlement, AChainStaysBusyUntilEachOfItsEventsIsMarkedOrDropped) {
  Settlement s;
  s.Sent(Batch({"a", "a", "b"}, 1));
  EXPECT_TRUE(s.busy().busy(kA));
  EXPECT_TRUE(s.busy().busy(kB));

  // a's first event answered, its second left unanswered; b answered.
  Answer answer;
  answer.marks = {MarkOf(kA, 1, Mark::kDelivered),
                  MarkOf(kB, 3, Mark::kDelivered)};
  answer.unanswered = {kA};
  s.Answered(std::move(answer));
  EXPECT_TRUE(s.busy().busy(kA));  // its answered event is not marked yet
  EXPECT_EQ(s.busy().events(kA), 1);
  EXPECT_FALSE(s.settled());

  const Settled settled = s.Written({});
  EXPECT_TRUE(s.settled());
  EXPECT_FALSE(s.busy().busy(kA));
  EXPECT_FALSE(s.busy().busy(kB));
  EXPECT_EQ(settled.tally.delivered, 2);
  EXPECT_EQ(settled.tally.rows_deleted, 2);
  EXPECT_TRUE(settled.from_log.empty());
}

TEST(Settlement, OnlyDeliveriesRideWithAClaim) {
  Settlement s;
  EXPECT_TRUE(s.RideWithClaim());  // nothing to write
  EXPECT_TRUE(s.Riding().empty());
  s.Sent(Batch({"a", "a", "b"}, 1));
  Answer answer;
  answer.marks = {MarkOf(kA, 1, Mark::kDelivered),
                  MarkOf(kA, 2, Mark::kDelivered),
                  MarkOf(kB, 3, Mark::kDelivered)};
  s.Answered(std::move(answer));
  EXPECT_TRUE(s.RideWithClaim());
  EXPECT_EQ(s.Riding(), (std::map<std::string, int>{{kA, 2}, {kB, 1}}));
  // With those marks riding, the claim finds no chain busy.
  EXPECT_TRUE(s.busy().BusyAfter(s.Riding()).empty());

  s.Sent(Batch({"c"}, 4));
  Answer rejected;
  rejected.marks = {MarkOf(OutboxChain("order", "c"), 4, Mark::kRejected)};
  s.Answered(std::move(rejected));
  EXPECT_FALSE(s.RideWithClaim());  // a rejection needs its transaction
  EXPECT_TRUE(s.Riding().empty());

  const Settled settled = s.Written({.dead = 1});
  EXPECT_EQ(settled.tally.delivered, 3);
  EXPECT_EQ(settled.tally.rejected, 1);
  EXPECT_EQ(settled.written.dead, 1);
  EXPECT_EQ(s.busy().size(), 0u);
}

TEST(Settlement, MarksOfEventsFromTheLogSettleTheirSeqsAndDeleteNoRow) {
  Settlement s;
  BuiltBatch built = Batch({"a", "b"}, 7, /*from_log=*/true);
  // b's event could not go: owed as an exception at once.
  built.marks = {MarkOf(kB, 8, Mark::kOwed, /*from_log=*/true)};
  s.Sent(built);
  Answer answer;
  answer.marks = {MarkOf(kA, 7, Mark::kDelivered, /*from_log=*/true)};
  s.Answered(std::move(answer));
  EXPECT_FALSE(s.RideWithClaim());  // the owed one becomes a row first

  const Settled settled = s.Written({});
  EXPECT_EQ(settled.from_log, (std::vector<int64_t>{8, 7}));
  EXPECT_EQ(settled.tally.delivered, 1);
  EXPECT_EQ(settled.tally.rows_deleted, 0);
  EXPECT_EQ(s.busy().size(), 0u);
}

TEST(Settlement, ADroppedBatchFreesItsChainsAndKeepsTheAnsweredMarks) {
  Settlement s;
  s.Sent(Batch({"a"}, 1));
  BuiltBatch second = Batch({"a", "b"}, 2);
  s.Sent(second);
  Answer answer;
  answer.marks = {MarkOf(kA, 1, Mark::kDelivered)};
  s.Answered(std::move(answer));
  s.Dropped(second.batch);         // its stream broke: those go again
  EXPECT_TRUE(s.busy().busy(kA));  // the answered one, until marked
  EXPECT_FALSE(s.busy().busy(kB));
  EXPECT_EQ(s.marks().size(), 1u);
  s.Written({});
  EXPECT_EQ(s.busy().size(), 0u);
}

TEST(Settlement, ClearingForgetsEverythingOutAndAnswered) {
  Settlement s;
  s.Sent(Batch({"a", "b"}, 1));
  Answer answer;
  answer.marks = {MarkOf(kA, 1, Mark::kDelivered)};
  s.Answered(std::move(answer));
  const uint64_t freed = s.busy().freed();
  s.Clear();
  EXPECT_TRUE(s.settled());
  EXPECT_EQ(s.busy().size(), 0u);
  EXPECT_GT(s.busy().freed(), freed);
  // A late drop of what was cleared changes nothing.
  s.Dropped(Batch({"a"}, 1).batch);
  EXPECT_EQ(s.busy().size(), 0u);
}

TEST(SettlementDeathTest, AMarkOfAChainNeverSentBreaksTheInvariant) {
  Settlement s;
  Answer answer;
  answer.marks = {MarkOf(kA, 1, Mark::kDelivered)};
  EXPECT_DEBUG_DEATH(s.Answered(std::move(answer)), "not busy");
}

}  // namespace
}  // namespace outbox::relay
