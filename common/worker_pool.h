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

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

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
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `work`; false (and `work` dropped) when max_queued are waiting.
  bool Post(std::function<void()> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.size() >= max_queued_) return false;
      queue_.push_back(std::move(work));
    }
    cv_.notify_one();
    return true;
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }

  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace outbox
