#pragma once
// Retention: which events may leave the outbox. An event goes once every
// subscription is done with it and it is older than the retention, and
// only as a prefix of the outbox (oldest first, stopping at the first one
// that must stay), so that what is gone is exactly what lies below the
// oldest retained seq (outboxctl verify relies on it).
//
// A subscription is done with an event when it has no outbox_delivery row
// at or below it and, for one the log delivers to, the oldest tick the
// log's subscriptions need (outbox_log_floor) shows the event's
// transaction.
//
// Example (the relay's housekeeping, in small batches):
//   while (PruneOutbox(*OpenUnit(conn), retention, 1000) == 1000) {}

#include <cstdint>
#include <pqxx/pqxx>

#include "absl/time/time.h"

namespace outbox::relay {

// Deletes up to `limit` events older than `retention` that every
// subscription is done with; returns how many. Throws as libpqxx does.
int64_t PruneOutbox(pqxx::transaction_base& tx, absl::Duration retention,
                    int limit);

}  // namespace outbox::relay
