// Where the JetStream sink places an event given its aggregate's newest
// message in the stream (Place), and how a stored message reads as a tip.

#include "relay/jetstream_sink.h"

#include <gtest/gtest.h>

namespace outbox::relay {
namespace {

v1::Event Event(int64_t seq, int64_t prev, const std::string& id) {
  v1::Event e;
  e.set_seq(seq);
  e.set_prev_seq(prev);
  e.set_event_id(id);
  return e;
}

SubjectTip Tip(uint64_t stream_seq, int64_t seq, const std::string& id) {
  return {.stream_seq = stream_seq, .outbox_seq = seq, .event_id = id};
}

TEST(PlaceTest, FirstEventOfAnEmptySubjectExpectsNoMessage) {
  const Placement p = Place({}, Event(5, 0, "a"));
  EXPECT_EQ(p.kind, Placement::kPublish);
  EXPECT_EQ(p.expected, 0u);
}

TEST(PlaceTest, AnEventWithAPredecessorOnAnEmptySubjectIsRejected) {
  const Placement p = Place({}, Event(9, 5, "b"));
  EXPECT_EQ(p.kind, Placement::kNoPredecessor);
  EXPECT_NE(p.reason.find("seq 5"), std::string::npos) << p.reason;
}

TEST(PlaceTest, TheSuccessorOfTheTipExpectsTheTipsStreamSequence) {
  const Placement p = Place(Tip(41, 5, "a"), Event(9, 5, "b"));
  EXPECT_EQ(p.kind, Placement::kPublish);
  EXPECT_EQ(p.expected, 41u);
}

TEST(PlaceTest, TheTipItselfIsADuplicateAndAnotherEventThereDiverged) {
  EXPECT_EQ(Place(Tip(41, 9, "b"), Event(9, 5, "b")).kind,
            Placement::kDuplicate);
  const Placement p = Place(Tip(41, 9, "x"), Event(9, 5, "b"));
  EXPECT_EQ(p.kind, Placement::kDiverged);
  EXPECT_NE(p.reason.find("(x)"), std::string::npos) << p.reason;
}

TEST(PlaceTest, AnEventBehindTheTipIsLookedUpAlongTheChain) {
  EXPECT_EQ(Place(Tip(50, 12, "c"), Event(9, 5, "b")).kind,
            Placement::kWalkBack);
}

TEST(PlaceTest, ATipBeforeThePredecessorMeansThePredecessorIsMissing) {
  const Placement p = Place(Tip(30, 3, "z"), Event(9, 5, "b"));
  EXPECT_EQ(p.kind, Placement::kNoPredecessor);
  EXPECT_NE(p.reason.find("seq 3"), std::string::npos) << p.reason;
}

TEST(PlaceTest, ATipBetweenPredecessorAndEventIsAnotherHistory) {
  const Placement p = Place(Tip(44, 7, "y"), Event(9, 5, "b"));
  EXPECT_EQ(p.kind, Placement::kDiverged);
  // A first event whose subject already has a history: the same.
  EXPECT_EQ(Place(Tip(44, 7, "y"), Event(9, 0, "b")).kind,
            Placement::kDiverged);
}

TEST(PlaceTest, AForeignMessageOnTheSubjectIsNeverBuiltOn) {
  EXPECT_EQ(Place({.stream_seq = 8, .outbox_seq = -1}, Event(9, 5, "b")).kind,
            Placement::kDiverged);
  EXPECT_EQ(Place({.stream_seq = 8, .outbox_seq = -1}, Event(9, 0, "b")).kind,
            Placement::kDiverged);
}

TEST(TipOfTest, ReadsTheRelaysHeaders) {
  jetstream::StoredMessage m{.subject = "outbox.order.o-1", .sequence = 17};
  m.headers = {{"Nats-Msg-Id", "e-1"},
               {"Outbox-Seq", "9"},
               {"Outbox-Prev-Stream-Seq", "12"}};
  absl::StatusOr<SubjectTip> tip = TipOf(m);
  ASSERT_TRUE(tip.ok()) << tip.status();
  EXPECT_EQ(tip->stream_seq, 17u);
  EXPECT_EQ(tip->outbox_seq, 9);
  EXPECT_EQ(tip->event_id, "e-1");
  EXPECT_EQ(tip->prev_stream_seq, 12u);
}

TEST(TipOfTest, AMessageWithoutTheHeadersIsNotATip) {
  jetstream::StoredMessage m{.subject = "outbox.order.o-1", .sequence = 3};
  EXPECT_EQ(TipOf(m).status().code(), absl::StatusCode::kInvalidArgument);
  m.headers = {{"Nats-Msg-Id", "e-1"}, {"Outbox-Seq", "nine"}};
  EXPECT_EQ(TipOf(m).status().code(), absl::StatusCode::kInvalidArgument);
  m.headers = {{"Nats-Msg-Id", "e-1"},
               {"Outbox-Seq", "9"},
               {"Outbox-Prev-Stream-Seq", "-"}};
  EXPECT_EQ(TipOf(m).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(JetStreamSinkTest, CreateRefusesBadSettingsByName) {
  JetStreamSinkOptions o;
  EXPECT_NE(JetStreamSink::Create(o).status().message().find("server"),
            std::string::npos);
  o.connect.servers = {"nats://127.0.0.1:1"};
  o.subject_prefix = "a.*";
  EXPECT_NE(JetStreamSink::Create(o).status().message().find("prefix"),
            std::string::npos);
  o.subject_prefix = "outbox";
  o.stream = "A.B";
  EXPECT_NE(JetStreamSink::Create(o).status().message().find("stream"),
            std::string::npos);
  o.stream = "OUTBOX";
  o.replicas = 0;
  EXPECT_NE(JetStreamSink::Create(o).status().message().find("replicas"),
            std::string::npos);
  o.replicas = 3;
  o.max_per_aggregate = -1;
  EXPECT_NE(JetStreamSink::Create(o).status().message().find("per aggregate"),
            std::string::npos);
  o.max_per_aggregate = 0;
  EXPECT_TRUE(JetStreamSink::Create(o).ok());
}

TEST(UntakenPublishesTest, PersistentOnlyInARowAndOverTime) {
  UntakenPublishes u;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_FALSE(u.Persistent(t0));
  for (int i = 0; i < UntakenPublishes::kInARow; ++i) u.Untaken(t0);
  EXPECT_FALSE(
      u.Persistent(t0 + UntakenPublishes::kFor - absl::Milliseconds(1)));
  EXPECT_TRUE(u.Persistent(t0 + UntakenPublishes::kFor));
  // One publish taken: the server has the interest after all.
  u.Taken();
  EXPECT_FALSE(u.Persistent(t0 + absl::Hours(1)));
  // Fewer than kInARow, however long ago the first.
  for (int i = 1; i < UntakenPublishes::kInARow; ++i) u.Untaken(t0);
  EXPECT_FALSE(u.Persistent(t0 + absl::Hours(1)));
  // The time runs from the first of the row, not the last.
  u.Untaken(t0 + UntakenPublishes::kFor);
  EXPECT_TRUE(u.Persistent(t0 + UntakenPublishes::kFor));
}

}  // namespace
}  // namespace outbox::relay
