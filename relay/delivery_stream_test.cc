// The relay's side of one EventSink.Deliver stream (relay/delivery_stream.h)
// against an in-process sink over real gRPC on loopback: batches go out in
// order and never block the caller, answers come back in order, and every
// way the stream ends (the consumer's status, its end, a cancel, a
// half-close) is seen once, with its reason, and wakes the caller.

#include "relay/delivery_stream.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/server.h"
#include "tests/testing/grpc.h"
#include "tests/testing/wait.h"

namespace outbox::relay {
namespace {

using ::outbox::testing::WaitFor;

// Answers each batch with one APPLIED per event, in order, until told
// to stall (read nothing more) or to end the stream with a status after a
// number of batches.
class ScriptedSink final : public v1::EventSink::Service {
 public:
  grpc::Status Deliver(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DeliverResponse, v1::DeliverRequest>* stream)
      override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto md = ctx->client_metadata().find("outbox-protocol");
      protocol_ = md == ctx->client_metadata().end()
                      ? ""
                      : std::string(md->second.data(), md->second.size());
    }
    v1::DeliverRequest req;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::seconds(10),
                     [&] { return !stall_ || ctx->IsCancelled(); });
        if (ctx->IsCancelled()) return grpc::Status::CANCELLED;
        if (end_after_ >= 0 && batches_ >= end_after_) return end_with_;
      }
      if (!stream->Read(&req)) {
        std::lock_guard<std::mutex> lock(mu_);
        saw_writes_done_ = true;
        return grpc::Status::OK;
      }
      v1::DeliverResponse resp;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++batches_;
        for (const v1::Event& e : req.events()) {
          seqs_.push_back(e.seq());
          auto* r = resp.add_results();
          r->set_event_id(e.event_id());
          r->set_seq(e.seq());
          r->set_outcome(v1::APPLIED);
        }
      }
      if (!stream->Write(resp)) return grpc::Status::OK;
    }
  }
  void Stall(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    stall_ = on;
    cv_.notify_all();
  }
  void EndAfter(int batches, grpc::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    end_after_ = batches;
    end_with_ = status;
  }
  std::vector<int64_t> seqs() {
    std::lock_guard<std::mutex> lock(mu_);
    return seqs_;
  }
  std::string protocol() {
    std::lock_guard<std::mutex> lock(mu_);
    return protocol_;
  }
  bool saw_writes_done() {
    std::lock_guard<std::mutex> lock(mu_);
    return saw_writes_done_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stall_ = false;
  int end_after_ = -1;
  grpc::Status end_with_;
  int batches_ = 0;
  std::vector<int64_t> seqs_;
  std::string protocol_;
  bool saw_writes_done_ = false;
};

v1::DeliverRequest Batch(int64_t first, int n) {
  v1::DeliverRequest req;
  for (int i = 0; i < n; ++i) {
    v1::Event* e = req.add_events();
    e->set_seq(first + i);
    e->set_event_id(absl::StrCat("e", first + i));
  }
  return req;
}

class DeliveryStreamTest : public ::testing::Test {
 protected:
  DeliveryStreamTest() {
    auto server =
        GrpcServer::Start({"127.0.0.1:0", absl::Milliseconds(200)},
                          {{&sink_, v1::EventSink::service_full_name()}});
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = v1::EventSink::NewStub(testing::Loopback(server_->port()));
  }
  ~DeliveryStreamTest() override { sink_.Stall(false); }

  std::unique_ptr<DeliveryStream> Open() {
    return std::make_unique<DeliveryStream>(stub_.get(), [this] { ++wakes_; });
  }

  ScriptedSink sink_;
  std::unique_ptr<GrpcServer> server_;
  std::unique_ptr<v1::EventSink::Stub> stub_;
  std::atomic<int> wakes_{0};
};

TEST_F(DeliveryStreamTest, BatchesGoInOrderAndEachAnswerWakesTheCaller) {
  auto stream = Open();
  for (int b = 0; b < 5; ++b) stream->Send(Batch(1 + 10 * b, 10));
  std::vector<v1::DeliverResponse> answers;
  ASSERT_TRUE(WaitFor([&] {
    for (auto& r : stream->TakeResponses()) answers.push_back(std::move(r));
    return answers.size() == 5;
  }));
  std::vector<int64_t> want;
  for (int b = 0; b < 5; ++b) {
    for (int i = 0; i < 10; ++i) want.push_back(1 + 10 * b + i);
    ASSERT_EQ(answers[b].results_size(), 10);
    EXPECT_EQ(answers[b].results(0).event_id(), absl::StrCat("e", 1 + 10 * b));
  }
  EXPECT_EQ(sink_.seqs(), want);
  EXPECT_GE(wakes_.load(), 1);
  EXPECT_FALSE(stream->broken());
  EXPECT_TRUE(stream->TakeResponses().empty());  // taken once
  EXPECT_EQ(sink_.protocol(), "2");              // it understands DIVERGED
}

TEST_F(DeliveryStreamTest, SendNeverBlocksOnAConsumerThatStopsReading) {
  sink_.Stall(true);
  auto stream = Open();
  const absl::Time t0 = absl::Now();
  // Far more than the transport's windows hold: the writer thread waits,
  // the caller does not.
  for (int b = 0; b < 200; ++b) stream->Send(Batch(1 + 1000 * b, 1000));
  const absl::Duration queued = absl::Now() - t0;
  EXPECT_LT(queued, absl::Seconds(5)) << "Send blocked";
  EXPECT_FALSE(stream->broken());
  sink_.Stall(false);
  ASSERT_TRUE(WaitFor([&] { return sink_.seqs().size() == 200000; },
                      absl::Seconds(60)));
}

TEST_F(DeliveryStreamTest, TheConsumersStatusBreaksTheStreamWithItsReason) {
  sink_.EndAfter(
      1, grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "batch too large"));
  auto stream = Open();
  stream->Send(Batch(1, 3));
  stream->Send(Batch(4, 3));
  ASSERT_TRUE(WaitFor([&] { return stream->broken(); }));
  EXPECT_TRUE(absl::StrContains(stream->error(), "stream failed: 8"))
      << stream->error();
  EXPECT_TRUE(absl::StrContains(stream->error(), "batch too large"))
      << stream->error();
  EXPECT_GE(wakes_.load(), 1);
  EXPECT_EQ(sink_.seqs(), (std::vector<int64_t>{1, 2, 3}));
}

TEST_F(DeliveryStreamTest, AConsumerThatEndsTheStreamIsSeenAsSuch) {
  sink_.EndAfter(0, grpc::Status::OK);
  auto stream = Open();
  stream->Send(Batch(1, 1));
  ASSERT_TRUE(WaitFor([&] { return stream->broken(); }));
  EXPECT_EQ(stream->error(), "stream ended by the consumer");
}

TEST_F(DeliveryStreamTest, CancelUnblocksAStalledStreamAtOnce) {
  sink_.Stall(true);
  auto stream = Open();
  stream->Send(Batch(1, 10));
  const absl::Time t0 = absl::Now();
  stream->Cancel();
  EXPECT_TRUE(stream->broken());
  EXPECT_EQ(stream->error(), "cancelled by the relay");  // the first reason
  stream.reset();                                        // joins both threads
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  EXPECT_TRUE(sink_.seqs().empty());  // nothing answered: rows stay owed
}

TEST_F(DeliveryStreamTest, CloseSendWritesWhatIsQueuedThenEnds) {
  auto stream = Open();
  stream->Send(Batch(1, 2));
  stream->Send(Batch(3, 2));
  stream->CloseSend();
  ASSERT_TRUE(WaitFor([&] { return stream->broken(); }));
  EXPECT_EQ(sink_.seqs(), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_TRUE(sink_.saw_writes_done());
  EXPECT_EQ(stream->error(), "stream ended by the consumer");
  EXPECT_EQ(stream->TakeResponses().size(), 2u);
}

TEST_F(DeliveryStreamTest, AnUnreachableConsumerBreaksTheStream) {
  const int port = server_->port();
  server_.reset();  // nothing listens there now
  auto stub = v1::EventSink::NewStub(testing::Loopback(port));
  DeliveryStream stream(stub.get(), [] {});
  stream.Send(Batch(1, 1));
  ASSERT_TRUE(WaitFor([&] { return stream.broken(); }, absl::Seconds(30)));
  EXPECT_TRUE(absl::StrContains(stream.error(), "stream failed: 14"))
      << stream.error();  // UNAVAILABLE
}

}  // namespace
}  // namespace outbox::relay
