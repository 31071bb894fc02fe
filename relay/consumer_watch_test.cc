#include "relay/consumer_watch.h"

#include <gtest/gtest.h>

namespace outbox::relay {
namespace {

v1::DeliverResponse Answer(int64_t applied_from, int64_t applied_through,
                           uint64_t system = 0, uint32_t timeline = 1) {
  v1::DeliverResponse r;
  r.set_applied_from(applied_from);
  r.set_applied_through(applied_through);
  if (system != 0) {
    r.mutable_inbox()->set_system_identifier(system);
    r.mutable_inbox()->set_timeline(timeline);
    r.mutable_inbox()->set_database_oid(16384);
  }
  return r;
}

DatabaseIdentity Identity(uint64_t system, uint32_t timeline = 1) {
  return {.system_identifier = system,
          .timeline = timeline,
          .database_oid = 16384};
}

TEST(ConsumerWatchTest, InboxNumbersOnlyGrowWhileTheDatabaseKeepsThem) {
  ConsumerWatch watch("billing", nullptr);
  watch.Stored(Identity(7));
  EXPECT_FALSE(watch.pending());
  EXPECT_FALSE(watch.Observe(Answer(1, 10, 7), 0));
  EXPECT_EQ(watch.inbox_high(), 10);
  // A batch sent before the answer above was numbered above 0; a later one
  // above 10.
  EXPECT_FALSE(watch.Observe(Answer(11, 20, 7), 0));
  EXPECT_FALSE(watch.Observe(Answer(21, 25, 7), 10));
  EXPECT_EQ(watch.inbox_high(), 25);
  // Nothing applied (all duplicates): no number, nothing learnt.
  EXPECT_FALSE(watch.Observe(Answer(0, 0, 7), 25));
  EXPECT_EQ(watch.inbox_high(), 25);
  EXPECT_FALSE(watch.pending());
}

TEST(ConsumerWatchTest, ANumberAtOrBelowOneAnsweredBeforeSendingWentBack) {
  ConsumerWatch watch("billing", nullptr);
  watch.Stored(Identity(7));
  ASSERT_FALSE(watch.Observe(Answer(1, 40, 7), 0));
  // Sent when 40 had been answered; the inbox numbered it 12: restored in
  // place under the same identity.
  EXPECT_TRUE(watch.Observe(Answer(12, 15, 7), 40));
  EXPECT_TRUE(watch.pending());  // a heal request to write
  EXPECT_EQ(watch.inbox_high(), 15);  // the restored inbox's numbers
  // Once known, the same fall is not reported again before Record.
  EXPECT_FALSE(watch.Observe(Answer(3, 4, 7), 15));
}

TEST(ConsumerWatchTest, AnotherDatabaseStartsItsOwnNumbers) {
  ConsumerWatch watch("billing", nullptr);
  watch.Stored(Identity(7));
  ASSERT_FALSE(watch.Observe(Answer(1, 500, 7), 0));
  // Another server (a promoted standby has another timeline): its numbers
  // are its own, so a low one is not a fall, and its identity is to store.
  EXPECT_FALSE(watch.Observe(Answer(3, 9, 7, 2), 0));
  EXPECT_TRUE(watch.pending());
  EXPECT_EQ(watch.inbox_high(), 9);
}

TEST(ConsumerWatchTest, TheStoredIdentityIsNothingToWrite) {
  ConsumerWatch watch("billing", nullptr);
  watch.Stored(Identity(7));
  EXPECT_FALSE(watch.Observe(Answer(1, 2, 7), 0));
  EXPECT_FALSE(watch.pending());
  // An answer without an identity (an older consumer) changes nothing.
  EXPECT_FALSE(watch.Observe(Answer(3, 4), 2));
  EXPECT_FALSE(watch.pending());
}

TEST(ConsumerWatchTest, LackedEventsWaitForRecordUnlessDropped) {
  ConsumerWatch watch("billing", nullptr);
  watch.Lacks({{.chain = "a", .after = 10, .through = 14}});
  EXPECT_TRUE(watch.pending());
  watch.DropLacking();
  EXPECT_FALSE(watch.pending());
}

}  // namespace
}  // namespace outbox::relay
