#pragma once
// Inbox retention: the inbox keeps a row per applied event only as long as
// dedup needs its identity. Rows applied longer than `keep` ago are
// deleted in small batches; each aggregate's cursor remembers how far its
// rows were deleted (aggregate_cursors.pruned_through), so a redelivery of
// such an event is still answered DUPLICATE (see inbox/batch_plan.h).

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <pqxx/pqxx>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/db.h"
#include "common/metrics.h"
#include "common/periodic.h"

namespace outbox::inbox {

// Deletes at most `batch` inbox rows applied before now - `keep`, under the
// same aggregate locks as applying, and moves their aggregates'
// pruned_through. Returns how many rows it deleted.
int64_t PruneInboxOnce(pqxx::connection& conn, absl::Duration keep, int batch);

// Runs PruneInboxOnce in the background: `busy_pause` after a full batch
// (a backlog of old rows is worked off at a pace that leaves applying its
// share of the database), else every `interval`. Errors are logged and
// retried later; they never touch delivery.
class InboxRetention {
 public:
  InboxRetention(Database* db, absl::Duration keep, Metrics* metrics,
                 absl::Duration interval = absl::Minutes(1), int batch = 500,
                 absl::Duration busy_pause = absl::Milliseconds(250));
  // Destruction stops it, waiting for a batch in progress.
  InboxRetention(const InboxRetention&) = delete;
  InboxRetention& operator=(const InboxRetention&) = delete;

 private:
  bool RunOnce();  // true when the batch came back full

  Database* const db_;
  const absl::Duration keep_;
  const int batch_;
  Counter* const pruned_;
  PeriodicTask task_;  // last: starts after the members it uses
};

}  // namespace outbox::inbox
