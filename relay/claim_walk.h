#pragma once
// Where a lane's claims of delivery rows start, round after round. A round
// claims first above what the lane sent (when ClaimAboveSent says that
// is enough), then from the start; each claim continues after the last
// row the one before returned, so that a row that could not go (its
// predecessor backing off or dead) is passed, not excluded by id, and a
// round costs the same with thousands of such aggregates as with none.
// A claim from the start also finds the rows that committed after a
// higher seq was sent, which a claim above misses; it runs at least once
// per poll_interval. Pure.
//
// Example (one round on a lane; relay/dispatcher.cc):
//   ClaimWalk walk(&lane.cursor, {.outstanding = n, .batch_size = 512,
//                                 .freed = busy.freed(), .now = now,
//                                 .poll_interval = poll});
//   for (;;) {
//     Claimed c = ClaimPending(tx, {.after = walk.after(), ...});
//     switch (walk.Claimed(rows, c.last_seq, excluded, busy.freed(), now)) {
//       case ClaimWalk::kDone: return;
//       case ClaimWalk::kAgain: continue;   // from the start now
//       case ClaimWalk::kBatch: break;      // send what it found
//     }
//     ... send ...
//     if (!walk.Continue(rows, limit, cut, now)) return;
//   }

#include <cstdint>

#include "absl/time/time.h"

namespace outbox::relay {

// Where a lane's claims stand between rounds.
struct ClaimCursor {
  int64_t sent_through = 0;  // the highest claimed seq sent on the lane
  // A claim from the start at least this often, so that rows passed over
  // never wait long behind a steady stream of new ones.
  absl::Time next_full_claim = absl::InfinitePast();
  // A claim above sent_through skips the rows of busy aggregates (the next
  // event of an order whose previous one is in flight). Set when one ran
  // while an aggregate was busy: once an aggregate has been freed since
  // (BusyChains::freed() moved past freed_at_claim), the next claim starts
  // from the start, so that such a row waits for its predecessor's mark,
  // not for poll_interval.
  bool passed_over = false;
  uint64_t freed_at_claim = 0;
};

class ClaimWalk {
 public:
  struct Start {
    // Events in flight and answered but not marked (ClaimStart).
    int64_t outstanding = 0;
    int batch_size = 0;
    uint64_t freed = 0;         // BusyChains::freed() now
    bool riding_frees = false;  // the marks riding with the claim free one
    absl::Time now;
    absl::Duration poll_interval;
  };
  // Begins a round on `cursor`, which it updates as the round goes.
  ClaimWalk(ClaimCursor* cursor, const Start& start);

  // The next claim reads only rows above what the lane sent.
  bool fresh() const { return fresh_; }
  // The next claim's rows lie above this seq (0: from the start).
  int64_t after() const { return after_; }

  enum Next {
    kBatch,  // send what the claim found, then ask Continue
    kAgain,  // it found nothing above: claim again from the start
    kDone,   // the round is over for this lane
  };
  // A claim returned `rows` rows, the last of seq `last_seq`; it left the
  // rows of busy aggregates out (`excluded`); `freed` is
  // BusyChains::freed() after it.
  Next Claimed(size_t rows, int64_t last_seq, bool excluded, uint64_t freed,
               absl::Time now);
  // The batch of those `rows` (of `limit` asked) went, or stopped at the
  // byte limit (`cut`): whether to claim again.
  bool Continue(size_t rows, int limit, bool cut, absl::Time now);

 private:
  void FromTheStart(absl::Time now);

  ClaimCursor* const cursor_;
  const absl::Duration poll_interval_;
  bool fresh_;
  int64_t after_;
};

}  // namespace outbox::relay
