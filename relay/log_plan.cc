#include "relay/log_plan.h"

#include <algorithm>
#include <cassert>

namespace outbox::relay {

std::optional<RangeToRead> NextRange(const LogPosition& at,
                                     int64_t latest_tick) {
  if (at.reading > at.done) {
    return RangeToRead{
        .from = at.done, .to = at.reading, .after_seq = at.after_seq};
  }
  if (latest_tick <= at.done) return std::nullopt;
  return RangeToRead{.from = at.done, .to = latest_tick, .after_seq = 0};
}

bool MovesForward(const LogPosition& from, const LogPosition& to) {
  if (to.reading != 0 && to.reading <= to.done) return false;
  if (from.reading != 0 && from.reading <= from.done) return false;
  if (to.done == from.done) {
    if (from.reading == 0) return true;  // nothing, or a range begun
    return to.reading == from.reading && to.after_seq >= from.after_seq;
  }
  if (to.done < from.done) return false;
  // Ranges finished: the begun one entirely.
  return from.reading == 0 || to.done >= from.reading;
}

BatchPlan PlanBatch(absl::Span<const PlannedEvent> events,
                    const std::set<std::string>& excepted) {
  BatchPlan plan;
  for (const PlannedEvent& e : events) {
    assert(plan.send.empty() || plan.send.back() < e.seq);
    assert(plan.divert.empty() || plan.divert.back() < e.seq);
    if (excepted.count(e.chain) > 0 ||
        plan.diverted_chains.count(e.chain) > 0) {
      plan.divert.push_back(e.seq);
      plan.diverted_chains.insert(e.chain);
    } else {
      plan.send.push_back(e.seq);
    }
  }
  return plan;
}

RangeProgress::RangeProgress(int64_t after_seq) : read_through_(after_seq) {}

void RangeProgress::Read(absl::Span<const int64_t> seqs, int64_t last_seq,
                         bool range_done) {
  assert(!read_all_);
  for (int64_t seq : seqs) {
    // Reads continue where the last one ended, in seq order.
    assert(seq > read_through_);
    assert(window_.empty() || window_.back().seq < seq);
    window_.push_back(Entry{seq, false});
    ++in_flight_;
    read_through_ = seq;
  }
  assert(last_seq >= read_through_);
  read_through_ = last_seq;
  read_all_ = range_done;
}

bool RangeProgress::Settle(int64_t seq) {
  auto it =
      std::lower_bound(window_.begin(), window_.end(), seq,
                       [](const Entry& e, int64_t s) { return e.seq < s; });
  if (it == window_.end() || it->seq != seq || it->settled) return false;
  it->settled = true;
  --in_flight_;
  while (!window_.empty() && window_.front().settled) window_.pop_front();
  assert(window_.empty() || !window_.front().settled);
  assert(in_flight_ <= window_.size());
  return true;
}

void RangeProgress::Rewind() {
  if (window_.empty()) return;
  read_through_ = position();
  window_.clear();
  in_flight_ = 0;
  read_all_ = false;
}

int64_t RangeProgress::position() const {
  // The front is the lowest unsettled event: everything below it is.
  return window_.empty() ? read_through_ : window_.front().seq - 1;
}

}  // namespace outbox::relay
