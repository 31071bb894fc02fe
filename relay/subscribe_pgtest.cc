// How a relay takes up its subscription, against a real PostgreSQL: the
// source is recorded once and kept, a new subscription is owed every
// retained event (or none from now) and waits for the writers in flight
// when it was made, an operator's drop is respected unless resubscribed, a
// read-only database serves what is there, and the log is entered on
// request only. And the worker's attempts at a session (pure): a failure
// waits its backoff, a refusal is an error, a success starts it anew.

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "common/schema.h"
#include "relay/delivery_store.h"
#include "relay/log_testing.h"
#include "relay/subscribe.h"
#include "relay/subscriptions.h"
#include "tests/testing/pg.h"
#include "tests/testing/wait.h"

namespace outbox::relay {
namespace {

class SubscribeTest : public ::testing::Test {
 protected:
  SubscribeTest() : db_("subscribe", {OutboxSchema()}), conn_(db_.url()) {}

  SubscribeOptions Options(StartFrom from = StartFrom::kOldest) {
    return {.subscription = "billing", .start_from = from, .actor = "test"};
  }

  Subscribed TakeUp(const SubscribeOptions& options) {
    absl::StatusOr<Subscribed> s = TakeUpSubscription(conn_, options);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : Subscribed{};
  }

  int64_t AppendOne(const std::string& aggregate) {
    pqxx::connection c(db_.url());
    pqxx::work tx(c);
    const int64_t seq = Append(tx, aggregate);
    tx.commit();
    return seq;
  }

  int64_t Owed() {
    return db_.Scalar(
        "SELECT count(*) FROM outbox_delivery WHERE subscription = "
        "'billing'");
  }

  testing::TestDatabase db_;
  pqxx::connection conn_;
};

TEST(SubscriptionName, IsWhatTheTableAccepts) {
  EXPECT_TRUE(IsSubscriptionName("billing"));
  EXPECT_TRUE(IsSubscriptionName("b-2_x"));
  EXPECT_FALSE(IsSubscriptionName(""));
  EXPECT_FALSE(IsSubscriptionName("Billing"));
  EXPECT_FALSE(IsSubscriptionName("2billing"));
  EXPECT_FALSE(IsSubscriptionName("bill ing"));
  EXPECT_FALSE(IsSubscriptionName(std::string(64, 'a')));
  EXPECT_TRUE(IsSubscriptionName(std::string(63, 'a')));
}

TEST_F(SubscribeTest, TheSourceIsRecordedOnceAndAnotherIsRefused) {
  const Subscribed first = TakeUp(Options());
  EXPECT_TRUE(first.refused.empty()) << first.refused;
  EXPECT_TRUE(absl::StartsWith(first.source, db_.name() + "-")) << first.source;
  EXPECT_EQ(TakeUp(Options()).source, first.source);
  SubscribeOptions other = Options();
  other.source = "elsewhere";
  const Subscribed refused = TakeUp(other);
  EXPECT_TRUE(absl::StrContains(refused.refused, "elsewhere"))
      << refused.refused;
  EXPECT_TRUE(absl::StrContains(refused.refused, first.source))
      << refused.refused;
  other.source = first.source;
  EXPECT_TRUE(TakeUp(other).refused.empty());
}

TEST_F(SubscribeTest, FromTheOldestEveryRetainedEventIsOwed) {
  const int64_t a = AppendOne("a");
  AppendOne("b");
  AppendOne("c");
  db_.Exec("DELETE FROM outbox WHERE seq = " + std::to_string(a));
  db_.Exec("UPDATE outbox_retention_state SET deleted_through = " +
           std::to_string(a));
  const Subscribed s = TakeUp(Options());
  EXPECT_TRUE(s.created);
  EXPECT_GT(s.id, 0);
  EXPECT_EQ(Owed(), 2);
  // Chains start at the oldest retained event: a's successor would have
  // its predecessor deleted before the subscription existed.
  EXPECT_EQ(s.chain_from, a + 1);
  // Taken up again: the same, nothing made twice.
  const Subscribed again = TakeUp(Options());
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.id, s.id);
  EXPECT_EQ(again.chain_from, s.chain_from);
  EXPECT_EQ(Owed(), 2);
}

TEST_F(SubscribeTest, FromNowOnlyLaterEventsAreOwed) {
  const int64_t old = AppendOne("a");
  const Subscribed s = TakeUp(Options(StartFrom::kNow));
  EXPECT_TRUE(s.created);
  EXPECT_EQ(Owed(), 0);
  EXPECT_EQ(s.chain_from, old + 1);
  AppendOne("a");
  EXPECT_EQ(Owed(), 1);
}

TEST_F(SubscribeTest, AWriterInFlightWhenItIsMadeIsWaitedForAndOwed) {
  // A producer's transaction that wrote before the subscription existed
  // and commits after: its trigger never saw the subscription.
  pqxx::connection writer_conn(db_.url());
  auto writer = std::make_unique<pqxx::work>(writer_conn);
  const int64_t late = Append(*writer, "late");
  std::atomic<bool> done{false};
  absl::StatusOr<Subscribed> s;
  std::thread taker([&] {
    pqxx::connection c(db_.url());
    s = TakeUpSubscription(c, Options());
    done = true;
  });
  EXPECT_FALSE(
      testing::WaitFor([&] { return done.load(); }, absl::Milliseconds(700)))
      << "did not wait for the writer";
  writer->commit();
  ASSERT_TRUE(testing::WaitFor([&] { return done.load(); }));
  taker.join();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM outbox_delivery WHERE seq = " +
                       std::to_string(late)),
            1);
  EXPECT_EQ(s->chain_from, late);
}

TEST_F(SubscribeTest, AStopEndsTheWaitForAWriter) {
  pqxx::connection writer_conn(db_.url());
  pqxx::work writer(writer_conn);
  Append(writer, "late");
  SubscribeOptions options = Options();
  options.stopping = [] { return true; };
  const absl::StatusOr<Subscribed> s = TakeUpSubscription(conn_, options);
  EXPECT_TRUE(absl::IsUnavailable(s.status())) << s.status();
  // Made, not settled: the next try settles it.
  EXPECT_EQ(db_.Scalar("SELECT chain_from FROM subscriptions"), -1);
  writer.commit();
  const Subscribed settled = TakeUp(Options());
  EXPECT_GT(settled.chain_from, 0);
  EXPECT_EQ(Owed(), 1);
}

TEST_F(SubscribeTest, ADroppedSubscriptionIsRefusedUnlessResubscribed) {
  const Subscribed s = TakeUp(Options());
  {
    pqxx::work tx(conn_);
    ASSERT_TRUE(ActOnSubscription(tx, "billing", SubscriptionAction::kDrop,
                                  "ops", "moved to JetStream", true)
                    .ok());
    tx.commit();
  }
  const Subscribed refused = TakeUp(Options());
  EXPECT_TRUE(absl::StrContains(refused.refused, "was dropped"))
      << refused.refused;
  EXPECT_TRUE(absl::StrContains(refused.refused, "moved to JetStream"))
      << refused.refused;
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM subscriptions"), 0);
  SubscribeOptions anew = Options();
  anew.resubscribe = true;
  const Subscribed made = TakeUp(anew);
  EXPECT_TRUE(made.refused.empty()) << made.refused;
  EXPECT_TRUE(made.created);
  EXPECT_NE(made.id, s.id);
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM subscription_actions WHERE "
                       "action = 'resubscribe' AND actor = 'test'"),
            1);
}

TEST_F(SubscribeTest, AReadOnlyDatabaseServesWhatIsThere) {
  const Subscribed s = TakeUp(Options());
  db_.Exec("ALTER DATABASE " + db_.name() +
           " SET default_transaction_read_only = on");
  pqxx::connection ro(db_.url());
  absl::StatusOr<Subscribed> again = TakeUpSubscription(ro, Options());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->id, s.id);
  EXPECT_EQ(again->source, s.source);
  // One that is not there cannot be made: an error of the world, retried.
  SubscribeOptions other = Options();
  other.subscription = "audit";
  EXPECT_FALSE(TakeUpSubscription(ro, other).ok());
  db_.Exec("ALTER DATABASE " + db_.name() +
           " RESET default_transaction_read_only");
}

TEST_F(SubscribeTest, TheLogIsEnteredOnRequestOnly) {
  TakeUp(Options());
  absl::StatusOr<std::optional<int64_t>> tick =
      EnsureLogDelivery(conn_, "billing", false);
  ASSERT_TRUE(tick.ok()) << tick.status();
  EXPECT_FALSE(tick->has_value());
  tick = EnsureLogDelivery(conn_, "billing", true);
  ASSERT_TRUE(tick.ok()) << tick.status();
  ASSERT_TRUE(tick->has_value());
  const int64_t start = **tick;
  // On the log it stays, whatever a later relay asks.
  tick = EnsureLogDelivery(conn_, "billing", false);
  ASSERT_TRUE(tick.ok()) << tick.status();
  EXPECT_EQ(tick->value_or(0), start);
  tick = EnsureLogDelivery(conn_, "nobody", true);
  ASSERT_TRUE(tick.ok()) << tick.status();
  EXPECT_FALSE(tick->has_value());
}

TEST_F(SubscribeTest, AnOperatorsMoveOffTheLogOutweighsARelaysFlag) {
  TakeUp(Options());
  const auto act = [&](SubscriptionAction action) {
    pqxx::work tx(conn_);
    absl::Status s =
        ActOnSubscription(tx, "billing", action, "ops", "test", false);
    if (s.ok()) tx.commit();
    return s;
  };
  ASSERT_TRUE(act(SubscriptionAction::kToLog).ok());
  EXPECT_EQ(act(SubscriptionAction::kToLog).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(act(SubscriptionAction::kToRows).ok());
  EXPECT_EQ(act(SubscriptionAction::kToRows).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(act(SubscriptionAction::kToRows).code(),
            absl::StatusCode::kFailedPrecondition);
  // A relay started with --log_delivery leaves it on rows.
  absl::StatusOr<std::optional<int64_t>> tick =
      EnsureLogDelivery(conn_, "billing", true);
  ASSERT_TRUE(tick.ok()) << tick.status();
  EXPECT_FALSE(tick->has_value());
  // Until an operator moves it onto the log again.
  ASSERT_TRUE(act(SubscriptionAction::kToLog).ok());
  ASSERT_TRUE(act(SubscriptionAction::kToRows).ok());
  ASSERT_TRUE(act(SubscriptionAction::kToLog).ok());
  tick = EnsureLogDelivery(conn_, "billing", true);
  ASSERT_TRUE(tick.ok()) << tick.status();
  EXPECT_TRUE(tick->has_value());
  EXPECT_EQ(db_.Scalar("SELECT count(*) FROM subscription_actions WHERE "
                       "subscription = 'billing' AND actor = 'ops'"),
            5);
  // A subscription made again after a drop starts without that history.
  ASSERT_TRUE(act(SubscriptionAction::kToRows).ok());
  db_.Exec("DELETE FROM subscriptions WHERE name = 'billing'");
  absl::SleepFor(absl::Milliseconds(5));  // created_at after the move
  db_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
  tick = EnsureLogDelivery(conn_, "billing", true);
  ASSERT_TRUE(tick.ok()) << tick.status();
  EXPECT_TRUE(tick->has_value());
}

// What a relay's session starts from: the subscription, whether it is on
// the log, the outbox database's recorded identity (recorded by the first
// session if there was none) and the consumer's as stored.
TEST_F(SubscribeTest, ASessionStartsFromWhatTheDatabaseRecorded) {
  const DatabaseIdentity session{
      .system_identifier = 42, .timeline = 1, .database_oid = 7};
  absl::StatusOr<TakenUp> first =
      relay::TakeUp(conn_, Options(), /*move_onto_log=*/false, session);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->subscription.refused.empty());
  EXPECT_TRUE(first->subscription.created);
  EXPECT_FALSE(first->start_tick.has_value());
  EXPECT_FALSE(first->consumer.known());
  const DatabaseIdentity consumer{
      .system_identifier = 9, .timeline = 2, .database_oid = 16384};
  {
    pqxx::work tx(conn_);
    StoreConsumerIdentity(tx, "billing", consumer);
    tx.commit();
  }
  absl::StatusOr<TakenUp> second =
      relay::TakeUp(conn_, Options(), /*move_onto_log=*/true, session);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->subscription.id, first->subscription.id);
  EXPECT_TRUE(second->start_tick.has_value());
  ASSERT_TRUE(second->recorded.has_value());
  // What the migration recorded, else what the first session did.
  EXPECT_EQ(*second->recorded, first->recorded.value_or(session));
  EXPECT_EQ(second->consumer, consumer);
  {
    pqxx::work tx(conn_);
    ASSERT_TRUE(ActOnSubscription(tx, "billing", SubscriptionAction::kDrop,
                                  "ops", "gone", true)
                    .ok());
    tx.commit();
  }
  absl::StatusOr<TakenUp> refused =
      relay::TakeUp(conn_, Options(), /*move_onto_log=*/true, session);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused->subscription.refused, "was dropped"));
  EXPECT_FALSE(refused->start_tick.has_value());
  EXPECT_FALSE(refused->consumer.known());
}

// What its relays read every round: paused and by whom, on the log or not,
// and gone once dropped.
TEST_F(SubscribeTest, ItsStateIsWhatOperatorsAndTheLogMadeIt) {
  TakeUp(Options());
  const auto state = [&] {
    pqxx::work tx(conn_);
    return ReadSubscriptionState(tx, "billing");
  };
  const auto act = [&](SubscriptionAction action) {
    pqxx::work tx(conn_);
    ASSERT_TRUE(ActOnSubscription(tx, "billing", action, "ops", "maintenance",
                                  /*force=*/true)
                    .ok());
    tx.commit();
  };
  ASSERT_TRUE(state().has_value());
  EXPECT_EQ(state()->paused, "");
  EXPECT_FALSE(state()->on_log);
  act(SubscriptionAction::kPause);
  EXPECT_EQ(state()->paused, "by ops: maintenance");
  act(SubscriptionAction::kResume);
  EXPECT_EQ(state()->paused, "");
  ASSERT_TRUE(EnsureLogDelivery(conn_, "billing", true).ok());
  EXPECT_TRUE(state()->on_log);
  act(SubscriptionAction::kDrop);
  EXPECT_FALSE(state().has_value());
}

// SessionAttempts with a fixed backoff of 1 s, 2 s, 4 s...
TEST(SessionAttempts, AFailureWaitsItsBackoffARefusalIsAnErrorASuccessResets) {
  SessionAttempts attempts(
      Backoff(absl::Seconds(1), absl::Seconds(60), [] { return 1.0; }));
  int opens = 0;
  absl::StatusOr<WorkerSession> next = absl::UnavailableError("down");
  auto open = [&] {
    ++opens;
    return std::move(next);
  };
  const absl::Time t = absl::FromUnixSeconds(1000);
  EXPECT_EQ(attempts.Open(t, open).status().message(), "down");
  // Not due: the same failure, nothing opened.
  EXPECT_EQ(attempts.Open(t + absl::Milliseconds(900), open).status().message(),
            "down");
  EXPECT_EQ(opens, 1);
  WorkerSession refused;
  refused.up.subscription.refused = "subscription billing was dropped";
  next = std::move(refused);
  absl::StatusOr<WorkerSession> s = attempts.Open(t + absl::Seconds(1), open);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.status().message(), "subscription billing was dropped");
  EXPECT_EQ(opens, 2);
  // The second failure waits twice as long.
  next = absl::UnavailableError("down");
  EXPECT_FALSE(attempts.Open(t + absl::Seconds(2.9), open).ok());
  EXPECT_EQ(opens, 2);
  next = WorkerSession{};
  EXPECT_TRUE(attempts.Open(t + absl::Seconds(3), open).ok());
  EXPECT_EQ(opens, 3);
  // A success starts the backoff anew: the next failure waits 1 s.
  next = absl::UnavailableError("down again");
  const absl::Time u = t + absl::Seconds(10);
  EXPECT_FALSE(attempts.Open(u, open).ok());
  next = WorkerSession{};
  EXPECT_TRUE(attempts.Open(u + absl::Seconds(1), open).ok());
  EXPECT_EQ(opens, 5);
}

}  // namespace
}  // namespace outbox::relay
