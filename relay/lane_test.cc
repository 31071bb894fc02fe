#include "relay/lane.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "relay/lane_testing.h"

namespace outbox::relay {
namespace {

Lane NewLane() {
  return Lane(0, Backoff(absl::Milliseconds(100), absl::Seconds(5),
                         [] { return 1.0; }));
}

TEST(Lane, AnAnswerTakesItsBatchOutOfFlight) {
  FakeSink sink;
  Lane lane = NewLane();
  lane.Open(
      sink, [] {}, kT0);
  ASSERT_TRUE(lane.connected());
  lane.Send(Batch(1, {10, 11}), Request(1), std::nullopt, kT0);
  lane.Send(Batch(2, {12}), Request(2), std::nullopt, kT0);
  EXPECT_EQ(sink.wire->sent, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(lane.events_in_flight(), 3u);

  sink.wire->answers = {Response(2), Response(7)};
  std::optional<Lane::Answered> a = lane.NextAnswer();
  ASSERT_TRUE(a.has_value());
  ASSERT_TRUE(a->batch.has_value());
  EXPECT_EQ(a->batch->seqs, (std::vector<int64_t>{12}));
  EXPECT_EQ(lane.events_in_flight(), 2u);
  // An answer to no batch of this lane takes nothing out.
  a = lane.NextAnswer();
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->response.batch_id(), 7u);
  EXPECT_FALSE(a->batch.has_value());
  EXPECT_EQ(lane.events_in_flight(), 2u);
  EXPECT_FALSE(lane.NextAnswer().has_value());
  EXPECT_FALSE(lane.idle());
}

TEST(Lane, AnswersComeOneAtATimeSoThatWhatOneTeachesReachesTheRest) {
  FakeSink sink;
  Lane lane = NewLane();
  lane.Open(
      sink, [] {}, kT0);
  lane.Send(Batch(1, {1}), Request(1), std::nullopt, kT0);
  lane.Send(Batch(2, {2}), Request(2), std::nullopt, kT0);
  for (auto& [id, b] : lane.batches()) b.inbox_high_at_send = 50;
  sink.wire->answers = {Response(1), Response(2)};
  std::optional<Lane::Answered> a = lane.NextAnswer();
  ASSERT_TRUE(a.has_value() && a->batch.has_value());
  // The first answer showed the consumer's inbox went back: the batch
  // still in flight must not be judged by the number it was sent at.
  for (auto& [id, b] : lane.batches()) b.inbox_high_at_send = 0;
  a = lane.NextAnswer();
  ASSERT_TRUE(a.has_value() && a->batch.has_value());
  EXPECT_EQ(a->batch->inbox_high_at_send, 0);
}

TEST(Lane, AnEventReadAgainIsInFlightTwiceUntilBothAreAnswered) {
  FakeSink sink;
  Lane lane = NewLane();
  lane.Open(
      sink, [] {}, kT0);
  lane.Send(Batch(1, {5, 6}), Request(1), std::nullopt, kT0);
  lane.Send(Batch(2, {5, 6, 7}), Request(2), std::nullopt, kT0);
  EXPECT_EQ(lane.events_in_flight(), 5u);
  sink.wire->answers = {Response(1)};
  ASSERT_TRUE(lane.NextAnswer().has_value());
  EXPECT_EQ(lane.events_in_flight(), 3u);
  sink.wire->answers = {Response(2)};
  ASSERT_TRUE(lane.NextAnswer().has_value());
  EXPECT_EQ(lane.events_in_flight(), 0u);
  EXPECT_TRUE(lane.idle());
}

TEST(Lane, TheFenceHoldsBatchesUntilTheStandbysFlushedThem) {
  FakeSink sink;
  Lane lane = NewLane();
  lane.Open(
      sink, [] {}, kT0);
  lane.Send(Batch(1, {1}), Request(1), 100, kT0);
  lane.Send(Batch(2, {2}), Request(2), 200, kT0);
  EXPECT_TRUE(sink.wire->sent.empty());
  EXPECT_TRUE(lane.holding());
  EXPECT_EQ(lane.events_in_flight(), 2u);
  // Held is not sent: no answer is overdue.
  EXPECT_FALSE(lane.Overdue(kT0 + absl::Hours(1), absl::Seconds(15)));
  // An answer to a batch not sent yet answers nothing.
  sink.wire->answers = {Response(2)};
  std::optional<Lane::Answered> early = lane.NextAnswer();
  ASSERT_TRUE(early.has_value());
  EXPECT_FALSE(early->batch.has_value());
  EXPECT_EQ(lane.events_in_flight(), 2u);
  EXPECT_EQ(lane.Release(99, kT0), 0);
  EXPECT_EQ(lane.Release(150, kT0 + absl::Seconds(1)), 1);
  EXPECT_EQ(sink.wire->sent, (std::vector<uint64_t>{1}));
  EXPECT_TRUE(lane.holding());
  EXPECT_FALSE(lane.Overdue(kT0 + absl::Seconds(16), absl::Seconds(15)));
  EXPECT_TRUE(lane.Overdue(kT0 + absl::Seconds(17), absl::Seconds(15)));
  EXPECT_EQ(lane.Release(200, kT0 + absl::Seconds(2)), 1);
  EXPECT_EQ(sink.wire->sent, (std::vector<uint64_t>{1, 2}));
  EXPECT_FALSE(lane.holding());
}

TEST(Lane, ADropReturnsEverythingInFlightAndBacksOff) {
  FakeSink sink;
  Lane lane = NewLane();
  lane.Open(
      sink, [] {}, kT0);
  std::shared_ptr<Wire> first = sink.wire;
  lane.Send(Batch(1, {1, 2}), Request(1), std::nullopt, kT0);
  lane.Send(Batch(2, {3}), Request(2), 500, kT0);  // held by the fence
  first->answers = {Response(1)};                  // arrives too late
  first->broken = true;
  EXPECT_FALSE(lane.connected());
  EXPECT_EQ(lane.broken(), "cut");

  std::vector<InFlight> lost = lane.Drop(kT0);
  ASSERT_EQ(lost.size(), 2u);
  EXPECT_TRUE(first->cancelled);
  EXPECT_FALSE(lane.has_stream());
  EXPECT_EQ(lane.events_in_flight(), 0u);
  EXPECT_FALSE(lane.holding());
  EXPECT_FALSE(lane.NextAnswer().has_value());
  // The next stream waits for the backoff (100 ms with this jitter).
  lane.Open(
      sink, [] {}, kT0 + absl::Milliseconds(99));
  EXPECT_EQ(sink.opened, 1);
  lane.Open(
      sink, [] {}, kT0 + absl::Milliseconds(100));
  EXPECT_EQ(sink.opened, 2);
  EXPECT_TRUE(lane.connected());
}

TEST(Lane, OpensOnlyOnAReadySink) {
  FakeSink sink;
  Lane lane = NewLane();
  sink.readiness_ = Sink::Readiness::kConnecting;
  lane.Open(
      sink, [] {}, kT0);
  EXPECT_FALSE(lane.has_stream());
  sink.readiness_ = Sink::Readiness::kFailing;  // backs off
  lane.Open(
      sink, [] {}, kT0);
  sink.readiness_ = Sink::Readiness::kReady;
  lane.Open(
      sink, [] {}, kT0 + absl::Milliseconds(50));
  EXPECT_FALSE(lane.has_stream());
  lane.Open(
      sink, [] {}, kT0 + absl::Milliseconds(100));
  EXPECT_TRUE(lane.has_stream());
  lane.Open(
      sink, [] {}, kT0 + absl::Seconds(1));  // one is open already
  EXPECT_EQ(sink.opened, 1);
}

TEST(Lane, ClaimsWaitForAnswersPastOneBatchUnlessEveryBatchWasFull) {
  FakeSink sink;
  Lane lane = NewLane();
  lane.Open(
      sink, [] {}, kT0);
  EXPECT_EQ(lane.Limit(256, 2048, 2), 256);
  lane.Send(Batch(1, {1, 2, 3}), Request(1), std::nullopt, kT0);
  EXPECT_EQ(lane.Limit(256, 2048, 2), 0);  // a small batch: one at a time
  sink.wire->answers = {Response(1)};
  ASSERT_TRUE(lane.NextAnswer().has_value());
  lane.Send(Batch(2, {4, 5}, /*full=*/true), Request(2), std::nullopt, kT0);
  EXPECT_TRUE(lane.any_full());
  EXPECT_EQ(lane.Limit(256, 2048, 2), 256);  // a backlog: pipelined
  EXPECT_EQ(lane.Limit(256, 3, 2), 1);       // within the window
  lane.Send(Batch(3, {6}, /*full=*/true), Request(3), std::nullopt, kT0);
  EXPECT_EQ(lane.Limit(256, 2048, 2), 0);  // the pipeline is full
}

TEST(Lane, CloseEndsAnIdleStreamCleanly) {
  FakeSink sink;
  Lane lane = NewLane();
  lane.Open(
      sink, [] {}, kT0);
  std::shared_ptr<Wire> wire = sink.wire;
  lane.Close(absl::Milliseconds(500));
  EXPECT_TRUE(wire->half_closed);
  EXPECT_TRUE(wire->cancelled);
  EXPECT_FALSE(lane.has_stream());

  lane.Open(
      sink, [] {}, kT0);
  wire = sink.wire;
  lane.Send(Batch(1, {1}), Request(1), std::nullopt, kT0);
  lane.Close(absl::Milliseconds(500));  // unanswered: cancelled, no wait
  EXPECT_FALSE(wire->half_closed);
  EXPECT_TRUE(wire->cancelled);
}

}  // namespace
}  // namespace outbox::relay
