#pragma once
// A fixed set of threads for work that blocks (database calls), so that
// gRPC's callback threads never wait on the database. The queue is bounded:
// a burst beyond it is refused at once rather than queued without end.
// Thread-safe.
//
// Example:
//   WorkerPool workers(6, 1024);
//   if (!workers.Post([=] { reactor->Finish(DoBlockingWork()); })) {
//     reactor->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, ...));
//   }

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace outbox {

class WorkerPool {
 public:
  WorkerPool(int threads, size_t max_queued) : max_queued_(max_queued) {
    for (int i = 0; i < std::max(1, threads); ++i) {
      threads_.emplace_back([this] { Loop(); });
    }
  }
  // Runs what is queued, then stops the threads.
  ~WorkerPool() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    for (std::thread& t : threads_) t.join();
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `work`; false (and `work` dropped) when max_queued are waiting.
  bool Post(std::function<void()> work) {
    {
      absl::MutexLock lock(&mu_);
      if (queue_.size() >= max_queued_) return false;
      queue_.push_back(std::move(work));
    }
    cv_.Signal();
    return true;
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> work;
      {
        absl::MutexLock lock(&mu_);
        while (!(stop_ || !queue_.empty())) cv_.Wait(&mu_);
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }

  const size_t max_queued_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace outbox
