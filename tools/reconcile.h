#pragma once
// Reconciliation on demand: for one subscription, compares the outbox with
// the subscriber's inbox over a window of commit times, on a live system,
// and lists every event committed before the grace period that is not
// applied, with why: still pending (and how often it was tried), a dead
// letter, waiting behind one, held behind a gap at the consumer, or lost
// (marked delivered, yet the consumer has no trace of it). Domain-free: it
// reads only the outbox's and the inbox engine's tables.

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
  std::string reason;  // pending, behind a dead letter, dead, held, lost
  std::string detail;  // attempts, next try, last error, missing predecessor
};

struct ReconcileReport {
  std::string subscription;
  absl::Duration window, grace;
  int64_t events = 0;   // committed in the window (and owed)
  int64_t applied = 0;  // in the inbox
  int64_t pruned = 0;   // applied, inbox row gone to retention
  int64_t pending = 0, behind_dead = 0, dead = 0, held = 0, lost = 0;
  std::vector<Finding> findings;  // the first max_listed, oldest first

  int64_t not_applied() const {
    return pending + behind_dead + dead + held + lost;
  }
  bool ok() const { return not_applied() == 0; }
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
