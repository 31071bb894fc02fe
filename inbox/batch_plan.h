#pragma once
// The inbox engine's decisions for one batch, without I/O. Given the batch and
// what the database holds about its aggregates (read under their cursor
// locks: a Snapshot), PlanBatch decides what to answer for each event,
// which events to apply and in what order, which to park in held_events,
// which held events drain, and where each cursor ends. The engine
// (inbox/engine.h) reads the snapshot, plans, and writes the plan in a
// few statements; everything a test needs to check a decision is here.
//
// The rules, per valid event e of aggregate A whose cursor is C:
//   e.seq <= C      DUPLICATE if the inbox holds e.event_id (or e was
//                   applied earlier in this batch); otherwise DIVERGED: the
//                   outbox reused a position already passed (a restored
//                   backup, a failover that lost writes).
//   e.prev_seq == C APPLIED, then every held successor in chain order --
//                   unless another event already holds that link (a fork):
//                   REJECTED.
//   e.prev_seq > C  HELD. A second copy of a held event is HELD again and
//                   written once. A different event for a link or a
//                   position that a held event already takes is a fork:
//                   REJECTED. An aggregate holds at most
//                   max_held_per_aggregate events: beyond, REJECTED.
//   otherwise       (prev_seq < C < seq) the chain is broken: DIVERGED (the
//                   outbox's history left this one before C).
// DIVERGED is not the event's fault: this database holds another history
// of the aggregate; the sender parks the event until an operator decides.
// HELD and DIVERGED answers carry the aggregate's applied position.
// An event whose id this batch applied at another place (another
// aggregate or position) is REJECTED, whatever its own position: two
// events under one id. Invalid events are REJECTED with their validation
// reason. An event that
// would be HELD while an earlier event of its aggregate in the same batch
// was REJECTED is DEFERRED instead: the relay keeps it pending behind that
// one (which may become a dead letter) rather than park it here.
//
// The plan drains and counts only the held events the snapshot shows. A
// held event that the chain passed without taking it (a fork held first,
// whose position another event then took) is off the chain's links; the
// writer deletes such rows by position when a cursor moves, and lowers
// the held count by as many.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "outbox/v1/event.pb.h"
#include "outbox/v1/sink.pb.h"

namespace outbox::inbox {

struct AggregateState {
  int64_t cursor = 0;      // seq of the last applied event; 0 for none
  int64_t held_count = 0;  // its rows in held_events
  // Inbox retention deleted the inbox rows of its events up to this seq
  // (all at or below the cursor): an event at or below it is a redelivery
  // of an applied event, as no other event can be there (see PlanBatch).
  int64_t pruned_through = 0;

  bool operator==(const AggregateState& o) const {
    return cursor == o.cursor && held_count == o.held_count &&
           pruned_through == o.pruned_through;
  }
};

// Where the inbox holds an applied event: its aggregate id and seq, which
// the inbox rows of every release record.
struct InboxPlace {
  std::string aggregate_id;
  int64_t seq = 0;
};

// What the database holds about a batch's aggregates.
struct Snapshot {
  // Every aggregate of the batch's valid events.
  std::map<std::string, AggregateState> aggregates;
  // The event ids the inbox holds, among those the engine asked about
  // (see InboxQuestions), with where each was applied. An id missing here
  // is taken as "not applied".
  std::map<std::string, InboxPlace> in_inbox;
  // Held events the batch can touch (see HeldQuestions): the held chains
  // that start at each cursor and at each batch event's seq and prev_seq,
  // and any held event with a batch event's id or (aggregate, seq).
  std::vector<v1::Event> held;
  // Aggregates whose held chain at the cursor drains before the batch (an
  // operator released or skipped a held event); each must be in
  // `aggregates`.
  std::set<std::string> drain;
};

struct PlanOptions {
  int64_t max_held_per_aggregate = 1000;
};

struct Plan {
  // One per batch event, in batch order.
  std::vector<v1::EventResult> results;
  // Events to apply, in apply order; each aggregate's in chain order. They
  // point into the batch or into Snapshot::held.
  std::vector<const v1::Event*> apply;
  // New held_events rows (batch events, none of which is applied).
  std::vector<const v1::Event*> hold;
  // held_events rows to delete: drained (they are in `apply`).
  std::vector<std::string> unhold;
  // The new state of each aggregate whose cursor or held count changed.
  std::map<std::string, AggregateState> changed;

  // What happened, for metrics and logs.
  int64_t applied = 0;            // batch events answered APPLIED
  int64_t duplicates = 0;         // DUPLICATE answers
  int64_t pruned_duplicates = 0;  // of which below the retained inbox
  int64_t held = 0;               // HELD answers
  int64_t deferred = 0;           // DEFERRED answers
  int64_t rejected = 0;           // REJECTED answers, all reasons
  int64_t drained = 0;            // held events applied (from earlier batches)
  int64_t diverged = 0;           // DIVERGED answers
  int64_t position_reused = 0;    // DIVERGED: a new event at a passed position
  int64_t forks = 0;              // REJECTED: a second event for a held link
  int64_t over_cap = 0;           // REJECTED: the aggregate holds too many
  int64_t discarded = 0;  // held events dropped: their id was applied elsewhere
};

// Decides a batch. `invalid[i]`, when not empty, is why batch[i] failed
// validation (REJECTED with that reason); `invalid` is empty or as long as
// `batch`. Every aggregate of a valid event must be in
// `snapshot.aggregates`. Pointers in the result stay valid while `batch`
// and `snapshot` do.
Plan PlanBatch(const std::vector<const v1::Event*>& batch,
               const std::vector<std::string>& invalid,
               const Snapshot& snapshot, const PlanOptions& options);

// The event ids whose inbox membership the plan needs: valid batch events
// at or below their aggregate's cursor. With `all` (the engine's second
// try, after an inbox insert collided), every valid batch event and every
// held event of the snapshot.
std::vector<std::string> InboxQuestions(
    const std::vector<const v1::Event*>& batch,
    const std::vector<std::string>& invalid, const Snapshot& snapshot,
    bool all);

// What the plan needs from held_events, for the aggregates that hold
// something: the chains starting at `links` (aggregate, prev_seq): each
// cursor and each valid batch event's seq and prev_seq; and the held
// events at `positions` (aggregate, seq) or with `ids` of valid batch
// events. Empty when no aggregate of the batch holds anything, so the
// common case reads nothing from held_events.
struct HeldQuery {
  std::vector<std::pair<std::string, int64_t>> links;
  std::vector<std::pair<std::string, int64_t>> positions;
  std::vector<std::string> ids;
  bool empty() const { return links.empty(); }
};
HeldQuery HeldQuestions(const std::vector<const v1::Event*>& batch,
                        const std::vector<std::string>& invalid,
                        const Snapshot& snapshot);

// The common batch, foreseen before its cursors are read: every event
// valid, no id twice, and each aggregate's events linked one to the next
// in batch order (each one's prev_seq the seq of the one before). If each
// aggregate's cursor stands at its first event's prev_seq and it holds
// nothing, PlanBatch applies the whole batch in batch order and moves each
// cursor to its last event's seq; the engine then writes the inbox rows
// and cursors in the statement that locks and reads the cursors
// (inbox/engine.cc), and checks the plan with PlanIsForeseen.
struct Foreseen {
  struct Chain {
    int64_t from = 0;     // the cursor the batch expects (0: none yet)
    int64_t through = 0;  // the cursor it leaves
  };
  std::map<std::string, Chain> chains;  // by chain key
};
// Nothing when the batch is not of that kind (or empty).
std::optional<Foreseen> Foresee(const std::vector<const v1::Event*>& batch,
                                const std::vector<std::string>& invalid);
// Whether `plan` (of `batch`) is what `foreseen` said: every event APPLIED
// in batch order, nothing held or drained, each cursor moved as foreseen.
bool PlanIsForeseen(const Plan& plan,
                    const std::vector<const v1::Event*>& batch,
                    const Foreseen& foreseen);

}  // namespace outbox::inbox
