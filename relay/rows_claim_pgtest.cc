// A lane's claims of delivery rows in one round, against a real
// PostgreSQL: they stop when the lane takes no more; the deliveries
// answered since the last round are deleted by the round's first claim
// and settled; a chain with an event out is left out until its answer is
// written; a replica without the leases claims nothing.

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "common/db.h"
#include "common/ids.h"
#include "common/schema.h"
#include "relay/batch_builder.h"
#include "relay/log_testing.h"
#include "relay/marks.h"
#include "relay/ownership.h"
#include "relay/rows_claim.h"
#include "relay/settlement.h"
#include "relay/subscribe.h"
#include "tests/testing/pg.h"

namespace outbox::relay {
namespace {

class RowsClaimTest : public ::testing::Test {
 protected:
  RowsClaimTest()
      : db_("rows_claim", {OutboxSchema()}),
        conn_(db_.url()),
        ownership_("billing", "relay-a", absl::Seconds(30)) {
    EXPECT_TRUE(
        TakeUpSubscription(conn_, {.subscription = "billing", .actor = "test"})
            .ok());
    auto tx = OpenUnit(conn_);
    ownership_.Balance(*tx, [](int) { return false; });
    tx->commit();
  }

  // Events of `aggregates`, one each, in this order; their seqs.
  std::vector<int64_t> Events(const std::vector<std::string>& aggregates) {
    pqxx::work tx(conn_);
    std::vector<int64_t> seqs;
    for (const std::string& a : aggregates) seqs.push_back(Append(tx, a));
    tx.commit();
    return seqs;
  }

  RowsClaim Claims(const std::string& member) {
    return RowsClaim(
        {.subscription = "billing",
         .member = member,
         .batch_size = 512,
         .poll_interval = absl::Seconds(1),
         .settled = [this](const Settled& s) { settled_.push_back(s.tally); }},
        &settlement_);
  }

  // One round for a lane that takes `budget` events at most; what it sent.
  std::vector<InFlight> Round(RowsClaim& claims, int budget,
                              bool* ran = nullptr) {
    std::vector<InFlight> sent;
    int taken = 0;
    bool claimed = false;
    const absl::Status s = claims.Round(
        conn_,
        {.partitions = ownership_.ForSlot(0, 1),
         .cursor = &cursor_,
         .limit = [&] { return budget - taken; },
         .send =
             [&](Claimed c, int) {
               BuiltBatch built = BuildBatch(std::move(c.candidates),
                                             {.batch_id = ++batch_id_});
               settlement_.Sent(built);
               taken += static_cast<int>(built.batch.seqs.size());
               if (!built.batch.seqs.empty()) sent.push_back(built.batch);
               return built.cut_by_bytes;
             }},
        &claimed);
    EXPECT_TRUE(s.ok()) << s;
    if (ran != nullptr) *ran = claimed;
    return sent;
  }

  // The consumer applied every event of `batch`.
  void Applied(const InFlight& batch) {
    v1::DeliverResponse response;
    response.set_batch_id(batch.batch_id);
    for (int64_t seq : batch.seqs) {
      v1::EventResult* r = response.add_results();
      r->set_seq(seq);
      r->set_outcome(v1::APPLIED);
    }
    settlement_.Answered(AnswerOf(batch, response));
  }

  static std::vector<int64_t> Seqs(const std::vector<InFlight>& batches) {
    std::vector<int64_t> seqs;
    for (const InFlight& b : batches) {
      seqs.insert(seqs.end(), b.seqs.begin(), b.seqs.end());
    }
    return seqs;
  }

  int64_t PendingRows() {
    return db_.Scalar(
        "SELECT count(*) FROM outbox_delivery WHERE subscription = "
        "'billing'");
  }

  testing::TestDatabase db_;
  pqxx::connection conn_;
  PartitionOwnership ownership_;
  Settlement settlement_;
  ClaimCursor cursor_;
  std::vector<MarkTally> settled_;
  uint64_t batch_id_ = 0;
};

TEST_F(RowsClaimTest, ClaimsUntilTheLaneTakesNoMore) {
  const std::vector<int64_t> seqs =
      Events({"a", "b", "c", "d", "e", "f", "g", "h"});
  RowsClaim claims = Claims(ownership_.member());
  bool ran = false;
  const std::vector<InFlight> sent = Round(claims, 5, &ran);
  EXPECT_TRUE(ran);
  EXPECT_EQ(Seqs(sent), std::vector<int64_t>(seqs.begin(), seqs.begin() + 5));
  // A lane with no room claims nothing, and says so.
  EXPECT_TRUE(Round(claims, 0, &ran).empty());
  EXPECT_FALSE(ran);
  EXPECT_EQ(PendingRows(), 8);  // nothing answered, nothing deleted
}

TEST_F(RowsClaimTest, AnsweredDeliveriesGoWithTheFirstClaimOfTheNextRound) {
  Events({"a", "b", "c"});
  RowsClaim claims = Claims(ownership_.member());
  const std::vector<InFlight> first = Round(claims, 100);
  ASSERT_EQ(Seqs(first).size(), 3u);
  for (const InFlight& b : first) Applied(b);
  ASSERT_TRUE(settlement_.RideWithClaim());
  const std::vector<int64_t> later = Events({"a", "d"});
  // "a"'s next event goes in the same round: its answered one was deleted
  // by the claim that found it.
  EXPECT_EQ(Seqs(Round(claims, 100)), later);
  ASSERT_EQ(settled_.size(), 1u);
  EXPECT_EQ(settled_[0].delivered, 3);
  EXPECT_EQ(settled_[0].rows_deleted, 3);
  EXPECT_TRUE(settlement_.marks().empty());
  EXPECT_EQ(PendingRows(), 2);  // the two out now
}

TEST_F(RowsClaimTest, AChainWithAnEventOutIsLeftOutUntilItsAnswerIsWritten) {
  const std::vector<int64_t> first = Events({"a"});
  RowsClaim claims = Claims(ownership_.member());
  const std::vector<InFlight> out = Round(claims, 100);
  ASSERT_EQ(Seqs(out), first);
  const std::vector<int64_t> more = Events({"a", "b"});
  // "a" has an event out (unanswered): only "b" goes.
  EXPECT_EQ(Seqs(Round(claims, 100)), std::vector<int64_t>{more[1]});
  Applied(out[0]);
  EXPECT_EQ(Seqs(Round(claims, 100)), std::vector<int64_t>{more[0]});
}

TEST_F(RowsClaimTest, AReplicaWithoutTheLeasesClaimsNothing) {
  Events({"a", "b"});
  RowsClaim claims = Claims("relay-b/not-a-member");
  bool ran = false;
  EXPECT_TRUE(Round(claims, 100, &ran).empty());
  EXPECT_TRUE(ran);  // it asked; the database gave it nothing
  EXPECT_EQ(PendingRows(), 2);
}

}  // namespace
}  // namespace outbox::relay
