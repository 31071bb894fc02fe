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
  EXPECT_TRUE(feed.BeginRound(t, std::nullopt));
  feed.Observe(Found(0), t);
  feed.EndRound();
  // The reads saw none: no claim until the poll is due.
  EXPECT_FALSE(feed.BeginRound(t + absl::Milliseconds(10), std::nullopt));
  feed.EndRound();
  EXPECT_FALSE(feed.BeginRound(t + kPoll - absl::Milliseconds(1), std::nullopt));
  feed.EndRound();
  EXPECT_TRUE(feed.BeginRound(t + kPoll, std::nullopt));
  feed.EndRound();
  EXPECT_FALSE(feed.BeginRound(t + kPoll + absl::Milliseconds(1), std::nullopt));
}

TEST(LogFeedClaims, AnOwedExceptionClaimsAtOnceUntilAReadSeesNone) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(feed.BeginRound(t, std::nullopt));
  feed.EndRound();
  EXPECT_FALSE(feed.BeginRound(t + absl::Milliseconds(1), std::nullopt));
  feed.Owed();  // a REJECTED answer became an exception
  feed.EndRound();
  EXPECT_TRUE(feed.BeginRound(t + absl::Milliseconds(2), std::nullopt));
  LogSend with = Found(3);
  with.exceptions = true;  // the read saw exceptions in its partitions
  feed.Observe(with, t);
  feed.EndRound();
  EXPECT_TRUE(feed.BeginRound(t + absl::Milliseconds(3), std::nullopt));
  feed.Observe(Found(3), t);
  feed.EndRound();
  EXPECT_FALSE(feed.BeginRound(t + absl::Milliseconds(4), std::nullopt));
}

TEST(LogFeedClaims, ALaneThatCouldNotReadLeavesThemUnknown) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(feed.BeginRound(t, std::nullopt));
  feed.Observe(Found(0), t);  // one lane read and saw none
  feed.Skipped();                   // the other had no credit
  feed.EndRound();
  EXPECT_TRUE(feed.BeginRound(t + absl::Milliseconds(1), std::nullopt));
}

LogSend Shows(absl::Time before) {
  LogSend read = Found(0);
  read.shows_before = before;
  return read;
}

TEST(LogFeedMustShow, OnlyCommitsThatNoReadHasShownYet) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  const absl::Duration ms = absl::Milliseconds(1);
  feed.BeginRound(t, std::nullopt);
  EXPECT_EQ(feed.MustShow(t, true), t);  // the first poll is due
  feed.Observe(Shows(t), t);
  // Idle, listening, nothing heard: the reader reads on to the tick it
  // has and asks for none.
  feed.BeginRound(t + 5 * ms, std::nullopt);
  EXPECT_EQ(feed.MustShow(t + 5 * ms, true), absl::InfinitePast());
  // A read that found events: the next one must show every commit
  // before it (more are likely, their NOTIFYs may lag), until one finds
  // none.
  LogSend found = Shows(t + 5 * ms);
  found.events.resize(3);
  feed.Observe(found, t + 5 * ms);
  EXPECT_EQ(feed.MustShow(t + 6 * ms, true), t + 6 * ms);
  LogSend diverted = Shows(t + 6 * ms);
  diverted.diverted = 1;
  feed.Observe(diverted, t + 6 * ms);
  EXPECT_EQ(feed.MustShow(t + 6 * ms, true), t + 6 * ms);
  feed.Observe(Shows(t + 6 * ms), t + 6 * ms);
  EXPECT_EQ(feed.MustShow(t + 6 * ms, true), absl::InfinitePast());
  // A NOTIFY arrived at t+6: its commit and all before it.
  feed.BeginRound(t + 7 * ms, t + 6 * ms);
  EXPECT_EQ(feed.MustShow(t + 7 * ms, true), t + 6 * ms);
  // Read with a tick older than that: still owed, in the rounds after too,
  // and an older NOTIFY does not lower it.
  feed.Observe(Shows(t + 5 * ms), t + 7 * ms);
  feed.BeginRound(t + 8 * ms, t + 2 * ms);
  EXPECT_EQ(feed.MustShow(t + 8 * ms, true), t + 6 * ms);
  // Read with a tick made after it: nothing is owed.
  feed.Observe(Shows(t + 6 * ms), t + 8 * ms);
  EXPECT_EQ(feed.MustShow(t + 9 * ms, true), absl::InfinitePast());
  // No NOTIFY can be heard (none listens, or it stopped under load):
  // every commit before the read.
  EXPECT_EQ(feed.MustShow(t + 10 * ms, false), t + 10 * ms);
  feed.Observe(Shows(t + 10 * ms), t + 10 * ms);
  // Rows that make no NOTIFY are read within a poll_interval.
  EXPECT_EQ(feed.MustShow(t + kPoll, true), t + kPoll);
  feed.Observe(Shows(t + kPoll), t + kPoll);
  EXPECT_EQ(feed.MustShow(t + kPoll + ms, true), absl::InfinitePast());
}

TEST(LogFeedMustShow, ATickTooYoungIsAskedForAgainWhenDue) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  const absl::Duration ms = absl::Milliseconds(1);
  EXPECT_EQ(feed.RetryWait(t), absl::InfiniteDuration());
  feed.BeginRound(t, t);
  feed.MustShow(t, true);
  LogSend young = Shows(t - 2 * ms);
  young.retry_in = 3 * ms;  // the tick it has is too young to replace
  feed.Observe(young, t);
  EXPECT_EQ(feed.RetryWait(t), 3 * ms);
  EXPECT_EQ(feed.RetryWait(t + ms), 2 * ms);
  EXPECT_EQ(feed.RetryWait(t + 9 * ms), absl::ZeroDuration());
  // A read before it is due keeps it; a later retry does not delay it.
  LogSend later = Shows(t - 2 * ms);
  later.retry_in = 50 * ms;
  feed.Observe(later, t + ms);
  EXPECT_EQ(feed.RetryWait(t), 3 * ms);
  // The read it was due for showed what was owed: nothing is due.
  EXPECT_EQ(feed.MustShow(t + 3 * ms, true), t);
  feed.Observe(Shows(t + 3 * ms), t + 3 * ms);
  EXPECT_EQ(feed.RetryWait(t + 3 * ms), absl::InfiniteDuration());
  EXPECT_EQ(feed.MustShow(t + 4 * ms, true), absl::InfinitePast());
}

TEST(LogFeedMustShow, ADueRetryServedByAReadThatAskedNothingIsDropped) {
  LogFeed feed = Feed();
  const absl::Time t = absl::FromUnixSeconds(1000);
  const absl::Duration ms = absl::Milliseconds(1);
  feed.BeginRound(t, t);
  feed.MustShow(t, true);
  LogSend young = Shows(t - ms);
  young.retry_in = 4 * ms;
  feed.Observe(young, t);
  // Due, and the read wanted no new range (its events are in flight):
  // no retry is left in the past to spin the worker; the answers wake it
  // and the read then asks, as the commits are still owed.
  feed.Observe(Shows(t - ms), t + 5 * ms);
  EXPECT_EQ(feed.RetryWait(t + 5 * ms), absl::InfiniteDuration());
  EXPECT_EQ(feed.MustShow(t + 6 * ms, true), t);
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
