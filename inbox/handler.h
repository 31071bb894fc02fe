#pragma once
// What a consumer does with events: the domain's part of the inbox. The
// engine (inbox/engine.h) owns everything else: the envelope's checks,
// duplicates, chain order, holding and draining, cursors, and the one
// transaction per batch in which the handler's effects commit together
// with the inbox records of the events that caused them.
//
//   class Shipping : public outbox::inbox::Handler {
//     std::string name() const override { return "shipping"; }
//     const std::vector<Migration>& migrations() const override;
//     absl::Status Validate(const v1::Event& e) const override;
//     std::vector<Rejection> Apply(pqxx::work& tx,
//         const std::vector<const v1::Event*>& events) override;
//   };

#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/db.h"
#include "outbox/v1/event.pb.h"

namespace outbox::inbox {

// An applied event as the inbox records it.
struct AppliedEvent {
  std::string event_id;
  int64_t seq = 0;
  std::string event_type;
};

// An event the handler refuses given what its tables hold (a rule that
// needs the database to decide).
struct Rejection {
  size_t index;        // into the events passed to Apply
  std::string reason;  // why, for the sender's dead letter
};

class Handler {
 public:
  virtual ~Handler() = default;

  // Names the handler in logs and its migrations' schema: [a-z0-9_]+.
  virtual std::string name() const = 0;

  // The handler's own tables, applied after the engine's (InboxSchema).
  virtual const std::vector<Migration>& migrations() const = 0;

  // Whether the handler could ever apply `event`, whose envelope the engine
  // has checked (ids, seq and prev_seq). A non-OK status makes the event
  // REJECTED with its message as the reason: an unknown type or schema
  // version, a payload that does not parse or breaks the domain's rules.
  // Pure: no I/O, safe from any thread, and the same answer every time.
  virtual absl::Status Validate(const v1::Event& event) const = 0;

  // Applies `events` inside `tx`, the batch's transaction: each valid,
  // never applied before, each aggregate's in chain order (events of
  // different aggregates interleave). Effects must be idempotent per event
  // only in the sense that each event is passed once, ever.
  //
  // Returns the events it refuses; when any, the engine rolls `tx` back and
  // applies the batch again without them (they are REJECTED, and the later
  // events of their aggregates wait). Throws what libpqxx throws: the
  // engine blames an event only for a data error (SQLSTATE classes 22, 23
  // and 54, see common/sql_state.h), finding the culprit by applying one
  // event at a time; any other error (the database read-only, full, gone,
  // too slow) answers nothing, and the relay resends later.
  virtual std::vector<Rejection> Apply(
      pqxx::work& tx, const std::vector<const v1::Event*>& events) = 0;

  // An operator adopted the producer's history of `aggregate_id` after the
  // two diverged (a failover lost events this consumer had applied):
  // `kept` are its events still applied, oldest first; `superseded` are no
  // longer, and the producer's own events after `kept` follow as usual.
  // The effects of `superseded` stay (they happened; inbox_superseded
  // records them for the operator to compensate); a handler that keeps
  // state derived from the aggregate's history sets it back to what `kept`
  // implies, inside `tx`, the rewind's transaction. By default nothing.
  virtual void Rewound(pqxx::work& tx, const std::string& aggregate_id,
                       const std::vector<AppliedEvent>& kept,
                       const std::vector<AppliedEvent>& superseded) {}
};

}  // namespace outbox::inbox
