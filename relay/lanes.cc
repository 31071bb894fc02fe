#include "relay/lanes.h"

#include <algorithm>

namespace outbox::relay {

Lanes::Lanes(int count, const Backoff& stream_backoff, Limits limits)
    : limits_(limits) {
  count = std::max(1, count);
  lanes_.reserve(count);
  for (int i = 0; i < count; ++i) lanes_.emplace_back(i, stream_backoff);
}

void Lanes::Open(Sink& sink, const std::function<void()>& wake,
                 absl::Time now) {
  for (Lane& lane : lanes_) lane.Open(sink, wake, now);
}

std::vector<Lane*> Lanes::Serving() {
  std::vector<Lane*> open;
  std::vector<int> indexes;
  for (Lane& lane : lanes_) {
    if (!lane.connected()) continue;
    if (!spread_ && !serving_.empty() && lane.index() == serving_.front()) {
      open.assign(1, &lane);
      indexes.assign(1, lane.index());
      break;
    }
    if (!spread_ && !open.empty()) continue;
    open.push_back(&lane);
    indexes.push_back(lane.index());
  }
  if (indexes != serving_) {
    // Partitions moved between lanes: each lane's sent_through says nothing
    // about its new ones.
    for (Lane& lane : lanes_) {
      lane.cursor.next_full_claim = absl::InfinitePast();
    }
    serving_ = std::move(indexes);
  }
  return open;
}

bool Lanes::EndRound(bool ran, bool full) {
  const bool before = spread_;
  if (full) {
    spread_ = true;
  } else if (ran) {
    spread_ = std::any_of(lanes_.begin(), lanes_.end(),
                          [](const Lane& lane) { return lane.any_full(); });
  }
  return spread_ != before;
}

bool Lanes::AllWait(const std::vector<Lane*>& serving) const {
  return !serving.empty() &&
         std::all_of(serving.begin(), serving.end(),
                     [&](const Lane* lane) { return Limit(*lane) == 0; });
}

int Lanes::Limit(const Lane& lane) const {
  return lane.Limit(limits_.batch_size, limits_.window, limits_.pipeline_depth);
}

void Lanes::RestartClaims() {
  for (Lane& lane : lanes_) {
    lane.cursor.sent_through = 0;
    lane.cursor.next_full_claim = absl::InfinitePast();
  }
}

int Lanes::Release(uint64_t flushed, absl::Time now) {
  int sent = 0;
  for (Lane& lane : lanes_) sent += lane.Release(flushed, now);
  return sent;
}

void Lanes::ForgetInboxHigh() {
  for (Lane& lane : lanes_) {
    for (auto& [id, batch] : lane.batches()) batch.inbox_high_at_send = 0;
  }
}

void Lanes::PartitionsInFlight(std::set<int>* out) const {
  for (const Lane& lane : lanes_) lane.PartitionsInFlight(out);
}

int64_t Lanes::Close(absl::Duration patience) {
  int64_t unanswered = 0;
  for (Lane& lane : lanes_) {
    if (lane.has_stream()) {
      unanswered += static_cast<int64_t>(lane.events_in_flight());
    }
    lane.Close(patience);
  }
  return unanswered;
}

int64_t Lanes::events_in_flight() const {
  int64_t n = 0;
  for (const Lane& lane : lanes_) {
    n += static_cast<int64_t>(lane.events_in_flight());
  }
  return n;
}

bool Lanes::connected() const {
  return std::all_of(lanes_.begin(), lanes_.end(),
                     [](const Lane& lane) { return lane.connected(); });
}

bool Lanes::holding() const {
  return std::any_of(lanes_.begin(), lanes_.end(),
                     [](const Lane& lane) { return lane.holding(); });
}

}  // namespace outbox::relay
