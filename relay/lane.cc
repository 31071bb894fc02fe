#include "relay/lane.h"

#include <spdlog/spdlog.h>

#include <cassert>
#include <chrono>
#include <thread>

namespace outbox::relay {

Lane::Lane(int index, Backoff stream_backoff)
    : index_(index), stream_backoff_(std::move(stream_backoff)) {}

std::string Lane::broken() const {
  if (stream_ == nullptr || !stream_->broken()) return "";
  return stream_->error();
}

void Lane::Open(Sink& sink, std::function<void()> wake, absl::Time now) {
  if (stream_ != nullptr || now < next_stream_attempt_) return;
  const Sink::Readiness readiness = sink.readiness();
  if (readiness == Sink::Readiness::kFailing) {
    next_stream_attempt_ = now + stream_backoff_.Next();
    return;
  }
  if (readiness != Sink::Readiness::kReady) return;
  stream_ = sink.Open(std::move(wake));
  // The backoff resets on the first answer, not here: a consumer that
  // accepts streams but fails every batch (its database is read-only) is
  // retried less and less often, up to its maximum.
  spdlog::info("relay: delivery stream {} open to {}", index_, sink.name());
}

void Lane::Send(InFlight batch, v1::DeliverRequest request,
                std::optional<uint64_t> hold_until, absl::Time now) {
  assert(stream_ != nullptr);
  assert(in_flight_.count(batch.batch_id) == 0);
  for (int64_t seq : batch.seqs) in_flight_seqs_.insert(seq);
  const uint64_t id = batch.batch_id;
  if (hold_until.has_value()) {
    batch.sent_at = absl::InfiniteFuture();
    in_flight_.emplace(id, std::move(batch));
    held_.emplace_back(*hold_until, std::move(request));
  } else {
    batch.sent_at = now;
    in_flight_.emplace(id, std::move(batch));
    stream_->Send(std::move(request));
  }
  CheckInvariants();
}

int Lane::Release(uint64_t flushed, absl::Time now) {
  int sent = 0;
  while (!held_.empty() && stream_ != nullptr &&
         held_.front().first <= flushed) {
    v1::DeliverRequest request = std::move(held_.front().second);
    held_.pop_front();
    auto it = in_flight_.find(request.batch_id());
    if (it != in_flight_.end()) it->second.sent_at = now;
    stream_->Send(std::move(request));
    ++sent;
  }
  CheckInvariants();
  return sent;
}

std::optional<Lane::Answered> Lane::NextAnswer() {
  if (answers_.empty() && stream_ != nullptr) {
    for (v1::DeliverResponse& r : stream_->TakeResponses()) {
      answers_.push_back(std::move(r));
    }
  }
  if (answers_.empty()) return std::nullopt;
  Answered answered{.response = std::move(answers_.front())};
  answers_.pop_front();
  // The far end answers: whatever broke the last stream is over.
  stream_backoff_.Reset();
  // An answer to a batch the fence still holds answers nothing this relay
  // sent: as unknown as any other id.
  auto it = in_flight_.find(answered.response.batch_id());
  if (it == in_flight_.end() ||
      it->second.sent_at == absl::InfiniteFuture()) {
    return answered;
  }
  for (int64_t seq : it->second.seqs) {
    auto s = in_flight_seqs_.find(seq);
    if (s != in_flight_seqs_.end()) in_flight_seqs_.erase(s);
  }
  answered.batch = std::move(it->second);
  in_flight_.erase(it);
  CheckInvariants();
  return answered;
}

std::vector<InFlight> Lane::Drop(absl::Time now) {
  if (stream_ != nullptr) {
    stream_->Cancel();
    stream_.reset();
  }
  answers_.clear();
  std::vector<InFlight> lost;
  lost.reserve(in_flight_.size());
  for (auto& [id, batch] : in_flight_) lost.push_back(std::move(batch));
  in_flight_.clear();
  in_flight_seqs_.clear();
  held_.clear();
  next_stream_attempt_ = now + stream_backoff_.Next();
  CheckInvariants();
  return lost;
}

void Lane::Close(absl::Duration patience) {
  if (stream_ == nullptr) return;
  if (in_flight_.empty()) {
    // Nothing in flight: half-close, so the far end sees a clean end.
    stream_->CloseSend();
    const absl::Time deadline = absl::Now() + patience;
    while (!stream_->broken() && absl::Now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  stream_->Cancel();
  stream_.reset();
}

bool Lane::Overdue(absl::Time now, absl::Duration timeout) const {
  // Batch ids grow: the first is the oldest. One held by the fence has not
  // been sent (sent_at infinite) and is never overdue.
  return !in_flight_.empty() &&
         now - in_flight_.begin()->second.sent_at > timeout;
}

int Lane::Limit(int batch_size, int window, int pipeline_depth) const {
  bool all_full = true;
  for (const auto& [id, b] : in_flight_) all_full &= b.full;
  return ClaimLimit(batch_size, window, pipeline_depth,
                    static_cast<int>(in_flight_seqs_.size()),
                    static_cast<int>(in_flight_.size()), all_full);
}

bool Lane::any_full() const {
  for (const auto& [id, b] : in_flight_) {
    if (b.full) return true;
  }
  return false;
}

bool Lane::any_from_log() const {
  for (const auto& [id, b] : in_flight_) {
    if (b.from_log) return true;
  }
  return false;
}

void Lane::PartitionsInFlight(std::set<int>* out) const {
  for (const auto& [id, b] : in_flight_) {
    out->insert(b.partitions.begin(), b.partitions.end());
  }
}

void Lane::CheckInvariants() const {
#ifndef NDEBUG
  std::multiset<int64_t> seqs;
  for (const auto& [id, b] : in_flight_) {
    assert(id == b.batch_id);
    seqs.insert(b.seqs.begin(), b.seqs.end());
  }
  assert(seqs == in_flight_seqs_);
  for (const auto& [lsn, request] : held_) {
    auto it = in_flight_.find(request.batch_id());
    assert(it != in_flight_.end());
    assert(it->second.sent_at == absl::InfiniteFuture());
  }
#endif
}

}  // namespace outbox::relay
