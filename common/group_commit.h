#pragma once
// Group commit: concurrent callers' writes share one statement and one
// commit. Callers queue items; writer threads each take what is queued (up
// to max_group), write it in one go and hand every caller its own result.
// Under load the queue fills while a write runs, so groups grow by
// themselves; alone, an item is written as soon as a writer is free.
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
//   commit.SubmitAsync(row, [](absl::StatusOr<Id> id) { ... });
//   absl::StatusOr<Id> id = commit.Submit(other_row);  // blocks

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace outbox {

struct GroupCommitOptions {
  int writers = 1;     // groups written at once (writer threads)
  int max_group = 64;  // items in one group, at most
};

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
  // Writes what is queued and answers every caller, then stops.
  ~GroupCommit() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
    {
      std::lock_guard<std::mutex> lock(answers_mu_);
      answers_stop_ = true;
    }
    answers_cv_.notify_all();
    for (std::thread& t : answerers_) t.join();
  }
  GroupCommit(const GroupCommit&) = delete;
  GroupCommit& operator=(const GroupCommit&) = delete;

  // Queues `item`; `done` gets its result, on a writer or answering
  // thread, once its group committed (or failed). Never blocks on the write.
  void SubmitAsync(Item item, Done done) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({std::move(item), std::move(done)});
    }
    cv_.notify_one();
  }

  // Queues `item` and waits for its result.
  absl::StatusOr<Result> Submit(Item item) {
    std::promise<absl::StatusOr<Result>> promise;
    std::future<absl::StatusOr<Result>> future = promise.get_future();
    SubmitAsync(std::move(item), [&promise](absl::StatusOr<Result> r) {
      promise.set_value(std::move(r));
    });
    return future.get();
  }

  // Hears each group's size (for metrics). Set it before the first Submit.
  void set_on_group(std::function<void(size_t)> on_group) {
    on_group_ = std::move(on_group);
  }

 private:
  struct Pending {
    Item item;
    Done done;
  };
  // A written group and its results, one per item.
  struct Written {
    std::vector<Pending> group;
    std::vector<absl::StatusOr<Result>> results;
  };

  void WriterLoop() {
    for (;;) {
      std::vector<Pending> group;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        while (!queue_.empty() &&
               static_cast<int>(group.size()) < options_.max_group) {
          group.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
      }
      std::vector<const Item*> items;
      items.reserve(group.size());
      for (const Pending& p : group) items.push_back(&p.item);
      if (on_group_) on_group_(items.size());
      Written written{std::move(group), write_(items)};
      bool waiting;
      {
        std::lock_guard<std::mutex> lock(mu_);
        waiting = !queue_.empty();
      }
      if (!waiting) {
        Answer(written);
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(answers_mu_);
        answers_.push_back(std::move(written));
      }
      answers_cv_.notify_one();
    }
  }

  void AnswerLoop() {
    for (;;) {
      Written written;
      {
        std::unique_lock<std::mutex> lock(answers_mu_);
        answers_cv_.wait(lock,
                         [&] { return answers_stop_ || !answers_.empty(); });
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
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool stop_ = false;
  std::mutex answers_mu_;
  std::condition_variable answers_cv_;
  std::deque<Written> answers_;  // written groups to answer
  bool answers_stop_ = false;
  std::vector<std::thread> threads_;
  std::vector<std::thread> answerers_;
};

}  // namespace outbox
