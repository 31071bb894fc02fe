// What rides in a batch (BuildBatch), rule by rule.

#include "relay/batch_builder.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/limits.h"
#include "relay/delivery_store.h"

namespace outbox::relay {
namespace {

Candidate Row(const std::string& agg, int64_t seq, int64_t prev,
              bool goes = true, size_t payload = 10) {
  Candidate c;
  c.event.set_event_id(
      absl::StrCat("00000000-0000-0000-0000-", absl::StrFormat("%012d", seq)));
  c.event.set_aggregate_type("order");
  c.event.set_aggregate_id(agg);
  c.event.set_seq(seq);
  c.event.set_prev_seq(prev);
  c.event.mutable_payload()->set_value(std::string(payload, 'x'));
  c.partition = static_cast<int>(seq % 32);
  c.goes = goes;
  return c;
}

std::string Chain(const std::string& agg) { return OutboxChain("order", agg); }

TEST(BuildBatchTest, EverythingReadyGoesInOrderWithTheSource) {
  BuiltBatch b = BuildBatch({Row("a", 3, 0), Row("b", 4, 0), Row("a", 5, 3)},
                            {.batch_id = 7, .source = "shop", .chain_from = 0});
  EXPECT_EQ(b.request.batch_id(), 7u);
  EXPECT_EQ(b.batch.batch_id, 7u);
  EXPECT_EQ(b.batch.seqs, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(b.batch.prev_seqs, (std::vector<int64_t>{0, 0, 3}));
  EXPECT_EQ(b.batch.partitions, (std::vector<int>{3, 4, 5}));
  ASSERT_EQ(b.request.events_size(), 3);
  for (const auto& e : b.request.events()) EXPECT_EQ(e.source(), "shop");
  EXPECT_EQ(b.sent_through, 5);
  EXPECT_EQ(b.busy,
            (std::vector<std::string>{Chain("a"), Chain("b"), Chain("a")}));
  EXPECT_TRUE(b.marks.empty());
  EXPECT_FALSE(b.cut_by_bytes);
}

TEST(BuildBatchTest, AChainWhosePredecessorIsNotDoneSendsNothingOfIt) {
  // a's first row here waits for its predecessor: a's later row waits too,
  // whatever it says; b goes.
  BuiltBatch b = BuildBatch(
      {Row("a", 5, 2, /*goes=*/false), Row("b", 6, 0), Row("a", 7, 5, true)},
      {.batch_id = 1});
  EXPECT_EQ(b.batch.seqs, (std::vector<int64_t>{6}));
  EXPECT_EQ(b.busy, (std::vector<std::string>{Chain("b")}));
  EXPECT_TRUE(b.marks.empty());  // claimed rows stay pending
}

TEST(BuildBatchTest, AnUndeliverableEventIsRejectedAndItsSuccessorsWait) {
  Candidate unreadable = Row("a", 3, 0);
  unreadable.parsed = false;
  BuiltBatch b =
      BuildBatch({unreadable, Row("b", 4, 0), Row("a", 5, 3),
                  Row("c", 6, 0, true, kMaxEventBytes + 1), Row("c", 8, 6)},
                 {.batch_id = 1});
  EXPECT_EQ(b.batch.seqs, (std::vector<int64_t>{4}));
  ASSERT_EQ(b.marks.size(), 2u);
  EXPECT_EQ(b.marks[0].seq, 3);
  EXPECT_EQ(b.marks[0].kind, Mark::kRejected);
  EXPECT_NE(b.marks[0].reason.find("not a valid"), std::string::npos);
  EXPECT_EQ(b.marks[1].seq, 6);
  EXPECT_NE(b.marks[1].reason.find("at most"), std::string::npos);
  EXPECT_FALSE(b.marks[1].from_log);
  // The rejected count as out: their successors are not claimed until
  // their fate is marked.
  EXPECT_EQ(b.busy,
            (std::vector<std::string>{Chain("a"), Chain("b"), Chain("c")}));
}

TEST(BuildBatchTest, FromTheLogWaitingEventsBecomeExceptions) {
  Candidate unreadable = Row("c", 6, 0);
  unreadable.parsed = false;
  BuiltBatch b = BuildBatch(
      {Row("a", 3, 1), Row("b", 4, 0), Row("a", 5, 3), unreadable,
       Row("c", 7, 6)},
      {.batch_id = 1, .from_log = true, .busy = [](const std::string& c) {
         return c == Chain("a");
       }});
  // a has an event out in an earlier batch: both of its events here are
  // owed; c's first is rejected, its second owed.
  EXPECT_EQ(b.batch.seqs, (std::vector<int64_t>{4}));
  EXPECT_TRUE(b.batch.from_log);
  ASSERT_EQ(b.marks.size(), 4u);
  EXPECT_EQ(b.marks[0].kind, Mark::kOwed);
  EXPECT_EQ(b.marks[0].seq, 3);
  EXPECT_EQ(b.marks[1].kind, Mark::kOwed);
  EXPECT_EQ(b.marks[2].kind, Mark::kRejected);
  EXPECT_TRUE(b.marks[2].from_log);
  EXPECT_EQ(b.marks[3].kind, Mark::kOwed);
  EXPECT_EQ(b.marks[3].seq, 7);
  EXPECT_EQ(b.busy.size(), 5u);  // every event is out
}

TEST(BuildBatchTest, APrevSeqBeforeTheSubscriptionStartsTheChain) {
  BuiltBatch b = BuildBatch({Row("a", 30, 12), Row("a", 31, 30)},
                            {.batch_id = 1, .chain_from = 20});
  EXPECT_EQ(b.batch.prev_seqs, (std::vector<int64_t>{0, 30}));
  EXPECT_EQ(b.request.events(0).prev_seq(), 0);
}

TEST(BuildBatchTest, ClaimedRowsStopPastTheByteBudget) {
  std::vector<Candidate> rows;
  for (int i = 1; i <= 10; ++i)
    rows.push_back(Row(absl::StrCat("x", i), i, 0, true, 1000));
  BuiltBatch b = BuildBatch(rows, {.batch_id = 1, .max_bytes = 2500});
  // Past 2,500 bytes after the third event: the fourth is not added.
  EXPECT_EQ(b.batch.seqs.size(), 3u);
  EXPECT_TRUE(b.cut_by_bytes);
  EXPECT_EQ(b.sent_through, 3);
  // The log's reader keeps its own budget: no cut here.
  BuiltBatch log =
      BuildBatch(rows, {.batch_id = 2, .from_log = true, .max_bytes = 2500});
  EXPECT_EQ(log.batch.seqs.size(), 10u);
  EXPECT_FALSE(log.cut_by_bytes);
}

}  // namespace
}  // namespace outbox::relay
