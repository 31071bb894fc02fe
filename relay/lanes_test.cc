#include "relay/lanes.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "relay/lane_testing.h"

namespace outbox::relay {
namespace {

Lanes NewLanes(int count) {
  return Lanes(
      count,
      Backoff(absl::Milliseconds(100), absl::Seconds(5), [] { return 1.0; }),
      {.batch_size = 2, .window = 4, .pipeline_depth = 2});
}

std::vector<int> Indexes(const std::vector<Lane*>& lanes) {
  std::vector<int> out;
  for (const Lane* lane : lanes) out.push_back(lane->index());
  return out;
}

TEST(Lanes, OneOpenLaneCarriesALightLoad) {
  FakeSink sink;
  Lanes lanes = NewLanes(3);
  EXPECT_TRUE(lanes.Serving().empty());  // none is open yet
  EXPECT_FALSE(lanes.connected());
  lanes.Open(
      sink, [] {}, kT0);
  ASSERT_EQ(sink.opened, 3);
  EXPECT_TRUE(lanes.connected());
  EXPECT_EQ(Indexes(lanes.Serving()), (std::vector<int>{0}));
  // Its stream broke: the next open one carries it.
  sink.wires[0]->broken = true;
  EXPECT_FALSE(lanes.connected());
  EXPECT_EQ(Indexes(lanes.Serving()), (std::vector<int>{1}));
}

TEST(Lanes, ALightLoadStaysOnTheLaneThatCarriesIt) {
  FakeSink sink;
  Lanes lanes = NewLanes(2);
  lanes.Open(
      sink, [] {}, kT0);
  sink.wires[0]->broken = true;
  ASSERT_EQ(Indexes(lanes.Serving()), (std::vector<int>{1}));
  // Lane 0 connects again: the load stays on lane 1, which may have a
  // batch awaiting its answer that a batch on lane 0 would pass.
  (*lanes.begin()).Drop(kT0);
  lanes.Open(
      sink, [] {}, kT0 + absl::Seconds(10));
  ASSERT_TRUE(lanes.connected());
  EXPECT_EQ(Indexes(lanes.Serving()), (std::vector<int>{1}));
}

TEST(Lanes, ABacklogSpreadsOverEveryOpenLaneUntilWorkedOff) {
  FakeSink sink;
  Lanes lanes = NewLanes(3);
  lanes.Open(
      sink, [] {}, kT0);
  sink.wires[2]->broken = true;
  ASSERT_EQ(Indexes(lanes.Serving()), (std::vector<int>{0}));
  EXPECT_FALSE(lanes.EndRound(/*ran=*/true, /*full=*/false));
  // A claim filled its batch: a backlog.
  EXPECT_TRUE(lanes.EndRound(/*ran=*/true, /*full=*/true));
  EXPECT_TRUE(lanes.spread());
  EXPECT_EQ(Indexes(lanes.Serving()), (std::vector<int>{0, 1}));
  // No claim ran (every lane waited): nothing is learnt.
  EXPECT_FALSE(lanes.EndRound(/*ran=*/false, /*full=*/false));
  EXPECT_TRUE(lanes.spread());
  // A full batch still in flight keeps the backlog.
  auto it = lanes.begin();
  ++it;
  it->Send(Batch(1, {1, 2}, /*full=*/true), Request(1), std::nullopt, kT0);
  EXPECT_FALSE(lanes.EndRound(/*ran=*/true, /*full=*/false));
  EXPECT_TRUE(lanes.spread());
  // Answered, and the next claim filled nothing: worked off.
  sink.wires[1]->answers = {Response(1)};
  ASSERT_TRUE(it->NextAnswer().has_value());
  EXPECT_TRUE(lanes.EndRound(/*ran=*/true, /*full=*/false));
  EXPECT_FALSE(lanes.spread());
  EXPECT_EQ(Indexes(lanes.Serving()), (std::vector<int>{0}));
}

TEST(Lanes, AChangeOfTheServingLanesRestartsEveryClaim) {
  FakeSink sink;
  Lanes lanes = NewLanes(2);
  lanes.Open(
      sink, [] {}, kT0);
  lanes.Serving();
  for (Lane& lane : lanes) lane.cursor.next_full_claim = kT0;
  lanes.Serving();  // the same lanes: the claims go on where they were
  for (const Lane& lane : lanes) EXPECT_EQ(lane.cursor.next_full_claim, kT0);
  lanes.EndRound(/*ran=*/true, /*full=*/true);
  lanes.Serving();  // both now: each takes partitions it did not have
  for (const Lane& lane : lanes) {
    EXPECT_EQ(lane.cursor.next_full_claim, absl::InfinitePast());
  }
  for (Lane& lane : lanes) lane.cursor.sent_through = 40;
  lanes.RestartClaims();
  for (const Lane& lane : lanes) EXPECT_EQ(lane.cursor.sent_through, 0);
}

TEST(Lanes, EveryServingLaneWaitsOnlyWhenNoneMayClaim) {
  FakeSink sink;
  Lanes lanes = NewLanes(2);
  EXPECT_FALSE(lanes.AllWait({}));  // no lane serves: nothing to wait for
  lanes.Open(
      sink, [] {}, kT0);
  lanes.EndRound(/*ran=*/true, /*full=*/true);
  const std::vector<Lane*> serving = lanes.Serving();
  ASSERT_EQ(serving.size(), 2u);
  EXPECT_EQ(lanes.Limit(*serving[0]), 2);  // the batch size
  // One small batch out: that lane waits for its answer.
  serving[0]->Send(Batch(1, {1}), Request(1), std::nullopt, kT0);
  EXPECT_EQ(lanes.Limit(*serving[0]), 0);
  EXPECT_FALSE(lanes.AllWait(serving));
  // Behind a full batch a second may go (pipeline depth 2), up to the
  // window of 4 events.
  serving[1]->Send(Batch(2, {2, 3}, /*full=*/true), Request(2), std::nullopt,
                   kT0);
  EXPECT_EQ(lanes.Limit(*serving[1]), 2);
  serving[1]->Send(Batch(3, {4, 5}, /*full=*/true), Request(3), std::nullopt,
                   kT0);
  EXPECT_EQ(lanes.Limit(*serving[1]), 0);
  EXPECT_TRUE(lanes.AllWait(serving));
  EXPECT_EQ(lanes.events_in_flight(), 5);
  std::set<int> partitions;
  lanes.PartitionsInFlight(&partitions);
  EXPECT_EQ(partitions, (std::set<int>{1, 2, 3}));
}

TEST(Lanes, HeldBatchesGoOnEveryLaneOnceTheStandbysFlushed) {
  FakeSink sink;
  Lanes lanes = NewLanes(2);
  lanes.Open(
      sink, [] {}, kT0);
  auto it = lanes.begin();
  it->Send(Batch(1, {1}), Request(1), 100, kT0);
  ++it;
  it->Send(Batch(2, {2}), Request(2), 200, kT0);
  EXPECT_TRUE(lanes.holding());
  EXPECT_EQ(lanes.Release(150, kT0), 1);
  EXPECT_TRUE(lanes.holding());
  EXPECT_EQ(lanes.Release(200, kT0), 1);
  EXPECT_FALSE(lanes.holding());
  EXPECT_EQ(sink.wires[0]->sent, (std::vector<uint64_t>{1}));
  EXPECT_EQ(sink.wires[1]->sent, (std::vector<uint64_t>{2}));
}

TEST(Lanes, ForgettingTheInboxHighReachesEveryBatchInFlight) {
  FakeSink sink;
  Lanes lanes = NewLanes(2);
  lanes.Open(
      sink, [] {}, kT0);
  uint64_t id = 1;
  for (Lane& lane : lanes) {
    InFlight b = Batch(id, {static_cast<int64_t>(id)});
    b.inbox_high_at_send = 50;
    lane.Send(std::move(b), Request(id), std::nullopt, kT0);
    ++id;
  }
  lanes.ForgetInboxHigh();
  for (Lane& lane : lanes) {
    for (const auto& [batch_id, b] : lane.batches()) {
      EXPECT_EQ(b.inbox_high_at_send, 0) << batch_id;
    }
  }
}

TEST(Lanes, ClosingCountsWhatWasUnanswered) {
  FakeSink sink;
  Lanes lanes = NewLanes(2);
  lanes.Open(
      sink, [] {}, kT0);
  lanes.begin()->Send(Batch(1, {1, 2}), Request(1), std::nullopt, kT0);
  EXPECT_EQ(lanes.Close(absl::Milliseconds(10)), 2);
  EXPECT_TRUE(sink.wires[0]->cancelled);
  // The idle lane was half-closed first, for a clean end.
  EXPECT_TRUE(sink.wires[1]->half_closed);
  EXPECT_FALSE(lanes.connected());
  EXPECT_EQ(lanes.Close(absl::Milliseconds(10)), 0);
}

}  // namespace
}  // namespace outbox::relay
