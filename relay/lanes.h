#pragma once
// A relay's delivery streams together: which of them carry a round's
// partitions, how much each may ask for, and what is in flight on all of
// them. While there is a backlog every open lane serves (each its share of
// the partitions, applied in parallel by the consumer); otherwise the
// first open one carries them all, so that the small batches of a moderate
// rate reach the consumer one at a time and grow while it applies the one
// before. Knows nothing of marks, answers' meaning or the database: the
// relay's worker owns it and is its only caller.
//
// Example (one round of the worker):
//   Lanes lanes(2, Backoff(...), {.batch_size = 512, .window = 2048,
//                                 .pipeline_depth = 2});
//   lanes.Open(sink, wake, absl::Now());
//   const std::vector<Lane*> serving = lanes.Serving();
//   ...claim or read for serving[i] (slot i of serving.size()), at most
//      lanes.Limit(*serving[i]) events, and Lane::Send what was found...
//   const bool changed = lanes.EndRound(/*ran=*/true, /*full=*/false);
//   const bool wait = !changed && lanes.AllWait(serving);
//
// Invariant: a change of the serving set restarts every lane's claims from
// the start of its partitions (their sent_through says nothing of the
// partitions a lane takes over).

#include <cstdint>
#include <functional>
#include <set>
#include <vector>

#include "absl/time/time.h"
#include "relay/lane.h"
#include "relay/policy.h"
#include "relay/sink.h"

namespace outbox::relay {

class Lanes {
 public:
  // What a lane may have in flight (ClaimLimit): events a batch, events in
  // all, and batches while each batch in flight was full.
  struct Limits {
    int batch_size = 512;
    int window = 2048;
    int pipeline_depth = 2;
  };

  // `count` lanes (at least one), each backing off its stream's failures
  // by a copy of `stream_backoff`.
  Lanes(int count, const Backoff& stream_backoff, Limits limits);

  // Opens each lane's stream that is due (Lane::Open).
  void Open(Sink& sink, const std::function<void()>& wake, absl::Time now);

  // The lanes that claim this round, in lane order: every open one while
  // spread (a backlog), else one open lane, the one that carried the last
  // round while it stays connected (a lane that connects later does not
  // send a second batch beside the one awaiting its answer).
  std::vector<Lane*> Serving();
  // After the serving lanes' claims: one of them ran (`ran`), one filled
  // its batch (`full`: a backlog, the lanes spread). Worked off once a
  // claim ran, none filled its batch and no full one is in flight.
  // Returns whether the spread changed (the serving set changes next
  // round).
  bool EndRound(bool ran, bool full);
  // Every lane of `serving` waits for answers (its Limit is 0); false for
  // none.
  bool AllWait(const std::vector<Lane*>& serving) const;

  // Events `lane`'s next claim may ask for; 0: it waits for answers.
  int Limit(const Lane& lane) const;

  // Every lane's next claim starts from the start of its partitions, as
  // when nothing was sent (the outbox database changed under them).
  void RestartClaims();
  // Sends the batches the fence held up to WAL position `flushed`, on
  // every lane; returns how many went.
  int Release(uint64_t flushed, absl::Time now);
  // Batches in flight are judged by no inbox high-water mark of the
  // consumer's (it went back).
  void ForgetInboxHigh();
  // Adds the partitions of every batch in flight to `out`.
  void PartitionsInFlight(std::set<int>* out) const;
  // Closes every stream (Lane::Close, `patience` each) and returns the
  // events that were in flight on them, unanswered. For shutdown.
  int64_t Close(absl::Duration patience);

  int64_t events_in_flight() const;
  // Every lane has its stream.
  bool connected() const;
  // A lane holds a fenced batch.
  bool holding() const;
  bool spread() const { return spread_; }

  std::vector<Lane>::iterator begin() { return lanes_.begin(); }
  std::vector<Lane>::iterator end() { return lanes_.end(); }
  std::vector<Lane>::const_iterator begin() const { return lanes_.begin(); }
  std::vector<Lane>::const_iterator end() const { return lanes_.end(); }

 private:
  const Limits limits_;
  std::vector<Lane> lanes_;
  // A backlog was seen and not yet worked off.
  bool spread_ = false;
  std::vector<int> serving_;  // indexes of the lanes Serving last chose
};

}  // namespace outbox::relay
