#pragma once
// Group commit: concurrent callers' writes share one statement and one
// commit. Callers queue items; writer threads each take what is queued (up
// to max_group), write it in one go and hand every caller its own result.
// Under load the queue fills while a write runs, so groups grow by
// themselves; alone, an item is written as soon as a writer is free.
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
    }
  }
  // Writes what is queued, then stops the writers.
  ~GroupCommit() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  GroupCommit(const GroupCommit&) = delete;
  GroupCommit& operator=(const GroupCommit&) = delete;

  // Queues `item`; `done` gets its result, on a writer thread, once its
  // group committed (or failed). Never blocks on the write.
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
      std::vector<absl::StatusOr<Result>> results = write_(items);
      for (size_t i = 0; i < group.size(); ++i) {
        group[i].done(
            i < results.size()
                ? std::move(results[i])
                : absl::InternalError("group commit: a result is missing"));
      }
    }
  }

  const GroupCommitOptions options_;
  const WriteFn write_;
  std::function<void(size_t)> on_group_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace outbox
