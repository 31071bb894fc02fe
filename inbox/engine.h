#pragma once
// The inbox engine: applies delivered events to a consumer's database
// exactly once and in per-aggregate order, with a Handler's effects
// (inbox/handler.h). A batch is one transaction: it locks every aggregate
// it touches (in sorted order, so replicas never deadlock, and two
// replicas never strand a held event), reads what the plan needs
// (inbox/batch_plan.h), and writes the plan: inbox rows, the handler's
// effects, held events, cursors.
//
// A failure is blamed on an event only when PostgreSQL says the data of a
// statement was bad (common/sql_state.h); the batch is then applied event
// by event so that only the culprit is REJECTED. Any other failure (a
// read-only or full database, a missing privilege, a timeout, a lost
// connection) answers nothing: Unavailable, and the sender resends later
// without counting an attempt.
//
// A held event whose effect fails as it drains (the handler refuses it, or
// the database refuses its data) is charged, never its predecessor: the
// predecessor applies, the failing event stays held with its attempts and
// error (held_events), and its aggregate waits behind it until an operator
// releases it for another try or skips it (ReleaseHeld, SkipHeld).

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/db.h"
#include "common/ids.h"
#include "common/metrics.h"
#include "common/watchdog.h"
#include "inbox/batch_plan.h"
#include "inbox/handler.h"
#include "outbox/v1/sink.pb.h"

namespace outbox::inbox {

// Chains (their ChainKey, common/ids.h) as three array parameters:
// source, aggregate_type and aggregate_id, one element each per chain.
struct ChainColumns {
  ArrayLiteral source, type, id;
  void Add(const std::string& key);
  void Add(const v1::Event& e);
};

// Takes the apply locks of `chains` (ChainKeys) for the rest of `tx`, in
// sorted order, as every batch does before it reads or writes their state.
void LockAggregates(pqxx::transaction_base& tx,
                    const std::set<std::string>& chains);

// Where a batch was committed, for its sender (DeliverResponse).
struct BatchOrigin {
  DatabaseIdentity inbox;  // the database; unknown if it applied nothing
  // The inbox's apply_id numbers the batch's rows took (0: none). They only
  // grow: a batch whose numbers are below those of a batch answered before
  // it was sent was committed in a database that went back in time.
  int64_t apply_from = 0, apply_through = 0;

  void Add(int64_t from, int64_t through) {
    if (from == 0) return;
    apply_from = apply_from == 0 ? from : std::min(apply_from, from);
    apply_through = std::max(apply_through, through);
  }
};

struct EngineOptions {
  PlanOptions plan;
  // Immediate retries of a batch that hit a transaction conflict
  // (serialization failure, deadlock) before it counts as unavailable.
  int conflict_retries = 5;
};

// What an operator's action on a held event did.
struct HeldActionResult {
  std::string event_id;
  std::string source, aggregate_type, aggregate_id;  // its chain
  int64_t seq = 0;
  int64_t cursor = 0;      // its aggregate's applied position afterwards
  bool applied = false;    // release: it drained (applied) this time
  int64_t drained = 0;     // events held behind it applied by the action
  int64_t held_before = 0;  // events its aggregate held before
  int64_t held_left = 0;   // events its aggregate still holds
  std::string last_error;  // release: why it failed again
  std::string chain() const {
    return ChainKey(source, aggregate_type, aggregate_id);
  }
};

class Engine {
 public:
  // `db`, `handler` and `metrics` must outlive the engine; so must
  // `watchdog` (may be null), which hears of every batch's progress.
  Engine(Database* db, Handler* handler, Metrics* metrics,
         EngineOptions options = {}, Watchdog* watchdog = nullptr);

  // One result per event, in order, after the transaction committed (the
  // commit is synchronous, so an answered APPLIED survives a database
  // crash). Events that can never apply (their envelope, or the handler's
  // Validate or Apply refuses them) are REJECTED with the reason.
  // Unavailable when the database fails for a reason that is not the
  // events' (see the class comment): nothing is answered.
  // `origin`, when given, says where the batch was committed.
  absl::StatusOr<std::vector<v1::EventResult>> ApplyBatch(
      const std::vector<const v1::Event*>& events,
      BatchOrigin* origin = nullptr);

  // An operator's retry of held event `event_id` that failed as it
  // drained: its chain drains again from its aggregate's cursor, and a
  // failure is charged to it again. FailedPrecondition when it is not the
  // next event of its chain (it waits for a missing event, not for an
  // operator); NotFound when nothing with that id is held. Recorded in
  // held_actions with `actor` and `reason`.
  absl::StatusOr<HeldActionResult> ReleaseHeld(const std::string& event_id,
                                               const std::string& actor,
                                               const std::string& reason);
  // Gives up on held event `event_id`, the next event of its chain: it is
  // recorded as done without its effect (an inbox row, so that a
  // redelivery is a DUPLICATE), its aggregate's cursor moves past it, and
  // the events held behind it drain. Same errors and record as
  // ReleaseHeld.
  absl::StatusOr<HeldActionResult> SkipHeld(const std::string& event_id,
                                            const std::string& actor,
                                            const std::string& reason);

  // For a source that has no relay to keep its dead letters (JetStream):
  // parks `event`, which the engine REJECTED, `attempts` times, for
  // `reason`, as a held event that failed: its aggregate waits behind it
  // and an operator releases it for another try or skips it (ReleaseHeld,
  // SkipHeld), as for a held event that failed as it drained; a copy
  // delivered again is HELD. OK if it is parked (or was already).
  // InvalidArgument for an envelope that can be stored nowhere;
  // FailedPrecondition when it has no place to wait: its chain passed its
  // position, another event holds its link or position, its id is in the
  // inbox, or its aggregate holds max_held_per_aggregate events.
  // Unavailable as ApplyBatch.
  absl::Status ParkRefused(const v1::Event& event, const std::string& reason,
                           int64_t attempts);

 private:
  // How one transaction of a batch goes.
  struct AttemptOptions {
    // Held events (by id) not drained: they stay held, and their chains
    // stop before them.
    std::set<std::string> keep_held;
    // Aggregates whose held chains drain from the cursor (ReleaseHeld).
    std::set<std::string> release;
    // A held event (by id) that is done without its effect first, if it is
    // still the next event of its chain (SkipHeld; its aggregate must be
    // in `release`); a committed attempt that did it sets *skipped.
    std::string skip;
    bool* skipped = nullptr;
    bool ask_inbox_about_all = false;  // after an inbox insert collided
    bool dry_run = false;              // roll back whatever happens
    // Write the common batch as its cursors are read (Foresee), when the
    // batch is of that kind and nothing above asks for more.
    bool foresee = true;
  };
  struct Attempt {
    std::vector<v1::EventResult> results;
    Plan plan;
    bool inbox_collision = false;  // retry, asking the inbox about every id
    // The plan was not what Foresee said (rolled back): retry without it.
    bool unforeseen = false;
    std::vector<std::string> passed_held;  // held events the chain passed
    // Events the handler's Apply refused (rolled back): id -> reason.
    std::map<std::string, std::string> refused;
  };
  absl::StatusOr<std::vector<v1::EventResult>> ApplyValidated(
      const std::vector<const v1::Event*>& events,
      std::vector<std::string> invalid, BatchOrigin* origin,
      AttemptOptions options);
  // `drained` gets the held events the plan drained, in apply order, even
  // when the transaction fails.
  absl::StatusOr<Attempt> ApplyOnce(const std::vector<const v1::Event*>& events,
                                    const std::vector<std::string>& invalid,
                                    const AttemptOptions& options,
                                    BatchOrigin* origin,
                                    std::vector<std::string>* drained);
  // After a data error of an attempt that drained `drained`: the held
  // event whose effect the database refuses (id, why), found by dry runs
  // that drain ever fewer of them; nothing when the batch's own events
  // fail without any drained.
  absl::StatusOr<std::optional<std::pair<std::string, std::string>>>
  FindHeldCulprit(const std::vector<const v1::Event*>& events,
                  const std::vector<std::string>& invalid,
                  const AttemptOptions& options,
                  const std::vector<std::string>& drained,
                  const absl::Status& failure);
  // Drains the held chain `chain` (a ChainKey) from its cursor (a failure is
  // charged to the held event that fails), after skipping held event
  // `skip` when not empty (*skipped says whether it was).
  absl::Status DrainAggregate(const std::string& chain,
                              const std::string& skip = "",
                              bool* skipped = nullptr);
  // Counts a failed try against held event `id`, with `why`, at once and
  // whatever becomes of the batch that found it.
  absl::Status ChargeHeld(const std::string& id, const std::string& why);
  // The held event `event_id` and its aggregate's cursor, checked to be the
  // next event of its chain (`what` names the action in errors).
  absl::StatusOr<HeldActionResult> NextHeld(const std::string& event_id,
                                            const char* what);
  // Fills `r`'s cursor and held figures after an action, and records it.
  absl::Status FinishAction(HeldActionResult* r, const char* action,
                            const std::string& actor,
                            const std::string& reason);
  // Counts and logs the outcome of `events` (attempt.plan.results holds
  // one per event, in order).
  void Count(const Attempt& attempt,
             const std::vector<const v1::Event*>& events);

  Database* const db_;
  Handler* const handler_;
  const EngineOptions options_;
  Watchdog* const watchdog_;
  Histogram* const apply_seconds_;
  Histogram* const latency_seconds_;
  Counter* const applied_;
  Counter* const duplicates_;
  Counter* const held_;
  Counter* const rejected_;
  Counter* const deferred_;
  Counter* const diverged_;
  Counter* const drained_;
  Counter* const position_reused_;
  Counter* const forks_;
  Counter* const over_cap_;
  Counter* const discarded_;
  Counter* const unavailable_;
  Counter* const foreseen_;  // batches written as their chains were locked
  Counter* const planned_;   // ... and read first, then written
  Counter* const refused_held_;
};

}  // namespace outbox::inbox
