#pragma once
// Applies delivered events to the billing database exactly once and in
// per-aggregate order. A batch is one transaction: for each event the inbox
// row, the aggregate's cursor and the billing effects (order view, charges)
// commit together; events whose predecessor is missing are parked in
// held_events and applied, in the same transaction, when the gap closes.
// Every aggregate touched is locked through its cursor row (in sorted order,
// so replicas never deadlock), which is what keeps two consumer replicas from
// stranding a held event.

#include <vector>

#include "absl/status/statusor.h"
#include "common/db.h"
#include "common/metrics.h"
#include "outbox/v1/consumer.pb.h"

namespace outbox::consumer {

class Applier {
 public:
  // `db` and `metrics` must outlive the applier.
  Applier(Database* db, Metrics* metrics);

  // One result per event, in order, after the transaction committed (the
  // commit is synchronous, so an answered APPLIED survives a database crash).
  // Invalid events are REJECTED with the reason. Unavailable when the
  // database is unreachable: nothing is answered, the sender retries.
  absl::StatusOr<std::vector<v1::EventResult>> ApplyBatch(
      const std::vector<const v1::Event*>& events);

 private:
  absl::StatusOr<std::vector<v1::EventResult>> ApplyOnce(
      const std::vector<const v1::Event*>& events);

  Database* const db_;
  Counter* const applied_;
  Counter* const duplicates_;
  Counter* const held_;
  Counter* const rejected_;
  Counter* const drained_;
};

}  // namespace outbox::consumer
