#include "relay/log_feed.h"

#include <gtest/gtest.h>

namespace outbox::relay {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(500);

LogFeed Feed() { return LogFeed({.poll_interval = kPoll}); }

LogSend Found(int events) {
  LogSend read;
  read.events.resize(events);
  read.exceptions = false;
  return read;
}

TEST(LogFeedClaims, WhileExceptionsMayExistAndOncePerPoll) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  // Nothing is known of the partitions yet: the first round claims.
  EXPECT_TRUE(feed.BeginRound(t, false));
  feed.Observe(Found(0), true, t);
  feed.EndRound();
  // The reads saw none: no claim until the poll is due.
  EXPECT_FALSE(feed.BeginRound(t + absl::Milliseconds(10), false));
  feed.EndRound();
  EXPECT_FALSE(feed.BeginRound(t + kPoll - absl::Milliseconds(1), false));
  feed.EndRound();
  EXPECT_TRUE(feed.BeginRound(t + kPoll, false));
  feed.EndRound();
  EXPECT_FALSE(feed.BeginRound(t + kPoll + absl::Milliseconds(1), false));
}

TEST(LogFeedClaims, AnOwedExceptionClaimsAtOnceUntilAReadSeesNone) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(feed.BeginRound(t, false));
  feed.EndRound();
  EXPECT_FALSE(feed.BeginRound(t + absl::Milliseconds(1), false));
  feed.Owed();  // a REJECTED answer became an exception
  feed.EndRound();
  EXPECT_TRUE(feed.BeginRound(t + absl::Milliseconds(2), false));
  LogSend with = Found(3);
  with.exceptions = true;  // the read saw exceptions in its partitions
  feed.Observe(with, false, t);
  feed.EndRound();
  EXPECT_TRUE(feed.BeginRound(t + absl::Milliseconds(3), false));
  feed.Observe(Found(3), false, t);
  feed.EndRound();
  EXPECT_FALSE(feed.BeginRound(t + absl::Milliseconds(4), false));
}

TEST(LogFeedClaims, ALaneThatCouldNotReadLeavesThemUnknown) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(feed.BeginRound(t, false));
  feed.Observe(Found(0), true, t);  // one lane read and saw none
  feed.Skipped();                   // the other had no credit
  feed.EndRound();
  EXPECT_TRUE(feed.BeginRound(t + absl::Milliseconds(1), false));
}

TEST(LogFeedFresh, OnlyWhenEventsMayHaveCommittedSinceTheNewestTick) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  feed.BeginRound(t, false);
  EXPECT_TRUE(feed.Fresh(t, true));  // the first poll is due
  feed.Observe(Found(0), true, t);
  // Idle, listening, nothing heard: the newest tick is read, none made.
  feed.BeginRound(t + absl::Milliseconds(5), false);
  EXPECT_FALSE(feed.Fresh(t + absl::Milliseconds(5), true));
  // A NOTIFY this round.
  feed.BeginRound(t + absl::Milliseconds(6), true);
  EXPECT_TRUE(feed.Fresh(t + absl::Milliseconds(6), true));
  // The listener does not work, or does not want wakes under load: a
  // commit would not be heard.
  feed.BeginRound(t + absl::Milliseconds(7), false);
  EXPECT_TRUE(feed.Fresh(t + absl::Milliseconds(7), false));
  EXPECT_FALSE(feed.Fresh(t + absl::Milliseconds(7), true));
  // The last read found events: more may follow them.
  feed.Observe(Found(2), true, t + absl::Milliseconds(7));
  EXPECT_TRUE(feed.Fresh(t + absl::Milliseconds(8), true));
  LogSend diverted = Found(0);
  diverted.diverted = 1;
  feed.Observe(diverted, true, t + absl::Milliseconds(8));
  EXPECT_TRUE(feed.Fresh(t + absl::Milliseconds(9), true));
  feed.Observe(Found(0), true, t + absl::Milliseconds(9));
  EXPECT_FALSE(feed.Fresh(t + absl::Milliseconds(10), true));
  // Rows that make no NOTIFY are found within a poll_interval.
  EXPECT_TRUE(feed.Fresh(t + kPoll, true));
  EXPECT_FALSE(feed.Fresh(t + kPoll + absl::Milliseconds(1), true));
}

TEST(LogFeedFresh, ARefusedTickIsAskedForAgainWhenDue) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  EXPECT_EQ(feed.RetryWait(t), absl::InfiniteDuration());
  feed.BeginRound(t, true);
  ASSERT_TRUE(feed.Fresh(t, true));
  LogSend young = Found(0);
  young.retry_in = absl::Milliseconds(3);  // the newest tick was too young
  feed.Observe(young, true, t);
  EXPECT_EQ(feed.RetryWait(t), absl::Milliseconds(3));
  EXPECT_EQ(feed.RetryWait(t + absl::Milliseconds(1)), absl::Milliseconds(2));
  EXPECT_EQ(feed.RetryWait(t + absl::Milliseconds(9)), absl::ZeroDuration());
  feed.BeginRound(t + absl::Milliseconds(1), false);
  EXPECT_FALSE(feed.Fresh(t + absl::Milliseconds(1), true));
  // A read that is not fresh keeps the retry due; a later one comes first.
  feed.Observe(Found(0), false, t + absl::Milliseconds(1));
  LogSend later = Found(0);
  later.retry_in = absl::Milliseconds(50);
  feed.Observe(later, false, t + absl::Milliseconds(1));
  EXPECT_EQ(feed.RetryWait(t), absl::Milliseconds(3));
  feed.BeginRound(t + absl::Milliseconds(3), false);
  EXPECT_TRUE(feed.Fresh(t + absl::Milliseconds(3), true));
  // The fresh read made its tick: nothing is due any more.
  feed.Observe(Found(0), true, t + absl::Milliseconds(3));
  EXPECT_EQ(feed.RetryWait(t + absl::Milliseconds(3)),
            absl::InfiniteDuration());
  EXPECT_FALSE(feed.Fresh(t + absl::Milliseconds(4), true));
}

TEST(LogFeedFlush, NothingToStoreBeforeAnyRead) {
  LogFeed feed = Feed();
  EXPECT_FALSE(feed.FlushDue(absl::FromUnixSeconds(1000), true));
  // Settling or forgetting what was never read is harmless.
  feed.Settle(7);
  feed.Rewind();
  feed.Forget({1, 2});
  EXPECT_FALSE(feed.FlushDue(absl::FromUnixSeconds(1001), true));
}

}  // namespace
}  // namespace outbox::relay
