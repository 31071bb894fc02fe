// outbox::jetstream against a real 3-node JetStream cluster of its own
// (tests/testing/nats_cluster.sh): de-duplication by msg id, the
// per-subject compare-and-set, durable pull consumers with redelivery, and
// a replicated stream that loses its leader.

#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/jetstream.h"
#include "common/jetstream_subject.h"
#include "gtest/gtest.h"
#include "tests/testing/nats_cluster.h"
#include "tests/testing/wait.h"

namespace outbox::jetstream {
namespace {

using ::outbox::testing::NatsCluster;
using ::outbox::testing::WaitFor;

class JetStreamTest : public ::outbox::testing::NatsClusterTest {
 protected:
  void SetUp() override {
    NatsClusterTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    auto conn = Connection::Connect(
        {.servers = cluster()->urls(), .request_timeout = absl::Seconds(2)});
    ASSERT_TRUE(conn.ok()) << conn.status();
    conn_ = std::move(*conn);
  }

  // A replicas=3 stream on "<prefix>.>" with its leader elected: the
  // first publish after creation can find no leader yet.
  void MakeStream(const std::string& name, const std::string& prefix) {
    absl::Status s;
    ASSERT_TRUE(WaitFor(
        [&] {
          s = conn_->EnsureStream({.name = name,
                                   .subjects = {AllEventsUnder(prefix)},
                                   .replicas = 3});
          return s.ok();
        },
        absl::Seconds(20)))
        << s;
    ASSERT_TRUE(WaitFor(
        [&] {
          auto info = conn_->GetStreamInfo(name);
          return info.ok() && !info->leader.empty() &&
                 info->current_replicas.size() == 2;
        },
        absl::Seconds(20)))
        << "stream " << name << " has no leader and two current replicas";
  }

  std::string Subject(const std::string& prefix, const std::string& id) {
    auto subject = EventSubject(prefix, "order", id);
    EXPECT_TRUE(subject.ok()) << subject.status();
    return subject.value_or("");
  }

  std::unique_ptr<Connection> conn_;
};

TEST_F(JetStreamTest, SameMsgIdTwiceIsStoredOnce) {
  MakeStream("DEDUP", "dedup");
  const std::string subject = Subject("dedup", "o-1");
  auto first =
      conn_->Publish({.subject = subject, .data = "paid", .msg_id = "event-1"});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->duplicate);
  EXPECT_EQ(first->stream, "DEDUP");

  auto again =
      conn_->Publish({.subject = subject, .data = "paid", .msg_id = "event-1"});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->duplicate);
  EXPECT_EQ(again->sequence, first->sequence);

  auto info = conn_->GetStreamInfo("DEDUP");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->messages, 1u);
  auto stored = conn_->GetMessage("DEDUP", first->sequence);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->Header("Nats-Msg-Id"), "event-1");
  EXPECT_EQ(stored->data, "paid");
}

TEST_F(JetStreamTest, WrongExpectedLastSubjectSeqIsRefusedAndNotStored) {
  MakeStream("CAS", "cas");
  const std::string subject = Subject("cas", "o-1");
  auto first = conn_->Publish({.subject = subject,
                               .data = "1",
                               .msg_id = "e1",
                               .expected_last_subject_seq = 0});
  ASSERT_TRUE(first.ok()) << first.status();

  // "no message yet" no longer holds; nor does a sequence never used.
  for (uint64_t wrong : {uint64_t{0}, first->sequence + 7}) {
    auto refused = conn_->Publish({.subject = subject,
                                   .data = "2",
                                   .msg_id = absl::StrCat("e2-", wrong),
                                   .expected_last_subject_seq = wrong});
    ASSERT_FALSE(refused.ok()) << "stored at " << refused->sequence;
    EXPECT_TRUE(IsWrongLastSequence(refused.status())) << refused.status();
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(refused.status().message().find("10071"), std::string::npos)
        << refused.status();
  }

  auto info = conn_->GetStreamInfo("CAS");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->messages, 1u);
  auto last = conn_->LastOnSubject("CAS", subject);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->sequence, first->sequence);
  EXPECT_EQ(last->Header("Nats-Msg-Id"), "e1");

  auto none = conn_->LastOnSubject("CAS", Subject("cas", "never"));
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
  EXPECT_FALSE(IsWrongLastSequence(none.status()));
}

TEST_F(JetStreamTest, ChainsPerSubjectWithCorrectExpectations) {
  MakeStream("CHAIN", "chain");
  const std::vector<std::string> subjects = {
      Subject("chain", "a"), Subject("chain", "b.c"), Subject("chain", "")};
  std::map<std::string, uint64_t> last;  // subject -> its last stream seq
  std::map<std::string, std::vector<uint64_t>> chain;
  for (int i = 0; i < 30; ++i) {
    const std::string& subject = subjects[i % subjects.size()];
    auto ack = conn_->Publish({.subject = subject,
                               .data = absl::StrCat(i),
                               .msg_id = absl::StrCat("chain-", i),
                               .expected_last_subject_seq = last[subject]});
    ASSERT_TRUE(ack.ok()) << i << ": " << ack.status();
    EXPECT_FALSE(ack->duplicate);
    EXPECT_GT(ack->sequence, last[subject]);
    last[subject] = ack->sequence;
    chain[subject].push_back(ack->sequence);
  }
  for (const std::string& subject : subjects) {
    auto stored = conn_->LastOnSubject("CHAIN", subject);
    ASSERT_TRUE(stored.ok()) << stored.status();
    EXPECT_EQ(stored->sequence, last[subject]);
    EXPECT_EQ(chain[subject].size(), 10u);
  }
  auto info = conn_->GetStreamInfo("CHAIN");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->messages, 30u);
}

// The retry of a publish whose ack was lost carries the same msg id and
// the same (now stale) expectation. nats-server 2.9 in a cluster checks the
// expectation before the msg id and refuses it; a sink must then look at
// the subject's last message: its msg id says the event is in.
TEST_F(JetStreamTest, RetryWithStaleExpectationIsResolvedByTheLastMsgId) {
  MakeStream("RETRY", "retry");
  const std::string subject = Subject("retry", "o-1");
  auto e1 = conn_->Publish({.subject = subject,
                            .data = "1",
                            .msg_id = "e1",
                            .expected_last_subject_seq = 0});
  ASSERT_TRUE(e1.ok()) << e1.status();
  auto e2 = conn_->Publish({.subject = subject,
                            .data = "2",
                            .msg_id = "e2",
                            .expected_last_subject_seq = e1->sequence});
  ASSERT_TRUE(e2.ok()) << e2.status();

  auto retry = conn_->Publish({.subject = subject,
                               .data = "2",
                               .msg_id = "e2",
                               .expected_last_subject_seq = e1->sequence});
  if (retry.ok()) {
    EXPECT_TRUE(retry->duplicate);
    EXPECT_EQ(retry->sequence, e2->sequence);
  } else {
    ASSERT_TRUE(IsWrongLastSequence(retry.status())) << retry.status();
    auto last = conn_->LastOnSubject("RETRY", subject);
    ASSERT_TRUE(last.ok()) << last.status();
    EXPECT_EQ(last->Header("Nats-Msg-Id"), "e2");
    EXPECT_EQ(last->sequence, e2->sequence);
  }
  std::cout << "retry with a stale expectation: "
            << (retry.ok() ? "duplicate" : retry.status().ToString()) << "\n";
  auto info = conn_->GetStreamInfo("RETRY");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->messages, 2u);
}

TEST_F(JetStreamTest, PublishAllAnswersEachMessageInOrder) {
  MakeStream("ALL", "all");
  const std::string a = Subject("all", "a"), b = Subject("all", "b");
  auto first = conn_->Publish({.subject = a,
                               .data = "a1",
                               .msg_id = "a1",
                               .expected_last_subject_seq = 0});
  ASSERT_TRUE(first.ok()) << first.status();
  // 20 new subjects, a's successor, a stale expectation on a, a repeat.
  std::vector<OutgoingMessage> batch;
  for (int i = 0; i < 20; ++i) {
    batch.push_back({.subject = Subject("all", absl::StrCat("n", i)),
                     .data = absl::StrCat(i),
                     .msg_id = absl::StrCat("n", i),
                     .expected_last_subject_seq = 0});
  }
  batch.push_back({.subject = a,
                   .data = "a2",
                   .msg_id = "a2",
                   .expected_last_subject_seq = first->sequence});
  batch.push_back({.subject = b,
                   .data = "b?",
                   .msg_id = "b?",
                   .expected_last_subject_seq = 99});
  batch.push_back({.subject = Subject("all", "n0"),
                   .data = "0",
                   .msg_id = "n0"});  // no expectation: the msg id repeats
  std::vector<absl::StatusOr<PublishAck>> acks = conn_->PublishAll(batch);
  ASSERT_EQ(acks.size(), batch.size());
  std::set<uint64_t> seqs;
  for (int i = 0; i < 21; ++i) {
    ASSERT_TRUE(acks[i].ok()) << i << ": " << acks[i].status();
    EXPECT_FALSE(acks[i]->duplicate);
    seqs.insert(acks[i]->sequence);
  }
  EXPECT_EQ(seqs.size(), 21u);
  EXPECT_TRUE(IsWrongLastSequence(acks[21].status())) << acks[21].status();
  ASSERT_TRUE(acks[22].ok()) << acks[22].status();
  EXPECT_TRUE(acks[22]->duplicate);
  EXPECT_EQ(acks[22]->sequence, acks[0]->sequence);
  auto info = conn_->GetStreamInfo("ALL");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->messages, 22u);
  EXPECT_TRUE(conn_->PublishAll({}).empty());
}

TEST_F(JetStreamTest, EnsureStreamIsIdempotentAndUpdates) {
  StreamOptions options{
      .name = "ENSURE", .subjects = {AllEventsUnder("ensure")}, .replicas = 3};
  MakeStream(options.name, "ensure");
  EXPECT_TRUE(conn_->EnsureStream(options).ok());
  options.duplicate_window = absl::Minutes(5);
  options.max_age = absl::Hours(24);
  absl::Status updated = conn_->EnsureStream(options);
  EXPECT_TRUE(updated.ok()) << updated;
  auto info = conn_->GetStreamInfo("ENSURE");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->replicas.size(), 2u);  // the leader's two peers

  auto missing = conn_->GetStreamInfo("NO_SUCH_STREAM");
  EXPECT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
}

// Faults of the world, never of the event: no stream for the subject, and
// a cluster that holds its connections open but answers nothing.
TEST_F(JetStreamTest, NoStreamIsUnavailableAFrozenClusterDeadlineExceeded) {
  MakeStream("FROZEN", "frozen");
  auto nobody = conn_->Publish(
      {.subject = "nostream.order.1", .data = "x", .msg_id = "n1"});
  EXPECT_TRUE(absl::IsUnavailable(nobody.status())) << nobody.status();

  auto fast = Connection::Connect(
      {.servers = cluster()->urls(), .request_timeout = absl::Seconds(1)});
  ASSERT_TRUE(fast.ok()) << fast.status();
  for (int node = 1; node <= 3; ++node) {
    ASSERT_TRUE(cluster()->Pause(node).ok());
  }
  const absl::Time sent = absl::Now();
  auto frozen = (*fast)->Publish(
      {.subject = Subject("frozen", "o-1"), .data = "x", .msg_id = "f1"});
  const absl::Duration took = absl::Now() - sent;
  for (int node = 1; node <= 3; ++node) {
    ASSERT_TRUE(cluster()->Resume(node).ok());
  }
  EXPECT_TRUE(absl::IsDeadlineExceeded(frozen.status())) << frozen.status();
  EXPECT_FALSE(IsWrongLastSequence(frozen.status()));
  EXPECT_LT(took, absl::Seconds(5));
  std::cout << "publish to a frozen cluster: " << frozen.status() << " after "
            << took << "\n";

  // Thawed, the same event goes in (once, whatever the frozen attempt
  // did) within a bounded time.
  absl::StatusOr<PublishAck> ack;
  EXPECT_TRUE(WaitFor(
      [&] {
        ack = (*fast)->Publish(
            {.subject = Subject("frozen", "o-1"), .data = "x", .msg_id = "f1"});
        return ack.ok();
      },
      absl::Seconds(30)))
      << ack.status();
  auto info = conn_->GetStreamInfo("FROZEN");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->messages, 1u);
}

TEST_F(JetStreamTest, UnackedIsRedeliveredAfterAckWaitAckedIsNot) {
  MakeStream("PULL", "pull");
  std::vector<uint64_t> seqs;
  for (int i = 0; i < 3; ++i) {
    auto ack = conn_->Publish({.subject = Subject("pull", absl::StrCat("o", i)),
                               .data = absl::StrCat("payload-", i),
                               .msg_id = absl::StrCat("pull-", i),
                               .headers = {{"Outbox-Event-Type", "Paid"}}});
    ASSERT_TRUE(ack.ok()) << ack.status();
    seqs.push_back(ack->sequence);
  }
  const PullConsumerOptions options{.stream = "PULL",
                                    .durable = "billing",
                                    .filter_subject = AllEventsUnder("pull"),
                                    .ack_wait = absl::Seconds(1)};
  auto consumer = conn_->PullSubscribe(options);
  ASSERT_TRUE(consumer.ok()) << consumer.status();

  std::vector<Message> got;
  absl::Time delivered;  // when the last of the three came
  ASSERT_TRUE(WaitFor(
      [&] {
        auto batch = (*consumer)->Fetch(3 - got.size(), absl::Seconds(1));
        EXPECT_TRUE(batch.ok()) << batch.status();
        if (batch.ok()) {
          for (Message& m : *batch) got.push_back(std::move(m));
        }
        delivered = absl::Now();
        return got.size() >= 3;
      },
      absl::Seconds(10)));
  ASSERT_EQ(got.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i].stream_seq(), seqs[i]);
    EXPECT_EQ(got[i].num_delivered(), 1u);
    EXPECT_EQ(got[i].data(), absl::StrCat("payload-", i));
    EXPECT_EQ(got[i].subject(), Subject("pull", absl::StrCat("o", i)));
    EXPECT_EQ(got[i].Header("Nats-Msg-Id"), absl::StrCat("pull-", i));
    EXPECT_EQ(got[i].Header("Outbox-Event-Type"), "Paid");
    EXPECT_GT(got[i].timestamp(), absl::Now() - absl::Minutes(5));
  }
  EXPECT_EQ(got[2].num_pending(), 0u);
  ASSERT_TRUE(got[0].Ack().ok());
  ASSERT_TRUE(got[1].Ack().ok());
  // got[2] is neither acked nor nacked: back after AckWait (1 s).
  std::vector<Message> again;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto batch = (*consumer)->Fetch(10, absl::Milliseconds(500));
        if (batch.ok()) {
          for (Message& m : *batch) again.push_back(std::move(m));
        }
        return !again.empty();
      },
      absl::Seconds(10)));
  const absl::Duration waited = absl::Now() - delivered;
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].stream_seq(), seqs[2]);
  EXPECT_EQ(again[0].num_delivered(), 2u);
  EXPECT_GE(waited, absl::Milliseconds(900));
  std::cout << "redelivered after " << waited << "\n";

  // A nak with a delay brings it back once more, not sooner.
  const absl::Time naked = absl::Now();
  ASSERT_TRUE(again[0].Nak(absl::Milliseconds(300)).ok());
  std::vector<Message> third;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto batch = (*consumer)->Fetch(10, absl::Milliseconds(500));
        if (batch.ok()) {
          for (Message& m : *batch) third.push_back(std::move(m));
        }
        return !third.empty();
      },
      absl::Seconds(10)));
  ASSERT_EQ(third.size(), 1u);
  EXPECT_EQ(third[0].num_delivered(), 3u);
  EXPECT_GE(absl::Now() - naked, absl::Milliseconds(250));
  ASSERT_TRUE(third[0].Ack().ok());

  // Acked ones stay acked, past AckWait and through a new subscription
  // to the same durable consumer.
  consumer->reset();
  auto resumed = conn_->PullSubscribe(options);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  auto rest = (*resumed)->Fetch(10, absl::Milliseconds(1500));
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_TRUE(rest->empty()) << rest->size() << " redelivered, first seq "
                             << rest->front().stream_seq();
}

// Publishes `id` until it is acknowledged, at most `limit`: a refused
// expectation whose subject already ends with `id` is its own lost ack.
absl::StatusOr<uint64_t> PublishUntilAcked(
    Connection& conn, const std::string& stream, const std::string& subject,
    const std::string& id, uint64_t expected, absl::Duration limit,
    int* attempts, std::set<std::string>* seen) {
  const absl::Time deadline = absl::Now() + limit;
  absl::Status last = absl::DeadlineExceededError("no attempt");
  while (absl::Now() < deadline) {
    ++*attempts;
    auto ack = conn.Publish({.subject = subject,
                             .data = id,
                             .msg_id = id,
                             .expected_last_subject_seq = expected});
    if (ack.ok()) return ack->sequence;
    last = ack.status();
    seen->insert(absl::StatusCodeToString(last.code()));
    if (IsWrongLastSequence(last)) {
      auto stored = conn.LastOnSubject(stream, subject);
      if (stored.ok() && stored->Header("Nats-Msg-Id") == id) {
        return stored->sequence;
      }
      return last;  // someone else's event: a real conflict
    }
    // A fault of the world (no leader yet, a connection moving): again.
    EXPECT_TRUE(absl::IsUnavailable(last) || absl::IsDeadlineExceeded(last))
        << last;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return last;
}

TEST_F(JetStreamTest, ReplicatedStreamSurvivesItsLeadersCrash) {
  MakeStream("HA", "ha");
  const std::vector<std::string> subjects = {Subject("ha", "o-1"),
                                             Subject("ha", "o-2")};
  std::map<std::string, uint64_t> last;
  std::map<std::string, std::string> acked;               // event id -> subject
  std::map<std::string, std::vector<std::string>> order;  // subject -> ids
  int attempts = 0, n = 0;
  std::set<std::string> publish_errors, fetch_errors;
  auto publish_some = [&](int count) {
    for (int i = 0; i < count; ++i, ++n) {
      const std::string& subject = subjects[n % subjects.size()];
      const std::string id = absl::StrCat("ha-", n);
      auto seq =
          PublishUntilAcked(*conn_, "HA", subject, id, last[subject],
                            absl::Seconds(30), &attempts, &publish_errors);
      ASSERT_TRUE(seq.ok()) << id << ": " << seq.status();
      last[subject] = *seq;
      acked[id] = subject;
      order[subject].push_back(id);
    }
  };
  publish_some(20);

  auto before = conn_->GetStreamInfo("HA");
  ASSERT_TRUE(before.ok()) << before.status();
  const std::string old_leader = before->leader;
  const int node = NatsCluster::NodeOf(old_leader);
  ASSERT_NE(node, 0) << "leader " << old_leader;
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(cluster()->Kill(node).ok());

  attempts = 0;
  publish_some(1);  // the first acknowledged publish after the crash
  const absl::Duration failover = absl::Now() - killed;
  std::cout << "stream leader " << old_leader << " killed; first ack after "
            << failover << " (" << attempts << " attempts)\n";
  publish_some(19);
  auto during = conn_->GetStreamInfo("HA");
  ASSERT_TRUE(during.ok()) << during.status();
  EXPECT_NE(during->leader, old_leader);
  EXPECT_FALSE(during->leader.empty());
  EXPECT_EQ(during->messages, acked.size());

  const absl::Time restarted = absl::Now();
  ASSERT_TRUE(cluster()->Restart(node).ok()) << cluster()->Logs();
  ASSERT_TRUE(WaitFor(
      [&] {
        auto info = conn_->GetStreamInfo("HA");
        return info.ok() && info->current_replicas.size() == 2;
      },
      absl::Seconds(30)))
      << "the restarted node did not catch up\n"
      << cluster()->Logs();
  std::cout << "old leader back and current after " << (absl::Now() - restarted)
            << "\n";

  // Then the leader of now goes down too: the stream is left to the
  // restarted node and one other, so what follows is read from a copy
  // that the restarted node holds.
  auto now = conn_->GetStreamInfo("HA");
  ASSERT_TRUE(now.ok()) << now.status();
  const int second = NatsCluster::NodeOf(now->leader);
  ASSERT_NE(second, 0) << "leader " << now->leader;
  ASSERT_TRUE(cluster()->Kill(second).ok());
  const absl::Time second_killed = absl::Now();

  // Every acknowledged event, once, in its subject's order, through a
  // durable consumer.
  std::map<std::string, std::vector<std::string>> read;
  size_t total = 0;
  std::unique_ptr<PullConsumer> consumer;
  ASSERT_TRUE(WaitFor(
      [&] {
        if (consumer == nullptr) {
          auto made = conn_->PullSubscribe({.stream = "HA",
                                            .durable = "after-crash",
                                            .ack_wait = absl::Seconds(30)});
          if (!made.ok()) {  // no leader yet: again
            fetch_errors.insert(absl::StatusCodeToString(made.status().code()));
            return false;
          }
          consumer = std::move(*made);
        }
        auto batch = consumer->Fetch(50, absl::Seconds(1));
        if (!batch.ok()) {
          fetch_errors.insert(absl::StatusCodeToString(batch.status().code()));
          EXPECT_TRUE(absl::IsUnavailable(batch.status()) ||
                      absl::IsDeadlineExceeded(batch.status()))
              << batch.status();
          return false;
        }
        for (Message& m : *batch) {
          read[m.subject()].push_back(m.Header("Nats-Msg-Id"));
          ++total;
          EXPECT_TRUE(m.Ack().ok());
        }
        return total >= acked.size();
      },
      absl::Seconds(40)));
  std::cout << "leader " << now->leader << " killed too; " << total
            << " events read after " << (absl::Now() - second_killed) << "\n";
  std::cout << "errors seen: publish " << absl::StrJoin(publish_errors, ",")
            << "; subscribe and fetch " << absl::StrJoin(fetch_errors, ",")
            << "\n";
  EXPECT_EQ(total, acked.size());
  EXPECT_EQ(read, order);
  // The stream's info is asked of its leader: until the election settles
  // (4-9 s on 2.9, longer on a loaded machine) it may not answer.
  absl::StatusOr<StreamInfo> info;
  ASSERT_TRUE(WaitFor(
      [&] {
        info = conn_->GetStreamInfo("HA");
        return info.ok() && !info->leader.empty();
      },
      absl::Seconds(30)))
      << info.status();
  EXPECT_EQ(info->messages, acked.size());
  EXPECT_NE(info->leader, now->leader);
  ASSERT_TRUE(cluster()->Restart(second).ok()) << cluster()->Logs();
}

}  // namespace
}  // namespace outbox::jetstream
