#pragma once
// Reconciliation on demand: for one subscription, compares the outbox with
// the subscriber's inbox over a window of commit times, on a live system,
// and lists every event committed before the grace period that is not
// applied, with why: still pending (and how often it was tried), a dead
// letter, waiting behind one, held behind a gap at the consumer, parked as
// diverged, or lost (marked delivered, yet the consumer has no trace of
// it). It also looks from the consumer back: every event the inbox applied
// in the window that the outbox does not hold (committed, applied, then
// lost by a failover of the outbox database, or never committed) is listed
// by event and aggregate, and so is every aggregate whose histories
// diverged and waits for an operator. Domain-free: it reads only the
// outbox's and the inbox engine's tables.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/db.h"

namespace outbox::tools {

struct ReconcileOptions {
  std::string subscription = "billing";
  absl::Duration window = absl::Hours(1);   // events committed this long ago
  absl::Duration grace = absl::Minutes(5);  // ... but not in the last grace
  size_t max_listed = 50;                   // findings printed one by one
};

// One event committed in the window and not applied.
struct Finding {
  int64_t seq = 0;
  std::string event_id, aggregate_id, event_type;
  absl::Duration age;  // since its commit
  // pending, behind a dead letter, dead, held, diverged, lost; orphaned
  // (applied, not in the outbox); diverged aggregate
  std::string reason;
  std::string detail;  // attempts, next try, last error, missing predecessor
};

struct ReconcileReport {
  std::string subscription;
  absl::Duration window, grace;
  int64_t events = 0;   // committed in the window (and owed)
  int64_t applied = 0;  // in the inbox
  int64_t pruned = 0;   // applied, inbox row gone to retention
  int64_t pending = 0, behind_dead = 0, dead = 0, held = 0, lost = 0;
  int64_t diverged = 0;  // deliveries parked as diverged
  // From the consumer back: applied in the window, not in the outbox.
  int64_t orphaned = 0;
  int64_t open_divergences = 0;   // aggregates waiting for an operator
  // A heal due (a database changed under the subscription), "" when none:
  // until a relay ran it, what the consumer lost is not delivered again
  // and not every divergence is recorded, so the findings are incomplete.
  std::string heal_due;
  std::vector<Finding> findings;  // the first max_listed, oldest first

  int64_t not_applied() const {
    return pending + behind_dead + dead + held + lost + diverged;
  }
  int64_t listed() const { return not_applied() + orphaned + open_divergences; }
  bool ok() const { return listed() == 0 && heal_due.empty(); }
  std::string Summary() const;
  std::string Json() const;
};

// NotFound for an unknown subscription; Unavailable when a database cannot
// be read.
absl::StatusOr<ReconcileReport> Reconcile(const std::string& outbox_url,
                                          const std::string& inbox_url,
                                          const ReconcileOptions& options,
                                          const DbSession& session = {});

}  // namespace outbox::tools
