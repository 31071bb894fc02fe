#include "relay/settlement.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cassert>

#include "common/log.h"

namespace outbox::relay {

void Settlement::Sent(const BuiltBatch& built) {
  for (const std::string& chain : built.busy) busy_.Add(chain);
  marks_.insert(marks_.end(), built.marks.begin(), built.marks.end());
  Check();
}

void Settlement::Answered(Answer answer) {
  for (Mark& m : answer.marks) {
    if (m.kind == Mark::kRejected) {
      LogEventScope scope(m.log_fields);
      spdlog::info("relay: row {} REJECTED by the consumer: {}", m.seq,
                   m.reason);
    }
    marks_.push_back(std::move(m));
  }
  for (const std::string& chain : answer.unanswered) busy_.Remove(chain);
  Check();
}

void Settlement::Dropped(const InFlight& batch) {
  for (const EventLogFields& e : batch.events) {
    busy_.Remove(OutboxChain(e.aggregate_type, e.aggregate_id));
  }
  Check();
}

void Settlement::Clear() {
  marks_.clear();
  busy_.Clear();
}

bool Settlement::RideWithClaim() const {
  return std::all_of(marks_.begin(), marks_.end(),
                     [](const Mark& m) { return m.delivered(); });
}

std::map<std::string, int> Settlement::Riding() const {
  std::map<std::string, int> riding;
  if (RideWithClaim()) {
    for (const Mark& m : marks_) ++riding[m.chain];
  }
  return riding;
}

Settled Settlement::Written(const WrittenMarks& written) {
  Settled settled{.tally = TallyMarks(marks_), .written = written};
  for (const Mark& m : marks_) {
    // Answered, or an exception now: the log's position may pass it.
    if (m.from_log) settled.from_log.push_back(m.seq);
    busy_.Remove(m.chain);
  }
  marks_.clear();
  return settled;
}

void Settlement::Check() const {
#ifndef NDEBUG
  std::map<std::string, int> marked;
  for (const Mark& m : marks_) ++marked[m.chain];
  for (const auto& [chain, n] : marked) {
    assert(busy_.events(chain) >= n && "a mark of a chain not busy");
  }
#endif
}

}  // namespace outbox::relay
