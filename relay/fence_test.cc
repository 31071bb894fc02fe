#include "relay/fence.h"

#include <gtest/gtest.h>

namespace outbox::relay {
namespace {

TEST(ParseLsn, ReadsPostgresPositions) {
  EXPECT_EQ(ParseLsn("0/0"), 0u);
  EXPECT_EQ(ParseLsn("0/1D3FC00"), 0x1D3FC00u);
  EXPECT_EQ(ParseLsn("16/B374D848"), (0x16ull << 32) | 0xB374D848u);
  EXPECT_EQ(ParseLsn("FFFFFFFF/FFFFFFFF"), ~0ull);
  EXPECT_FALSE(ParseLsn("").has_value());
  EXPECT_FALSE(ParseLsn("0").has_value());
  EXPECT_FALSE(ParseLsn("/1").has_value());
  EXPECT_FALSE(ParseLsn("1/").has_value());
  EXPECT_FALSE(ParseLsn("1/2/3").has_value());
  EXPECT_FALSE(ParseLsn("G/1").has_value());
  EXPECT_FALSE(ParseLsn("100000000/0").has_value());
}

StandbyPosition Streaming(std::string name, uint64_t flushed) {
  return {std::move(name), flushed, true, false};
}

TEST(FenceOf, TheNthHighestFlushOfTheStandbysThatCount) {
  const std::vector<StandbyPosition> s = {
      Streaming("a", 300),
      Streaming("b", 100),
      Streaming("c", 200),
      {"d", 900, false, false}};  // catching up: not streaming
  EXPECT_EQ(FenceOf(s, {.standbys = 1}).flushed, 300u);
  EXPECT_EQ(FenceOf(s, {.standbys = 2}).flushed, 200u);
  EXPECT_EQ(FenceOf(s, {.standbys = 3}).flushed, 100u);
  EXPECT_EQ(FenceOf(s, {.standbys = 1}).eligible, 3);
  EXPECT_TRUE(FenceOf(s, {.standbys = 3}).why_waiting.empty());
  // Only named ones count.
  const FenceState named = FenceOf(s, {.standbys = 1, .names = {"b", "d"}});
  EXPECT_EQ(named.flushed, 100u);
  EXPECT_EQ(named.eligible, 1);
}

TEST(FenceOf, TooFewStandbysHoldEverythingAndSayWhy) {
  const FenceState none = FenceOf({}, {.standbys = 1});
  EXPECT_EQ(none.flushed, 0u);
  EXPECT_NE(none.why_waiting.find("0 of the 1 standbys"), std::string::npos)
      << none.why_waiting;
  const FenceState two =
      FenceOf({Streaming("a", 5)}, {.standbys = 2, .names = {"a", "b"}});
  EXPECT_EQ(two.flushed, 0u);
  EXPECT_NE(two.why_waiting.find("1 of the 2"), std::string::npos);
  EXPECT_NE(two.why_waiting.find("a, b"), std::string::npos);
}

TEST(FenceOf, HiddenPositionsNameThePrivilege) {
  const FenceState s =
      FenceOf({{"a", std::nullopt, false, true}}, {.standbys = 1});
  EXPECT_FALSE(s.readable);
  EXPECT_NE(s.why_waiting.find("pg_monitor"), std::string::npos);
}

TEST(ReplicationFence, SaysWhyHeldBatchesWaitAndWarnsOfItsOwnReasons) {
  ReplicationFence fence({.standbys = 2});
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  const FenceState flushing;  // enough standbys: their flush lags
  FenceState too_few;
  too_few.why_waiting = "replication fence: 1 of the 2 standbys stream";
  // Nothing held: no reason, no warning.
  EXPECT_FALSE(fence.Note(flushing, false, t0));
  EXPECT_EQ(fence.waiting(), "");
  // Held while the standbys flush: a reason, no warning (milliseconds).
  EXPECT_FALSE(fence.Note(flushing, true, t0));
  EXPECT_EQ(fence.waiting(),
            "replication fence: waiting for 2 standbys to flush the claimed "
            "events");
  // Held by the fence itself: warned at once, then every 10 s.
  EXPECT_TRUE(fence.Note(too_few, true, t0));
  EXPECT_EQ(fence.waiting(), too_few.why_waiting);
  EXPECT_FALSE(fence.Note(too_few, true, t0 + absl::Seconds(9)));
  EXPECT_TRUE(fence.Note(too_few, true, t0 + absl::Seconds(10)));
  // Another reason: warned at once.
  FenceState hidden;
  hidden.why_waiting = "replication fence: positions hidden (pg_monitor)";
  EXPECT_TRUE(fence.Note(hidden, true, t0 + absl::Seconds(11)));
  // Released (or the streams dropped): nothing held, nothing to say, and
  // the same reason later is new again.
  EXPECT_FALSE(fence.Note(hidden, false, t0 + absl::Seconds(12)));
  EXPECT_EQ(fence.waiting(), "");
  EXPECT_TRUE(fence.Note(hidden, true, t0 + absl::Seconds(13)));
}

}  // namespace
}  // namespace outbox::relay
