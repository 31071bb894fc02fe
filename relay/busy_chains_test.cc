// The chains with events out: counted per event, freed with the last one,
// and what marks riding with a claim change for that claim.

#include "relay/busy_chains.h"

#include <gtest/gtest.h>

namespace outbox::relay {
namespace {

TEST(BusyChains, AChainIsBusyUntilItsLastEventIsMarked) {
  BusyChains busy;
  EXPECT_FALSE(busy.busy("a"));
  busy.Add("a");
  busy.Add("a");
  busy.Add("b");
  EXPECT_TRUE(busy.busy("a"));
  EXPECT_EQ(busy.size(), 2u);
  const uint64_t freed = busy.freed();
  busy.Remove("a");
  EXPECT_TRUE(busy.busy("a"));  // one event of it still out
  EXPECT_EQ(busy.freed(), freed);
  busy.Remove("a");
  EXPECT_FALSE(busy.busy("a"));
  EXPECT_EQ(busy.freed(), freed + 1);
  // A mark of a chain not busy (dropped with everything) changes nothing.
  busy.Remove("a");
  EXPECT_EQ(busy.freed(), freed + 1);
  EXPECT_TRUE(busy.busy("b"));
}

TEST(BusyChains, ClearingFreesEverything) {
  BusyChains busy;
  busy.Add("a");
  busy.Add("b");
  const uint64_t freed = busy.freed();
  busy.Clear();
  EXPECT_EQ(busy.size(), 0u);
  EXPECT_GT(busy.freed(), freed);  // a claim that passed them over looks again
}

TEST(BusyChains, MarksRidingWithAClaimCountAsMarkedForIt) {
  BusyChains busy;
  busy.Add("a");
  busy.Add("a");
  busy.Add("b");
  busy.Add("c");
  EXPECT_EQ(busy.BusyAfter({}), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_FALSE(busy.Frees({}));
  // One of a's two and all of b's ride: a stays busy, b does not.
  const std::map<std::string, int> riding = {{"a", 1}, {"b", 1}};
  EXPECT_EQ(busy.BusyAfter(riding), (std::vector<std::string>{"a", "c"}));
  EXPECT_TRUE(busy.Frees(riding));
  EXPECT_FALSE(busy.Frees({{"a", 1}}));
  EXPECT_TRUE(busy.Frees({{"a", 2}}));
}

}  // namespace
}  // namespace outbox::relay
