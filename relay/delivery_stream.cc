#include "relay/delivery_stream.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace outbox::relay {

DeliveryStream::DeliveryStream(v1::EventSink::Stub* stub,
                               std::function<void()> wake)
    : wake_(std::move(wake)) {
  // This relay understands DIVERGED (sink.proto): protocol 2.
  ctx_.AddMetadata("outbox-protocol", "2");
  stream_ = stub->Deliver(&ctx_);
  writer_ = std::thread([this] { WriteLoop(); });
  reader_ = std::thread([this] { ReadLoop(); });
}

DeliveryStream::~DeliveryStream() {
  Cancel();
  writer_.join();
  reader_.join();
}

void DeliveryStream::Send(v1::DeliverRequest request) {
  absl::MutexLock lock(&mu_);
  outbox_.push_back(std::move(request));
  cv_.SignalAll();
}

std::vector<v1::DeliverResponse> DeliveryStream::TakeResponses() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::DeliverResponse> out;
  out.swap(responses_);
  return out;
}

std::string DeliveryStream::error() const {
  absl::MutexLock lock(&mu_);
  return error_;
}

void DeliveryStream::Cancel() {
  // The reason first: the cancelled call's own status (CANCELLED, from the
  // reader's Finish) must not take its place.
  Break("cancelled by the relay");
  ctx_.TryCancel();
}

void DeliveryStream::CloseSend() {
  absl::MutexLock lock(&mu_);
  close_send_ = true;
  cv_.SignalAll();
}

void DeliveryStream::Break(const std::string& why) {
  {
    absl::MutexLock lock(&mu_);
    if (error_.empty()) error_ = why;
    broken_ = true;
    cv_.SignalAll();
  }
  wake_();
}

void DeliveryStream::WriteLoop() {
  WriteBatches();
  absl::MutexLock lock(&mu_);
  writer_done_ = true;
  cv_.SignalAll();
}

void DeliveryStream::WriteBatches() {
  for (;;) {
    v1::DeliverRequest req;
    bool all_written = false;  // close_send_ with nothing left to write
    {
      absl::MutexLock lock(&mu_);
      while (!broken_ && !reader_done_ && !close_send_ && outbox_.empty()) {
        cv_.Wait(&mu_);
      }
      if (broken_ || reader_done_) return;
      if (outbox_.empty()) {
        all_written = true;
      } else {
        req = std::move(outbox_.front());
        outbox_.pop_front();
      }
    }
    if (all_written) {
      stream_->WritesDone();
      return;
    }
    if (!stream_->Write(req)) {
      // The call is over: its Read returns false too, and the reader breaks
      // the stream with the status Finish gives, the consumer's reason.
      // Broken here, the stream would say only that a write failed.
      return;
    }
  }
}

void DeliveryStream::ReadLoop() {
  v1::DeliverResponse resp;
  while (stream_->Read(&resp)) {
    {
      absl::MutexLock lock(&mu_);
      responses_.push_back(std::move(resp));
    }
    wake_();
  }
  {
    // Finish may only run once the writer has stopped using the stream.
    // broken_ waits for Break, so that it is never seen without its reason.
    absl::MutexLock lock(&mu_);
    reader_done_ = true;
    cv_.SignalAll();
    while (!writer_done_) cv_.Wait(&mu_);
  }
  grpc::Status s = stream_->Finish();
  Break(s.ok() ? "stream ended by the consumer"
               : absl::StrCat("stream failed: ", s.error_code(), " ",
                              s.error_message()));
}

}  // namespace outbox::relay
