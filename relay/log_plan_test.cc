#include "relay/log_plan.h"

#include <gtest/gtest.h>

#include <random>

namespace outbox::relay {
namespace {

TEST(NextRange, FinishesTheBegunRangeFirst) {
  // Its end must not move: the events it holds at or below after_seq are
  // settled, those of a longer range there may not be.
  std::optional<RangeToRead> r =
      NextRange({.done = 4, .reading = 6, .after_seq = 90}, 9);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->from, 4);
  EXPECT_EQ(r->to, 6);
  EXPECT_EQ(r->after_seq, 90);
}

TEST(NextRange, TakesEverythingUpToTheNewestTick) {
  std::optional<RangeToRead> r =
      NextRange({.done = 4, .reading = 0, .after_seq = 0}, 9);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->from, 4);
  EXPECT_EQ(r->to, 9);
  EXPECT_EQ(r->after_seq, 0);
  // A finished range's after_seq says nothing about the next one.
  r = NextRange({.done = 4, .reading = 4, .after_seq = 77}, 5);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->after_seq, 0);
}

TEST(NextRange, NothingWhenNoNewerTick) {
  EXPECT_FALSE(NextRange({.done = 9}, 9).has_value());
  EXPECT_FALSE(NextRange({.done = 9}, 3).has_value());
}

TEST(MovesForward, WithinABegunRangeOnlyOnward) {
  const LogPosition at{.done = 4, .reading = 6, .after_seq = 90};
  EXPECT_TRUE(MovesForward(at, at));
  EXPECT_TRUE(MovesForward(at, {.done = 4, .reading = 6, .after_seq = 95}));
  EXPECT_FALSE(MovesForward(at, {.done = 4, .reading = 6, .after_seq = 89}));
  // Its end cannot move.
  EXPECT_FALSE(MovesForward(at, {.done = 4, .reading = 7, .after_seq = 95}));
  EXPECT_FALSE(MovesForward(at, {.done = 4, .reading = 0}));
}

TEST(MovesForward, RangesFinishOrBeginButNeverGoBack) {
  EXPECT_TRUE(MovesForward({.done = 4}, {.done = 4, .reading = 9}));
  EXPECT_TRUE(MovesForward({.done = 4}, {.done = 9}));
  EXPECT_TRUE(
      MovesForward({.done = 4, .reading = 6, .after_seq = 90}, {.done = 6}));
  EXPECT_TRUE(MovesForward({.done = 4, .reading = 6, .after_seq = 90},
                           {.done = 6, .reading = 8, .after_seq = 3}));
  // A later range cannot be done while the begun one is not.
  EXPECT_FALSE(MovesForward({.done = 4, .reading = 6}, {.done = 5}));
  EXPECT_FALSE(MovesForward({.done = 4}, {.done = 3}));
  EXPECT_FALSE(MovesForward({.done = 4}, {.done = 4, .reading = 4}));
  EXPECT_FALSE(MovesForward({.done = 4}, {.done = 5, .reading = 2}));
}

TEST(PlanBatch, AChainWithAnExceptionIsNotSentFromTheLog) {
  BatchPlan plan =
      PlanBatch({{1, "a"}, {2, "b"}, {3, "a"}, {4, "c"}, {5, "b"}}, {"a"});
  EXPECT_EQ(plan.send, (std::vector<int64_t>{2, 4, 5}));
  EXPECT_EQ(plan.divert, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(plan.diverted_chains, (std::set<std::string>{"a"}));
}

TEST(PlanBatch, NothingExceptedSendsAll) {
  BatchPlan plan = PlanBatch({{7, "a"}, {8, "a"}}, {"z"});
  EXPECT_EQ(plan.send, (std::vector<int64_t>{7, 8}));
  EXPECT_TRUE(plan.divert.empty());
}

TEST(RangeProgress, PositionStopsBeforeTheFirstUnsettledEvent) {
  RangeProgress p(10);
  EXPECT_EQ(p.position(), 10);
  p.Read({12, 15, 20}, 20, false);
  EXPECT_EQ(p.in_flight(), 3u);
  EXPECT_EQ(p.position(), 11);
  EXPECT_TRUE(p.Settle(15));
  EXPECT_EQ(p.position(), 11);  // 12 is still out
  EXPECT_TRUE(p.Settle(12));
  EXPECT_EQ(p.position(), 19);
  EXPECT_TRUE(p.Settle(20));
  EXPECT_EQ(p.position(), 20);
  EXPECT_FALSE(p.done());  // not read to its end
  p.Read({}, 31, true);    // a read that found nothing more up to its end
  EXPECT_EQ(p.position(), 31);
  EXPECT_TRUE(p.done());
}

TEST(RangeProgress, ReadsRunAheadOfAnswers) {
  RangeProgress p(0);
  p.Read({1, 2}, 2, false);
  p.Read({3, 4}, 4, true);
  EXPECT_EQ(p.read_through(), 4);
  EXPECT_TRUE(p.read_all());
  EXPECT_FALSE(p.done());
  EXPECT_TRUE(p.Settle(3));
  EXPECT_TRUE(p.Settle(4));
  EXPECT_EQ(p.position(), 0);
  EXPECT_TRUE(p.Settle(1));
  EXPECT_EQ(p.position(), 1);
  EXPECT_TRUE(p.Settle(2));
  EXPECT_EQ(p.position(), 4);
  EXPECT_TRUE(p.done());
}

TEST(RangeProgress, AnswersForWhatIsNotInFlightChangeNothing) {
  RangeProgress p(0);
  p.Read({5, 6}, 6, false);
  EXPECT_FALSE(p.Settle(4));  // never read
  EXPECT_FALSE(p.Settle(7));
  EXPECT_TRUE(p.Settle(6));
  EXPECT_FALSE(p.Settle(6));  // twice
  EXPECT_EQ(p.in_flight(), 1u);
  EXPECT_EQ(p.position(), 4);
}

TEST(RangeProgress, RewindReadsAgainFromThePosition) {
  RangeProgress p(0);
  p.Read({1, 2, 3}, 3, true);
  EXPECT_TRUE(p.Settle(1));
  EXPECT_TRUE(p.Settle(3));
  p.Rewind();  // the stream carrying 2 and 3 ended
  EXPECT_EQ(p.position(), 1);
  EXPECT_EQ(p.read_through(), 1);
  EXPECT_FALSE(p.read_all());
  EXPECT_EQ(p.in_flight(), 0u);
  EXPECT_FALSE(p.Settle(2));  // a late answer of the old stream
  p.Read({2, 3}, 3, true);
  EXPECT_TRUE(p.Settle(2));
  EXPECT_TRUE(p.Settle(3));
  EXPECT_TRUE(p.done());
  EXPECT_EQ(p.position(), 3);
}

// Random reads, answers out of order and rewinds: the position never
// decreases, never passes an unsettled event, and reaches the end once
// everything is settled.
TEST(RangeProgress, RandomAnswersKeepThePositionSafe) {
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    RangeProgress p(0);
    std::set<int64_t> unsettled;
    int64_t next = 1, last_position = 0;
    const int64_t end = 1 + rng() % 60;
    for (int step = 0; step < 400 && !p.done(); ++step) {
      const int choice = rng() % 10;
      if (choice < 4 && !p.read_all()) {
        std::vector<int64_t> seqs;
        int64_t seq = std::max(next, p.read_through() + 1);
        for (int n = rng() % 4; n > 0 && seq <= end;
             --n, seq += 1 + rng() % 3) {
          seqs.push_back(seq);
        }
        const int64_t last = seqs.empty() ? p.read_through() : seqs.back();
        p.Read(seqs, last, seq > end);
        for (int64_t s : seqs) unsettled.insert(s);
        next = seq;
      } else if (choice < 9 && !unsettled.empty()) {
        auto it = unsettled.begin();
        std::advance(it, rng() % unsettled.size());
        EXPECT_TRUE(p.Settle(*it));
        unsettled.erase(it);
      } else if (choice == 9) {
        p.Rewind();
        unsettled.clear();
        next = p.read_through() + 1;
      }
      EXPECT_GE(p.position(), last_position);
      last_position = p.position();
      if (!unsettled.empty()) {
        EXPECT_LT(p.position(), *unsettled.begin());
      }
      EXPECT_EQ(p.in_flight(), unsettled.size());
    }
    // Whatever is left: read to the end, settle everything.
    if (!p.read_all()) {
      std::vector<int64_t> rest;
      for (int64_t s = p.read_through() + 1; s <= end; ++s) rest.push_back(s);
      p.Read(rest, end, true);
      unsettled.insert(rest.begin(), rest.end());
    }
    for (int64_t s : unsettled) EXPECT_TRUE(p.Settle(s));
    EXPECT_TRUE(p.done());
    EXPECT_GE(p.position(), last_position);
    EXPECT_EQ(p.position(), p.read_through());
  }
}

}  // namespace
}  // namespace outbox::relay
