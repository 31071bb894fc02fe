#pragma once
// For the tests of lanes: a sink whose streams record what they were sent
// and bring the answers a test gives them, and batches to send.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "outbox/v1/sink.pb.h"
#include "relay/marks.h"
#include "relay/sink.h"

namespace outbox::relay {

// What a stream was sent, and the answers it is to bring.
struct Wire {
  std::vector<uint64_t> sent;                // batch ids in send order
  std::vector<v1::DeliverRequest> requests;  // what was sent, in order
  std::vector<v1::DeliverResponse> answers;
  bool broken = false;
  bool cancelled = false;
  bool half_closed = false;
};

class FakeStream : public BatchStream {
 public:
  explicit FakeStream(std::shared_ptr<Wire> wire) : wire_(std::move(wire)) {}
  void Send(v1::DeliverRequest request) override {
    wire_->sent.push_back(request.batch_id());
    wire_->requests.push_back(std::move(request));
  }
  std::vector<v1::DeliverResponse> TakeResponses() override {
    return std::exchange(wire_->answers, {});
  }
  bool broken() const override { return wire_->broken; }
  std::string error() const override { return "cut"; }
  void Cancel() override { wire_->cancelled = true; }
  void CloseSend() override {
    wire_->half_closed = true;
    wire_->broken = true;  // the far end ends it at once
  }

 private:
  std::shared_ptr<Wire> wire_;
};

class FakeSink : public Sink {
 public:
  Readiness readiness_ = Readiness::kReady;
  std::shared_ptr<Wire> wire = std::make_shared<Wire>();  // the last opened
  std::vector<std::shared_ptr<Wire>> wires;               // every one, in order
  int opened = 0;

  void Start() override {}
  void Stop() override {}
  std::string name() const override { return "fake"; }
  Readiness readiness() override { return readiness_; }
  std::unique_ptr<BatchStream> Open(std::function<void()>) override {
    ++opened;
    wire = std::make_shared<Wire>();
    wires.push_back(wire);
    return std::make_unique<FakeStream>(wire);
  }
  void Answered() override {}
  std::optional<std::string> Unreachable() const override {
    return std::nullopt;
  }
  v1::EventSink::Stub* consumer() const override { return nullptr; }
};

inline const absl::Time kT0 = absl::FromUnixSeconds(1000);

inline InFlight Batch(uint64_t id, std::vector<int64_t> seqs,
                      bool full = false) {
  InFlight b{.batch_id = id};
  b.seqs = std::move(seqs);
  b.partitions = {static_cast<int>(id % 32)};
  b.full = full;
  return b;
}

inline v1::DeliverRequest Request(uint64_t id) {
  v1::DeliverRequest r;
  r.set_batch_id(id);
  return r;
}

// The consumer's answer that applied every event of `request`.
inline v1::DeliverResponse AllApplied(const v1::DeliverRequest& request) {
  v1::DeliverResponse r;
  r.set_batch_id(request.batch_id());
  for (const v1::Event& e : request.events()) {
    v1::EventResult* x = r.add_results();
    x->set_event_id(e.event_id());
    x->set_seq(e.seq());
    x->set_outcome(v1::APPLIED);
  }
  return r;
}

inline v1::DeliverResponse Response(uint64_t id) {
  v1::DeliverResponse r;
  r.set_batch_id(id);
  return r;
}

}  // namespace outbox::relay
