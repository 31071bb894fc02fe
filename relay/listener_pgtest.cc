// The commit listener against a real PostgreSQL: a NOTIFY on the
// producer's channel wakes the worker while it wants wakes, is only noted
// while it does not, and a steady stream of unwanted ones makes it stop
// listening until wakes are wanted again.

#include <gtest/gtest.h>

#include <atomic>

#include "common/schema.h"
#include "relay/listener.h"
#include "tests/testing/pg.h"
#include "tests/testing/wait.h"

namespace outbox::relay {
namespace {

class CommitListenerTest : public ::testing::Test {
 protected:
  CommitListenerTest()
      : db_("listener", {OutboxSchema()}),
        notifier_(db_.url()),
        listener_(
            {.url = db_.url(),
             .wake = [this] { ++wakes_; },
             .on_listening = [this](bool on) { ++(on ? listens_ : rests_); }}) {
  }

  void Notify() {
    pqxx::nontransaction tx(notifier_);
    tx.exec(std::string("NOTIFY ") + kNotifyChannel);
  }

  testing::TestDatabase db_;
  pqxx::connection notifier_;
  std::atomic<int> wakes_{0}, listens_{0}, rests_{0};
  CommitListener listener_;
};

TEST_F(CommitListenerTest, ANotifyWakesTheWorker) {
  listener_.Start();
  ASSERT_TRUE(testing::WaitFor([&] { return listens_ == 1; }));
  // Beginning to listen wakes it too: rows may have committed before.
  ASSERT_TRUE(testing::WaitFor([&] { return wakes_ >= 1; }));
  EXPECT_TRUE(listener_.works());
  EXPECT_TRUE(listener_.hearing());
  // Beginning to listen is heard as a NOTIFY: what committed before.
  ASSERT_TRUE(listener_.TakeHeard().has_value());
  const int before = wakes_;
  const absl::Time sent = absl::Now();
  Notify();
  ASSERT_TRUE(testing::WaitFor([&] { return wakes_ > before; }));
  EXPECT_TRUE(listener_.heard());
  std::optional<absl::Time> heard = listener_.TakeHeard();
  ASSERT_TRUE(heard.has_value());
  // When it arrived: after the commit that sent it.
  EXPECT_GE(*heard, sent);
  EXPECT_LE(*heard, absl::Now());
  EXPECT_FALSE(listener_.heard());  // taken
  EXPECT_FALSE(listener_.TakeHeard().has_value());
  listener_.Stop();
  EXPECT_FALSE(listener_.hearing());
  listener_.Stop();  // again: nothing
}

TEST_F(CommitListenerTest, UnwantedNotifiesAreNotedThenNoLongerHeard) {
  listener_.Start();
  ASSERT_TRUE(testing::WaitFor([&] { return listens_ == 1 && wakes_ >= 1; }));
  listener_.WantWakes(false);
  EXPECT_FALSE(listener_.wants_wakes());
  const int before = wakes_;
  listener_.TakeHeard();
  Notify();
  ASSERT_TRUE(
      testing::WaitFor([&] { return listener_.TakeHeard().has_value(); }));
  EXPECT_EQ(wakes_, before);  // noted, not woken
  // A steady load: it stops listening.
  for (int i = 0; i < 40 && rests_ == 0; ++i) {
    Notify();
    testing::WaitFor([&] { return rests_ > 0; }, absl::Milliseconds(50));
  }
  ASSERT_TRUE(testing::WaitFor([&] { return rests_ == 1; }));
  EXPECT_EQ(wakes_, before);
  // Not hearing: a worker must not count on a NOTIFY now.
  EXPECT_FALSE(listener_.hearing());
  listener_.TakeHeard();
  // Wanted again: it listens again, and wakes the worker for what
  // committed while it did not, as if a NOTIFY had come.
  const absl::Time resumed = absl::Now();
  listener_.WantWakes(true);
  ASSERT_TRUE(testing::WaitFor([&] { return listens_ == 2; }));
  ASSERT_TRUE(testing::WaitFor([&] { return wakes_ > before; }));
  EXPECT_TRUE(listener_.hearing());
  std::optional<absl::Time> heard = listener_.TakeHeard();
  ASSERT_TRUE(heard.has_value());
  EXPECT_GE(*heard, resumed);
  const int after = wakes_;
  Notify();
  ASSERT_TRUE(testing::WaitFor([&] { return wakes_ > after; }));
}

TEST_F(CommitListenerTest, StopsPromptly) {
  listener_.Start();
  ASSERT_TRUE(testing::WaitFor([&] { return listens_ == 1; }));
  const absl::Time t0 = absl::Now();
  listener_.Stop();
  // It waits for NOTIFYs 200 ms at a time; the limit is only generous.
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

}  // namespace
}  // namespace outbox::relay
