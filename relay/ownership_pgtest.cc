// How replicas of one subscription share its partitions, against a real
// PostgreSQL: one alone owns every partition; a second one gets half once
// the first gives them up, but never a partition with something in
// flight; a lease taken over is forgotten; a clean stop hands everything
// over at once; a lost session keeps the leases that are still its own.

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/db.h"
#include "common/schema.h"
#include "relay/ownership.h"
#include "relay/subscribe.h"
#include "tests/testing/pg.h"

namespace outbox::relay {
namespace {

constexpr int kPartitions = 8;

class OwnershipTest : public ::testing::Test {
 protected:
  OwnershipTest() : db_("ownership", {OutboxSchema()}), conn_(db_.url()) {
    absl::StatusOr<Subscribed> s =
        TakeUpSubscription(conn_, {.subscription = "billing", .actor = "test"});
    EXPECT_TRUE(s.ok()) << s.status();
  }

  PartitionOwnership Replica(const std::string& name) {
    return PartitionOwnership("billing", name, absl::Seconds(30), kPartitions);
  }

  // One committed round; `busy` holds the partitions with something in
  // flight.
  OwnershipRound Round(PartitionOwnership& replica,
                       const std::set<int>& busy = {}) {
    auto tx = OpenUnit(conn_);
    OwnershipRound round =
        replica.Balance(*tx, [&](int p) { return busy.count(p) > 0; });
    tx->commit();
    return round;
  }

  // The partitions whose lease `owner` holds, as the database says.
  std::set<int> LeasedTo(const std::string& owner) {
    pqxx::work tx(conn_);
    std::set<int> leased;
    for (const auto& row : tx.exec_params(
             "SELECT partition FROM outbox_partition_leases WHERE "
             "subscription = 'billing' AND owner = $1 AND expires_at > now()",
             owner)) {
      leased.insert(row["partition"].as<int>());
    }
    return leased;
  }

  static std::set<int> All() {
    std::set<int> all;
    for (int p = 0; p < kPartitions; ++p) all.insert(p);
    return all;
  }

  testing::TestDatabase db_;
  pqxx::connection conn_;
};

TEST_F(OwnershipTest, OneReplicaOwnsEveryPartitionAndItsLanesSplitThem) {
  PartitionOwnership a = Replica("a");
  const OwnershipRound round = Round(a);
  EXPECT_EQ(round.members, 1);
  EXPECT_EQ(round.acquired, All());
  EXPECT_EQ(a.owned(), All());
  EXPECT_EQ(LeasedTo("a"), All());
  std::set<int> claimed;
  for (int slot = 0; slot < 3; ++slot) {
    for (int p : a.ForSlot(slot, 3)) {
      EXPECT_TRUE(claimed.insert(p).second) << "partition " << p << " twice";
    }
  }
  EXPECT_EQ(claimed, All());
  // A second round renews and changes nothing.
  const OwnershipRound again = Round(a);
  EXPECT_TRUE(again.acquired.empty());
  EXPECT_TRUE(again.released.empty());
  EXPECT_EQ(a.owned(), All());
}

TEST_F(OwnershipTest, ASecondReplicaGetsHalfOnceTheFirstGivesItUp) {
  PartitionOwnership a = Replica("a");
  PartitionOwnership b = Replica("b");
  Round(a);
  const OwnershipRound joined = Round(b);
  EXPECT_EQ(joined.members, 2);
  EXPECT_TRUE(b.owned().empty());  // all are a's still
  const OwnershipRound shared = Round(a);
  EXPECT_EQ(shared.members, 2);
  EXPECT_EQ(shared.released.size(), kPartitions / 2u);
  EXPECT_EQ(a.owned().size(), kPartitions / 2u);
  Round(b);
  EXPECT_EQ(b.owned().size(), kPartitions / 2u);
  std::set<int> both = a.owned();
  both.insert(b.owned().begin(), b.owned().end());
  EXPECT_EQ(both, All());
  EXPECT_EQ(LeasedTo("a"), a.owned());
  EXPECT_EQ(LeasedTo("b"), b.owned());
}

TEST_F(OwnershipTest,
       APartitionWithSomethingInFlightIsNotGivenUpButNotClaimed) {
  PartitionOwnership a = Replica("a");
  PartitionOwnership b = Replica("b");
  Round(a);
  Round(b);
  const std::set<int> all = All();
  // a gives up its highest partitions: say the highest has a batch out.
  const int in_flight = *all.rbegin();
  const OwnershipRound held = Round(a, {in_flight});
  EXPECT_EQ(held.released.size(), kPartitions / 2u - 1);
  EXPECT_FALSE(held.released.count(in_flight));
  EXPECT_TRUE(a.owned().count(in_flight));
  EXPECT_TRUE(LeasedTo("a").count(in_flight));
  // Still a's, but no lane of a claims it any more.
  for (int slot = 0; slot < 2; ++slot) {
    for (int p : a.ForSlot(slot, 2)) EXPECT_NE(p, in_flight);
  }
  Round(b);
  EXPECT_FALSE(b.owned().count(in_flight));
  // Answered: given up on the next round, and b takes it.
  const OwnershipRound freed = Round(a);
  EXPECT_EQ(freed.released, std::set<int>{in_flight});
  Round(b);
  EXPECT_TRUE(b.owned().count(in_flight));
  EXPECT_EQ(a.owned().size() + b.owned().size(), size_t{kPartitions});
}

TEST_F(OwnershipTest, ALeaseTakenOverIsForgotten) {
  PartitionOwnership a = Replica("a");
  Round(a);
  // Another replica took partition 3 while a was frozen past its lease.
  pqxx::work tx(conn_);
  tx.exec(
      "UPDATE outbox_partition_leases SET owner = 'thief', token = token + 1 "
      "WHERE subscription = 'billing' AND partition = 3");
  tx.commit();
  const OwnershipRound round = Round(a);
  EXPECT_EQ(round.lost, std::set<int>{3});
  EXPECT_FALSE(a.owned().count(3));
  for (int slot = 0; slot < 2; ++slot) {
    for (int p : a.ForSlot(slot, 2)) EXPECT_NE(p, 3);
  }
}

TEST_F(OwnershipTest, ACleanStopHandsEverythingOverAtOnce) {
  PartitionOwnership a = Replica("a");
  PartitionOwnership b = Replica("b");
  Round(a);
  Round(b);
  ASSERT_TRUE(a.ReleaseAll(conn_).ok());
  EXPECT_TRUE(a.owned().empty());
  EXPECT_TRUE(LeasedTo("a").empty());
  // b alone now (a left the members too), within one round, not a ttl.
  const OwnershipRound round = Round(b);
  EXPECT_EQ(round.members, 1);
  EXPECT_EQ(b.owned(), All());
}

TEST_F(OwnershipTest, ALostSessionKeepsTheLeasesStillItsOwn) {
  PartitionOwnership a = Replica("a");
  Round(a);
  a.Forget();  // the connection broke: nothing was said to the database
  EXPECT_TRUE(a.owned().empty());
  EXPECT_EQ(LeasedTo("a"), All());  // still a's until they expire
  PartitionOwnership b = Replica("b");
  Round(b);
  EXPECT_TRUE(b.owned().empty());  // no one takes a lease still held
  // The next session renews them: nothing was lost, nothing taken again.
  const OwnershipRound round = Round(a);
  EXPECT_TRUE(round.lost.empty());
  EXPECT_EQ(round.members, 2);
  std::set<int> both = a.owned();
  Round(b);
  both.insert(b.owned().begin(), b.owned().end());
  EXPECT_EQ(both, All());
}

TEST_F(OwnershipTest, AFailedRoundLeavesWhatItHoldsAsBefore) {
  PartitionOwnership a = Replica("a");
  Round(a);
  const std::set<int> before = a.owned();
  {
    pqxx::read_transaction tx(conn_);  // as on a standby: every write fails
    EXPECT_ANY_THROW(a.Balance(tx, [](int) { return false; }));
  }
  EXPECT_EQ(a.owned(), before);
}

}  // namespace
}  // namespace outbox::relay
