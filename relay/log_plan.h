#pragma once
// Pure planning of delivery from the outbox log (relay/outbox_log.h), no
// I/O: where a subscription's read starts, which events of a read ride in
// a batch and which join their chain's exceptions, and how far the
// position may move as answers come back. The relay's loop only calls
// these and does what they say.
//
// Example:
//   LogPosition at = ...;                       // as stored
//   std::optional<RangeToRead> r = NextRange(at, latest_tick);
//   RangeProgress progress(r->after_seq);
//   LogBatch read = ...ReadLog(r->from, r->to, progress.read_through());
//   BatchPlan plan = PlanBatch(read's events, chains with exceptions);
//   progress.Read(plan.seqs(), read.last_seq, read.range_done);
//   ...send plan.send; on each answer progress.Settle(seq);
//   store {r->from, r->to, progress.position()}, or the next range once
//   progress.done().

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace outbox::relay {

// A subscription's place on the log (per partition, as leased): every
// range up to tick `done` is delivered, and of the range (done, reading]
// every event with seq <= after_seq. reading == 0: no range begun.
struct LogPosition {
  int64_t done = 0;
  int64_t reading = 0;
  int64_t after_seq = 0;
};

// Whether moving from `from` to `to` goes forward: within the begun range
// (after_seq not decreasing), beginning a range from `done`, or finishing
// ranges (a begun one is finished before a later one counts as done).
bool MovesForward(const LogPosition& from, const LogPosition& to);

struct RangeToRead {
  int64_t from = 0, to = 0;  // tick ids, from < to
  int64_t after_seq = 0;     // the read starts above it
};

// The range to read next from `at`, given the newest tick: the one begun,
// else (done, latest]; nothing when the log holds nothing newer (make a
// tick first). A begun range is always finished before a newer one: its
// end cannot move, or events of its later part could be recorded as
// delivered without having been read.
std::optional<RangeToRead> NextRange(const LogPosition& at,
                                     int64_t latest_tick);

// One event of a read, as planning sees it.
struct PlannedEvent {
  int64_t seq = 0;
  std::string chain;  // OutboxChain(aggregate_type, aggregate_id)
};

// Which events of a read go to the consumer and which join their chain's
// exceptions (a chain backing off after a rejection, dead, diverged, or
// with events owed again): an event whose chain has an exception is never
// sent from the log, and neither is any later event of its chain in the
// read, so a failing event stalls only its own chain and its successors
// keep their order.
struct BatchPlan {
  std::vector<int64_t> send;    // ascending
  std::vector<int64_t> divert;  // ascending
  std::set<std::string> diverted_chains;
};

// `events` ascending by seq; `excepted`: the chains that have exceptions.
BatchPlan PlanBatch(absl::Span<const PlannedEvent> events,
                    const std::set<std::string>& excepted);

// The events of one range in flight, and the position they allow: the
// highest seq at or below which every event read is settled (delivered, or
// moved to the exceptions). Reads may run ahead of answers (pipelining);
// the position never passes an event that is not settled.
class RangeProgress {
 public:
  // A range whose events at or below `after_seq` are settled already.
  explicit RangeProgress(int64_t after_seq = 0);

  // The events of one read (all of it, sent and diverted alike), ascending
  // and above read_through(); the read ended at `last_seq` (at least the
  // last of them) and, with `range_done`, nothing of the range is beyond.
  // Requires !read_all().
  void Read(absl::Span<const int64_t> seqs, int64_t last_seq, bool range_done);

  // An event read is settled. False (and nothing changes) if it was not in
  // flight: never read, settled already, or read before a Rewind.
  bool Settle(int64_t seq);

  // Forgets what is in flight (its stream ended): the next read starts at
  // position() again, and the events are read and sent again.
  void Rewind();

  // Every event of the range at or below it is settled; never decreases.
  int64_t position() const;
  // Where the next read starts.
  int64_t read_through() const { return read_through_; }
  // The range was read to its end.
  bool read_all() const { return read_all_; }
  // Read to its end and all settled: the position may move to the next
  // range.
  bool done() const { return read_all_ && in_flight_ == 0; }
  size_t in_flight() const { return in_flight_; }

 private:
  struct Entry {
    int64_t seq;
    bool settled;
  };
  // Unsettled events and those settled behind one that is not, ascending;
  // the front is never settled.
  std::deque<Entry> window_;
  size_t in_flight_ = 0;  // unsettled entries of window_
  int64_t read_through_;
  bool read_all_ = false;
};

}  // namespace outbox::relay
