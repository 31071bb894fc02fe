// Where a lane's claims of delivery rows start within a round and between
// rounds: above what was sent while a backlog is out, from the start
// otherwise, at least once per poll, and again once a passed-over
// aggregate is freed.

#include "relay/claim_walk.h"

#include <gtest/gtest.h>

namespace outbox::relay {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(1000);
const absl::Duration kPoll = absl::Milliseconds(500);

ClaimWalk::Start Backlog(uint64_t freed = 0) {
  // More out than a batch: a claim above what was sent is worth it.
  return {.outstanding = 1024,
          .batch_size = 512,
          .freed = freed,
          .now = kNow,
          .poll_interval = kPoll};
}

TEST(ClaimWalk, WithLittleOutARoundClaimsFromTheStartOnce) {
  ClaimCursor cursor{.sent_through = 40};
  ClaimWalk walk(&cursor, {.outstanding = 3,
                           .batch_size = 512,
                           .now = kNow,
                           .poll_interval = kPoll});
  EXPECT_FALSE(walk.fresh());
  EXPECT_EQ(walk.after(), 0);
  EXPECT_EQ(cursor.next_full_claim, kNow + kPoll);
  EXPECT_EQ(walk.Claimed(10, 55, false, 0, kNow), ClaimWalk::kBatch);
  EXPECT_EQ(walk.after(), 55);
  // Fewer rows than asked: every ready row was seen.
  EXPECT_FALSE(walk.Continue(10, 512, false, kNow));
}

TEST(ClaimWalk, ABacklogIsClaimedAboveWhatWasSentThenFromTheStart) {
  ClaimCursor cursor{.sent_through = 40, .next_full_claim = kNow + kPoll};
  ClaimWalk walk(&cursor, Backlog());
  EXPECT_TRUE(walk.fresh());
  EXPECT_EQ(walk.after(), 40);
  // A full claim: the next one continues after its last row.
  EXPECT_EQ(walk.Claimed(512, 600, false, 0, kNow), ClaimWalk::kBatch);
  EXPECT_TRUE(walk.Continue(512, 512, false, kNow));
  EXPECT_TRUE(walk.fresh());
  EXPECT_EQ(walk.after(), 600);
  // A short one: the new rows are claimed, now the passed-over ones.
  const absl::Time later = kNow + absl::Milliseconds(3);
  EXPECT_EQ(walk.Claimed(7, 610, false, 0, later), ClaimWalk::kBatch);
  EXPECT_TRUE(walk.Continue(7, 512, false, later));
  EXPECT_FALSE(walk.fresh());
  EXPECT_EQ(walk.after(), 0);
  EXPECT_EQ(cursor.next_full_claim, later + kPoll);
  // From the start, nothing more: the round is over.
  EXPECT_EQ(walk.Claimed(0, 0, false, 0, later), ClaimWalk::kDone);
}

TEST(ClaimWalk, NothingAboveWhatWasSentTurnsToTheStart) {
  ClaimCursor cursor{.sent_through = 40, .next_full_claim = kNow + kPoll};
  ClaimWalk walk(&cursor, Backlog());
  EXPECT_EQ(walk.Claimed(0, 0, false, 0, kNow), ClaimWalk::kAgain);
  EXPECT_FALSE(walk.fresh());
  EXPECT_EQ(walk.after(), 0);
}

TEST(ClaimWalk, ABatchCutAtTheByteLimitEndsTheRound) {
  ClaimCursor cursor{.sent_through = 40, .next_full_claim = kNow + kPoll};
  ClaimWalk walk(&cursor, Backlog());
  EXPECT_EQ(walk.Claimed(300, 340, false, 0, kNow), ClaimWalk::kBatch);
  EXPECT_FALSE(walk.Continue(300, 512, /*cut=*/true, kNow));
}

TEST(ClaimWalk, AClaimFromTheStartIsDueEveryPoll) {
  ClaimCursor cursor{.sent_through = 40, .next_full_claim = kNow};
  ClaimWalk walk(&cursor, Backlog());
  EXPECT_FALSE(walk.fresh());
  EXPECT_EQ(cursor.next_full_claim, kNow + kPoll);
}

TEST(ClaimWalk, APassedOverAggregateFreedSinceBringsTheNextRoundToTheStart) {
  ClaimCursor cursor{.sent_through = 40, .next_full_claim = kNow + kPoll};
  {
    ClaimWalk walk(&cursor, Backlog(/*freed=*/5));
    ASSERT_TRUE(walk.fresh());
    // It left a busy aggregate's rows out.
    EXPECT_EQ(walk.Claimed(512, 600, /*excluded=*/true, 5, kNow),
              ClaimWalk::kBatch);
    EXPECT_TRUE(cursor.passed_over);
    EXPECT_EQ(cursor.freed_at_claim, 5u);
  }
  // Nothing freed since: above what was sent again.
  EXPECT_TRUE(ClaimWalk(&cursor, Backlog(5)).fresh());
  // An aggregate freed since (or freed by the marks riding with the
  // claim): from the start, where its next row waits.
  EXPECT_FALSE(ClaimWalk(&cursor, Backlog(6)).fresh());
  ClaimWalk::Start riding = Backlog(5);
  riding.riding_frees = true;
  ClaimCursor copy = cursor;
  EXPECT_FALSE(ClaimWalk(&copy, riding).fresh());
  // A claim from the start saw every ready row.
  ClaimWalk walk(&cursor, Backlog(6));
  walk.Claimed(3, 700, false, 6, kNow);
  EXPECT_FALSE(cursor.passed_over);
}

}  // namespace
}  // namespace outbox::relay
