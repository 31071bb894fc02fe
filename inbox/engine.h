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

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/db.h"
#include "common/metrics.h"
#include "common/watchdog.h"
#include "inbox/batch_plan.h"
#include "inbox/handler.h"
#include "outbox/v1/sink.pb.h"

namespace outbox::inbox {

// Takes the apply locks of `aggregates` for the rest of `tx`, in sorted
// order, as every batch does before it reads or writes their state.
void LockAggregates(pqxx::transaction_base& tx,
                    const std::set<std::string>& aggregates);

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

 private:
  struct Attempt {
    std::vector<v1::EventResult> results;
    Plan plan;
    bool inbox_collision = false;  // retry, asking the inbox about every id
    std::vector<std::string> passed_held;  // held events the chain passed
    // Events the handler's Apply refused (rolled back): id -> reason.
    std::map<std::string, std::string> refused;
  };
  absl::StatusOr<std::vector<v1::EventResult>> ApplyValidated(
      const std::vector<const v1::Event*>& events,
      std::vector<std::string> invalid, BatchOrigin* origin);
  // `keep_held`: held events (by id) the handler refused; they stay held.
  absl::StatusOr<Attempt> ApplyOnce(const std::vector<const v1::Event*>& events,
                                    const std::vector<std::string>& invalid,
                                    const std::set<std::string>& keep_held,
                                    bool ask_inbox_about_all,
                                    BatchOrigin* origin);
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
  Counter* const refused_held_;
};

}  // namespace outbox::inbox
