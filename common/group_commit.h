#pragma once
// Group commit: concurrent callers' writes share one statement and one
// commit. Callers queue items; writer threads each take what is queued (up
// to max_group), write it in one go and hand every caller its own result.
// Under load the queue fills while a write runs, so groups grow by
// themselves; alone, an item is written as soon as a writer is free.
//
// A database that hangs costs bounded memory and writes nothing nobody
// waits for: the queue holds at most max_queued items (beyond, a caller is
// refused at once), and an item whose caller's deadline passed or who went
// away (its Waiter) is dropped from its group just before the group is
// written, and answered DeadlineExceeded or Cancelled. What is written
// after the database comes back is what was being written when it stopped
// answering (a group per writer) and what is still wanted then. A caller
// that gives up while its group is being written cannot know whether it
// was: that takes an idempotency key.
//
// When items wait after a write, its callers are answered on an answering
// thread while the writer starts the next write at once: answering (for a
// gRPC caller, building and sending its reply) took a sixth of a writer's
// time, with no statement of it on the database meanwhile. With none
// waiting, the writer answers them itself, sparing a lone caller a handoff.
// Thread-safe.
//
// Example:
//   GroupCommit<Row, Id> commit({.writers = 1, .max_group = 64},
//       [&](const std::vector<const Row*>& rows) {
//         return InsertAll(rows);  // one result per row, in order
//       });
//   commit.SubmitAsync(row, [](absl::StatusOr<Id> id) { ... },
//                      {.deadline = absl::Now() + absl::Milliseconds(200)});
//   absl::StatusOr<Id> id = commit.Submit(other_row);  // blocks

#include <algorithm>
#include <deque>
#include <functional>
#include <future>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace outbox {

struct GroupCommitOptions {
  int writers = 1;     // groups written at once (writer threads)
  int max_group = 64;  // items in one group, at most
  // Items waiting for a writer, at most (those of groups being written not
  // counted). When that many wait, SubmitAsync first drops those nobody
  // waits for any more (looking at most once a millisecond), then refuses
  // the new item if none was.
  size_t max_queued = 256;
};

// Who waits for one item's result: until when, and whether they went away.
// An item nobody waits for is never written.
//
// Example (a call of gRPC's callback API, whose IsCancelled() any thread
// may ask until the call is finished):
//   Waiter w{.deadline = absl::Now() + absl::Milliseconds(200),
//            .cancelled = [ctx] { return ctx->IsCancelled(); }};
struct Waiter {
  absl::Time deadline = absl::InfiniteFuture();
  // True once the caller went away. Called from any thread, and only until
  // the item's `done` runs. Empty: the caller never goes away.
  std::function<bool()> cancelled;
};

// OK while `waiter` still waits at `now`; otherwise DeadlineExceeded or
// Cancelled, saying that the work it waited for was not done.
inline absl::Status StillWaiting(const Waiter& waiter, absl::Time now) {
  if (now >= waiter.deadline) {
    return absl::DeadlineExceededError(
        "the deadline passed while the call waited for the database; it was "
        "not carried out");
  }
  if (waiter.cancelled && waiter.cancelled()) {
    return absl::CancelledError(
        "the call was cancelled while it waited for the database; it was not "
        "carried out");
  }
  return absl::OkStatus();
}

template <typename Item, typename Result>
class GroupCommit {
 public:
  // `write` gets a group of items and returns one result per item, in
  // order; it runs on a writer thread.
  using WriteFn = std::function<std::vector<absl::StatusOr<Result>>(
      const std::vector<const Item*>&)>;
  using Done = std::function<void(absl::StatusOr<Result>)>;

  GroupCommit(GroupCommitOptions options, WriteFn write)
      : options_(options), write_(std::move(write)) {
    for (int i = 0; i < std::max(1, options_.writers); ++i) {
      threads_.emplace_back([this] { WriterLoop(); });
      answerers_.emplace_back([this] { AnswerLoop(); });
    }
  }
  // Writes what is queued (what its waiters still wait for; the rest is
  // answered as dropped) and answers every caller, then stops.
  ~GroupCommit() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    for (std::thread& t : threads_) t.join();
    {
      absl::MutexLock lock(&answers_mu_);
      answers_stop_ = true;
    }
    answers_cv_.SignalAll();
    for (std::thread& t : answerers_) t.join();
  }
  GroupCommit(const GroupCommit&) = delete;
  GroupCommit& operator=(const GroupCommit&) = delete;

  // Queues `item`; `done` gets its result exactly once: on a writer or
  // answering thread once its group committed (or failed), or once the item
  // was dropped because `waiter` no longer waits (DeadlineExceeded,
  // Cancelled; nothing written). If max_queued items wait and all are
  // still wanted, `done` gets ResourceExhausted at once, on this thread.
  // Never blocks on the write.
  void SubmitAsync(Item item, Done done, Waiter waiter = {}) {
    Written dropped;
    bool queued = false;
    {
      absl::MutexLock lock(&mu_);
      if (queue_.size() >= options_.max_queued) {
        // At most once in kDropInterval: a flood of callers refused at once
        // would otherwise each pay for a look at every queued item.
        const absl::Time now = absl::Now();
        if (now - last_drop_ >= kDropInterval) {
          last_drop_ = now;
          DropUnwanted(queue_, now, &dropped);
        }
      }
      if (queue_.size() < options_.max_queued) {
        queue_.push_back({std::move(item), std::move(done), std::move(waiter)});
        queued = true;
      }
    }
    if (!dropped.group.empty()) ToAnswerer(std::move(dropped));
    if (queued) {
      cv_.Signal();
      return;
    }
    done(absl::ResourceExhaustedError(absl::StrCat(
        "the database is not keeping up: ", options_.max_queued,
        " writes wait for it already; nothing was written, retry later")));
  }

  // Queues `item` and waits for its result.
  absl::StatusOr<Result> Submit(Item item, Waiter waiter = {}) {
    std::promise<absl::StatusOr<Result>> promise;
    std::future<absl::StatusOr<Result>> future = promise.get_future();
    SubmitAsync(
        std::move(item),
        [&promise](absl::StatusOr<Result> r) {
          promise.set_value(std::move(r));
        },
        std::move(waiter));
    return future.get();
  }

  // Hears each group's size (for metrics). Set it before the first Submit.
  void set_on_group(std::function<void(size_t)> on_group) {
    on_group_ = std::move(on_group);
  }

 private:
  static constexpr absl::Duration kDropInterval = absl::Milliseconds(1);

  struct Pending {
    Item item;
    Done done;
    Waiter waiter;
  };
  // Items and their results, one per item: a written group, or items
  // dropped before they were written.
  struct Written {
    std::vector<Pending> group;
    std::vector<absl::StatusOr<Result>> results;
  };

  // Moves the items of `items` (queue_ or a group) nobody waits for at
  // `now` into `dropped`; the others stay, in order.
  template <typename Items>
  static void DropUnwanted(Items& items, absl::Time now, Written* dropped) {
    auto kept = items.begin();
    for (auto it = items.begin(); it != items.end(); ++it) {
      absl::Status why = StillWaiting(it->waiter, now);
      if (why.ok()) {
        if (kept != it) *kept = std::move(*it);
        ++kept;
      } else {
        dropped->group.push_back(std::move(*it));
        dropped->results.push_back(std::move(why));
      }
    }
    items.erase(kept, items.end());
  }

  void WriterLoop() {
    for (;;) {
      std::vector<Pending> group;
      {
        absl::MutexLock lock(&mu_);
        while (!(stop_ || !queue_.empty())) cv_.Wait(&mu_);
        if (queue_.empty()) return;  // stopping, nothing left
        while (!queue_.empty() &&
               static_cast<int>(group.size()) < options_.max_group) {
          group.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
      }
      // Right before the write: what nobody waits for any more is dropped.
      Written dropped;
      DropUnwanted(group, absl::Now(), &dropped);
      if (!dropped.group.empty()) ToAnswerer(std::move(dropped));
      if (group.empty()) continue;
      std::vector<const Item*> items;
      items.reserve(group.size());
      for (const Pending& p : group) items.push_back(&p.item);
      if (on_group_) on_group_(items.size());
      Written written{std::move(group), write_(items)};
      bool waiting;
      {
        absl::MutexLock lock(&mu_);
        waiting = !queue_.empty();
      }
      if (!waiting) {
        Answer(written);
        continue;
      }
      ToAnswerer(std::move(written));
    }
  }

  void ToAnswerer(Written written) {
    {
      absl::MutexLock lock(&answers_mu_);
      answers_.push_back(std::move(written));
    }
    answers_cv_.Signal();
  }

  void AnswerLoop() {
    for (;;) {
      Written written;
      {
        absl::MutexLock lock(&answers_mu_);
        while (!(answers_stop_ || !answers_.empty())) answers_cv_.Wait(&answers_mu_);
        if (answers_.empty()) return;  // stopping, nothing left
        written = std::move(answers_.front());
        answers_.pop_front();
      }
      Answer(written);
    }
  }

  static void Answer(Written& written) {
    for (size_t i = 0; i < written.group.size(); ++i) {
      written.group[i].done(
          i < written.results.size()
              ? std::move(written.results[i])
              : absl::InternalError("group commit: a result is missing"));
    }
  }

  const GroupCommitOptions options_;
  const WriteFn write_;
  std::function<void(size_t)> on_group_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // When a full queue last looked for items nobody waits for.
  absl::Time last_drop_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Mutex answers_mu_;
  absl::CondVar answers_cv_;
  // Written groups, and dropped items, to answer.
  std::deque<Written> answers_ ABSL_GUARDED_BY(answers_mu_);
  bool answers_stop_ ABSL_GUARDED_BY(answers_mu_) = false;
  std::vector<std::thread> threads_;
  std::vector<std::thread> answerers_;
};

}  // namespace outbox
