#pragma once
// One EventSink.Deliver stream seen from the relay: batches are queued and
// written by a writer thread, answers are collected by a reader thread, so
// the relay's loop never blocks on the network (a paused consumer stalls
// the stream, not the relay; Cancel unblocks both threads).

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "outbox/v1/sink.grpc.pb.h"
#include "relay/sink.h"

namespace outbox::relay {

class DeliveryStream : public BatchStream {
 public:
  // Opens the stream on `stub` (which must outlive it). `wake` is called
  // (from the stream's threads) whenever an answer arrives or the stream
  // breaks.
  DeliveryStream(v1::EventSink::Stub* stub, std::function<void()> wake);
  // Cancels the call if still open, joins the threads.
  ~DeliveryStream() override;

  // Queues a batch; never blocks.
  void Send(v1::DeliverRequest request) override;
  // Answers received since the last call, in arrival order.
  std::vector<v1::DeliverResponse> TakeResponses() override;
  // True once the stream can carry nothing more; `error()` says why.
  bool broken() const override { return broken_.load(); }
  std::string error() const override;
  // Aborts the call (answers not yet received are lost; rows stay pending).
  void Cancel() override;
  // Half-closes after the queued batches are written (graceful shutdown).
  void CloseSend() override;

 private:
  void WriteLoop();
  void WriteBatches();
  void ReadLoop();
  void Break(const std::string& why);

  std::function<void()> wake_;
  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::DeliverRequest, v1::DeliverResponse>>
      stream_;
  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<v1::DeliverRequest> outbox_ ABSL_GUARDED_BY(mu_);
  bool close_send_ ABSL_GUARDED_BY(mu_) = false;
  bool writer_done_ ABSL_GUARDED_BY(mu_) = false;
  // The peer ended the stream; status pending.
  bool reader_done_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<v1::DeliverResponse> responses_ ABSL_GUARDED_BY(mu_);
  // Why the stream broke: the first reason given.
  std::string error_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> broken_{false};
  std::thread writer_;
  std::thread reader_;
};

}  // namespace outbox::relay
