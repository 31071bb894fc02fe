#include "relay/policy.h"

#include <gtest/gtest.h>

#include <set>

namespace outbox::relay {
namespace {

TEST(Backoff, DoublesUpToTheCapWithJitterAndResets) {
  Backoff b(absl::Milliseconds(100), absl::Milliseconds(500),
            [] { return 0.5; });
  EXPECT_EQ(b.Next(), absl::Milliseconds(50));
  EXPECT_EQ(b.Next(), absl::Milliseconds(100));
  EXPECT_EQ(b.Next(), absl::Milliseconds(200));
  EXPECT_EQ(b.Next(), absl::Milliseconds(250));  // capped at 500, halved
  EXPECT_EQ(b.Next(), absl::Milliseconds(250));
  b.Reset();
  EXPECT_EQ(b.Next(), absl::Milliseconds(50));
}

TEST(Backoff, RealJitterStaysWithinHalfAndWhole) {
  Backoff b(absl::Seconds(1), absl::Seconds(1));
  for (int i = 0; i < 1000; ++i) {
    const absl::Duration d = b.Next();
    EXPECT_GE(d, absl::Milliseconds(500));
    EXPECT_LT(d, absl::Seconds(1));
  }
}

TEST(Backoff, ACapBelowTheStartIsTheStart) {
  Backoff b(absl::Seconds(2), absl::Seconds(1), [] { return 1.0; });
  EXPECT_EQ(b.Next(), absl::Seconds(2));
  EXPECT_EQ(b.Next(), absl::Seconds(2));
}

TEST(RetryDelay, DoublesFromTheFirstFailureUpToTheCapTimesTheJitter) {
  const absl::Duration i = absl::Milliseconds(500), max = absl::Seconds(3);
  EXPECT_EQ(RetryDelay(i, max, 1, 1.0), absl::Milliseconds(500));
  EXPECT_EQ(RetryDelay(i, max, 2, 1.0), absl::Seconds(1));
  EXPECT_EQ(RetryDelay(i, max, 3, 0.5), absl::Seconds(1));
  EXPECT_EQ(RetryDelay(i, max, 4, 1.0), absl::Seconds(3));  // capped
  EXPECT_EQ(RetryDelay(i, max, 1000000, 0.5), absl::Milliseconds(1500));
  EXPECT_EQ(RetryDelay(i, absl::ZeroDuration(), 5, 1.0), i);  // cap < start
  EXPECT_EQ(RetryDelay(i, max, 0, 1.0), i);                   // as the first
}

TEST(RetryDelays, TheNthIsTheWaitAfterTheNthFailureEachWithItsJitter) {
  double j = 0.5;
  const std::vector<absl::Duration> d =
      RetryDelays(absl::Seconds(1), absl::Seconds(10), 5, [&] {
        const double out = j;
        j = j == 0.5 ? 0.75 : 0.5;
        return out;
      });
  ASSERT_EQ(d.size(), 5u);
  EXPECT_EQ(d[0], absl::Milliseconds(500));   // 1 s * 0.5
  EXPECT_EQ(d[1], absl::Milliseconds(1500));  // 2 s * 0.75
  EXPECT_EQ(d[2], absl::Seconds(2));          // 4 s * 0.5
  EXPECT_EQ(d[3], absl::Seconds(6));          // 8 s * 0.75
  EXPECT_EQ(d[4], absl::Seconds(5));          // capped at 10 s, * 0.5
  EXPECT_TRUE(
      RetryDelays(absl::Seconds(1), absl::Seconds(2), 0, RandomJitter).empty());
}

TEST(PartitionTarget, EveryPartitionIsOwnedWhateverTheReplicas) {
  for (int members = 1; members <= 70; ++members) {
    const size_t t = PartitionTarget(64, members);
    EXPECT_GE(t * members, 64u) << members;
    EXPECT_LT((t - 1) * members, 64u) << members;  // no more than needed
  }
  EXPECT_EQ(PartitionTarget(64, 0), 64u);  // no member seen: take them all
  EXPECT_EQ(PartitionTarget(64, 3), 22u);
}

TEST(PartitionsToRelease, TheHighestBeyondTheTarget) {
  const std::set<int> owned = {1, 5, 9, 12, 40};
  EXPECT_EQ(PartitionsToRelease(owned, 3), (std::set<int>{12, 40}));
  EXPECT_TRUE(PartitionsToRelease(owned, 5).empty());
  EXPECT_TRUE(PartitionsToRelease(owned, 9).empty());
  EXPECT_EQ(PartitionsToRelease(owned, 0), owned);
}

TEST(AcquireOrder, EveryPartitionOnceStartingAtTheMemberKey) {
  const std::vector<int> order = AcquireOrder(8, 13);
  EXPECT_EQ(order, (std::vector<int>{5, 6, 7, 0, 1, 2, 3, 4}));
  EXPECT_EQ(AcquireOrder(8, -3).front(), 5);
  EXPECT_TRUE(AcquireOrder(0, 1).empty());
}

TEST(LanePartitions, EachPartitionOnOneLaneAndNoneBeingReleased) {
  std::set<int> owned;
  for (int p = 0; p < 64; ++p) owned.insert(p);
  const std::set<int> releasing = {3, 60};
  std::set<int> seen;
  for (int lane = 0; lane < 3; ++lane) {
    for (int p : LanePartitions(owned, releasing, lane, 3)) {
      EXPECT_EQ(p % 3, lane);
      EXPECT_TRUE(seen.insert(p).second) << p << " on two lanes";
    }
  }
  EXPECT_EQ(seen.size(), 62u);
  EXPECT_FALSE(seen.count(3));
  EXPECT_FALSE(seen.count(60));
}

TEST(ClaimLimit, BatchSizeWithinTheWindowAndThePipeline) {
  EXPECT_EQ(ClaimLimit(256, 2048, 2, 0, 0, true), 256);
  EXPECT_EQ(ClaimLimit(256, 2048, 2, 1900, 1, true),
            148);  // what the window has left
  EXPECT_EQ(ClaimLimit(256, 2048, 2, 2048, 1, true), 0);  // window full
  EXPECT_EQ(ClaimLimit(256, 2048, 2, 10, 2, true), 0);    // pipeline full
  EXPECT_EQ(ClaimLimit(256, 100, 8, 150, 1, true), 0);    // over the window
}

TEST(ClaimLimit, ASecondBatchOnlyBehindFullOnes) {
  EXPECT_EQ(ClaimLimit(256, 2048, 2, 0, 0, false), 256);   // nothing in flight
  EXPECT_EQ(ClaimLimit(256, 2048, 2, 10, 1, false), 0);    // behind a small one
  EXPECT_EQ(ClaimLimit(256, 2048, 2, 256, 1, true), 256);  // behind a full one
}

TEST(ClaimAboveSent, OnlyBehindABacklogAndNeverPastAFreedAggregate) {
  const ClaimStart backlog{.outstanding = 512,
                           .batch_size = 256,
                           .sent_through = 900,
                           .full_claim_due = false};
  EXPECT_TRUE(ClaimAboveSent(backlog));
  // Fewer out than a batch: from the start costs little and sees all.
  ClaimStart c = backlog;
  c.outstanding = 255;
  EXPECT_FALSE(ClaimAboveSent(c));
  // Nothing sent yet on this stream, or the poll's full claim is due.
  c = backlog;
  c.sent_through = 0;
  EXPECT_FALSE(ClaimAboveSent(c));
  c = backlog;
  c.full_claim_due = true;
  EXPECT_FALSE(ClaimAboveSent(c));
  // Rows passed over: above is fine until one of their aggregates is freed.
  c = backlog;
  c.passed_over = true;
  EXPECT_TRUE(ClaimAboveSent(c));
  c.freed_since = true;
  EXPECT_FALSE(ClaimAboveSent(c));
  // A freed aggregate matters only if rows were passed over.
  c.passed_over = false;
  EXPECT_TRUE(ClaimAboveSent(c));
}

}  // namespace
}  // namespace outbox::relay
