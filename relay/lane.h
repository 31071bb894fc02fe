#pragma once
// One delivery stream of a relay and what is in flight on it: the batches
// sent and not yet answered, those the replication fence holds back, and
// where its claims stand. The relay's worker owns its lanes; a lane knows
// nothing of marks or the database.
//
// Example (on the worker):
//   Lane lane(0, Backoff(absl::Milliseconds(100), absl::Seconds(5)));
//   lane.Open(sink, wake, absl::Now());   // when due and the sink is ready
//   lane.Send(std::move(batch), std::move(request), std::nullopt, now);
//   while (std::optional<Lane::Answered> a = lane.NextAnswer()) {
//     ...a->batch is null for an answer to no batch of this lane...
//   }
//   lane.Release(flushed_lsn, now);       // held batches the fence let go
//   std::vector<InFlight> lost = lane.Drop(now);  // answers that won't come
//
// Invariants, checked by assert after every change: the seqs in flight are
// exactly those of the batches in flight, as many times as they are sent
// (the log reads again what a broken stream had, and another lane may
// still carry it); every batch held by the fence is in flight, unsent.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "outbox/v1/sink.pb.h"
#include "relay/claim_walk.h"
#include "relay/marks.h"
#include "relay/policy.h"
#include "relay/sink.h"

namespace outbox::relay {

class Lane {
 public:
  Lane(int index, Backoff stream_backoff);

  int index() const { return index_; }
  // A stream is open and not broken.
  bool connected() const { return stream_ != nullptr && !stream_->broken(); }
  bool has_stream() const { return stream_ != nullptr; }
  // Why the open stream broke ("" while it works).
  std::string broken() const;

  // Opens a stream unless one is open or the backoff of the last failure
  // runs: only on a ready sink (opening blocks until the channel connects,
  // and the worker never waits on the network). `wake` is called from the
  // stream's threads on each answer and when it breaks.
  void Open(Sink& sink, std::function<void()> wake, absl::Time now);
  // Sends `request` (whose batch is `batch`) now, or, with `hold_until`,
  // once Release sees the standbys flushed that WAL position; in flight
  // either way. Requires a stream and a batch id not in flight.
  void Send(InFlight batch, v1::DeliverRequest request,
            std::optional<uint64_t> hold_until, absl::Time now);
  // Sends the held batches up to WAL position `flushed`, in order, while a
  // stream is open. Returns how many it sent.
  int Release(uint64_t flushed, absl::Time now);

  // An answer the stream brought, and the batch it answers (taken out of
  // flight), or null when no batch this lane sent has its id.
  struct Answered {
    v1::DeliverResponse response;
    std::optional<InFlight> batch;
  };
  // The next answer, one at a time, so that what the caller learns from
  // one (Batches) holds for the batches still in flight when it takes the
  // next. Any answer ends the backoff of broken streams.
  std::optional<Answered> NextAnswer();

  // Cancels the stream (answers not yet taken are lost) and returns what
  // was in flight, held batches included; the next Open waits for the
  // backoff.
  std::vector<InFlight> Drop(absl::Time now);
  // Half-closes the stream when nothing is in flight, waits up to
  // `patience` for the far end to end it, then cancels it. For shutdown.
  void Close(absl::Duration patience);

  // The oldest batch sent and unanswered was sent before now - timeout.
  bool Overdue(absl::Time now, absl::Duration timeout) const;
  // Events the next claim may ask for (ClaimLimit); 0: wait for answers.
  int Limit(int batch_size, int window, int pipeline_depth) const;

  size_t events_in_flight() const { return in_flight_seqs_.size(); }
  bool idle() const { return in_flight_.empty(); }
  bool holding() const { return !held_.empty(); }
  // Whether any batch in flight was full (a backlog).
  bool any_full() const;
  // Whether any batch in flight came from the outbox log.
  bool any_from_log() const;
  // Adds the partitions of every batch in flight to `out`.
  void PartitionsInFlight(std::set<int>* out) const;
  // The batches in flight, for what the relay learns of all of them.
  std::map<uint64_t, InFlight>& batches() { return in_flight_; }

  ClaimCursor cursor;

 private:
  void CheckInvariants() const;

  const int index_;
  Backoff stream_backoff_;
  std::unique_ptr<BatchStream> stream_;
  absl::Time next_stream_attempt_ = absl::InfinitePast();
  std::map<uint64_t, InFlight> in_flight_;
  std::multiset<int64_t> in_flight_seqs_;
  // Batches the fence holds: the WAL position each waits for, and its
  // request (its InFlight is in in_flight_ already, sent_at infinite).
  std::deque<std::pair<uint64_t, v1::DeliverRequest>> held_;
  std::deque<v1::DeliverResponse> answers_;  // taken, not yet handed out
};

}  // namespace outbox::relay
