#include "tests/testing/inbox.h"

#include <gtest/gtest.h>

namespace outbox::testing {

std::vector<v1::EventResult> DeliverBatches(
    const std::shared_ptr<grpc::Channel>& channel,
    const std::vector<std::vector<v1::Event>>& batches, grpc::Status* status) {
  auto stub = v1::EventSink::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Deliver(&ctx);
  std::vector<v1::EventResult> out;
  uint64_t id = 0;
  for (const auto& batch : batches) {
    v1::DeliverRequest req;
    req.set_batch_id(++id);
    for (const auto& e : batch) *req.add_events() = e;
    if (!stream->Write(req)) break;
    v1::DeliverResponse resp;
    if (!stream->Read(&resp)) break;
    EXPECT_EQ(resp.batch_id(), id);
    for (const auto& r : resp.results()) out.push_back(r);
  }
  stream->WritesDone();
  grpc::Status s = stream->Finish();
  if (status != nullptr) *status = s;
  return out;
}

int64_t InboxOutOfOrder(TestDatabase& db) {
  return db.Scalar(
      "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY "
      "aggregate_id ORDER BY apply_id) AS before FROM inbox) x WHERE before "
      ">= seq");
}

}  // namespace outbox::testing
