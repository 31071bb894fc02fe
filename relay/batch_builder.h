#pragma once
// What rides in a batch: the events a claim (delivery rows) or a read of
// the outbox log found, turned into one DeliverRequest and its in-flight
// record, with the marks of those that cannot go. Pure, so that each rule
// is tested case by case (batch_builder_test):
//   - an aggregate whose first event here is not its next undelivered one
//     (`goes` false: its predecessor backs off, is dead or in flight)
//     sends nothing of it; from the log, its events become exceptions;
//   - an aggregate with events out in an earlier batch (`busy`) sends
//     nothing new either (the log's case; a claim leaves such rows out);
//   - an event that cannot be delivered (its payload unreadable, or above
//     kMaxEventBytes) is REJECTED here, and the aggregate's later events
//     wait for its fate: not sent (claimed rows stay pending), or owed
//     (from the log);
//   - the batch stops once its events pass `max_bytes` (claimed rows: the
//     rest is claimed again later), and says so;
//   - events go with the outbox's source, and a prev_seq below the
//     subscription's first event reads as 0 (the chain starts here for
//     this subscriber).
// Every event sent, rejected or owed is one more event out for its chain
// (`busy`, one entry each, for BusyChains::Add).
//
//   BuiltBatch b = BuildBatch(std::move(candidates), {.batch_id = id, ...});
//   for (const std::string& c : b.busy) busy_.Add(c);
//   marks_.insert(marks_.end(), b.marks.begin(), b.marks.end());
//   if (!b.batch.seqs.empty()) Dispatch(lane, b.batch, b.request, lsn);

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "outbox/v1/sink.pb.h"
#include "relay/marks.h"

namespace outbox::relay {

// Why an event cannot be delivered, or "": its stored payload is not an
// outbox.v1.Event, or the event (of `size` bytes) is too large for any
// consumer.
std::string Undeliverable(bool parsed, size_t size);

// One event a claim or a log read found, in seq order.
struct Candidate {
  v1::Event event;
  bool parsed = true;  // its stored payload could be read
  int partition = 0;
  // Claimed rows: whether its aggregate's first row here is its first
  // undelivered event. Ignored for all but an aggregate's first.
  bool goes = true;
};

struct BatchRules {
  uint64_t batch_id = 0;
  bool from_log = false;
  std::string source;           // Event.source of every event
  int64_t chain_from = 0;       // a prev_seq below it is sent as 0
  size_t max_bytes = SIZE_MAX;  // of the events, before the batch stops
  // Whether a chain has events out in an earlier batch; null: none has.
  std::function<bool(const std::string& chain)> busy;
};

struct BuiltBatch {
  v1::DeliverRequest request;     // the events that go, in order
  InFlight batch;                 // their record (batch_id, seqs, ...)
  std::vector<Mark> marks;        // rejected here; from the log, owed too
  std::vector<std::string> busy;  // a chain per event sent, rejected, owed
  bool cut_by_bytes = false;      // stopped at max_bytes: more may follow
  int64_t sent_through = 0;       // the largest seq sent; 0: none
};

BuiltBatch BuildBatch(std::vector<Candidate> candidates,
                      const BatchRules& rules);

}  // namespace outbox::relay
