#pragma once
// Retention: which events may leave the outbox. An event goes once every
// subscription is done with it and it is older than the retention, and
// only as a prefix of the outbox (oldest first, stopping at the first one
// that must stay), so that what is gone is exactly what lies below the
// oldest retained seq (outboxctl verify relies on it). A transaction
// that may still commit holds the prefix back below its seq: until it
// ends, no event above it goes, however old (an event may commit long
// after events with larger seqs).
//
// A subscription is done with an event when it has no outbox_delivery row
// at or below it and, for one the log delivers to, the oldest tick the
// log's subscriptions need (outbox_log_floor) shows the event's
// transaction. An operator's replay or a heal owing events again (ReOwe,
// Replay) holds the deletes back until it commits: both take one lock,
// the deletes exclusive, they shared. A heal due for any subscription
// holds every delete back until a relay ran it (delivery_store.h
// RequestHeal): it needs what retention has not deleted yet.
//
// Example (the relay's housekeeping, in small batches, each in a
// transaction of its own: PruneOutbox takes the lock in a statement before
// its delete, so `tx` must not be a pqxx::nontransaction, and must be READ
// COMMITTED, so that the delete sees what committed after the first):
//   do { pqxx::work tx(conn); n = PruneOutbox(tx, retention, 1000);
//        tx.commit(); } while (n == 1000);

#include <cstdint>
#include <string>
#include <pqxx/pqxx>

#include "absl/time/time.h"

namespace outbox::relay {

// Deletes up to `limit` events older than `retention` that every
// subscription is done with; returns how many. Throws as libpqxx does,
// and std::logic_error outside READ COMMITTED. With `held_back`, says
// what an event old enough to go waits for, "" when nothing does: a
// transaction that may still commit below it (worth another step soon),
// or a due heal.
int64_t PruneOutbox(pqxx::transaction_base& tx, absl::Duration retention,
                    int limit, std::string* held_back = nullptr,
                    bool* dropped_child = nullptr);

// On a partitioned outbox (outbox_partition_outbox, common/schema.cc)
// PruneOutbox drops the oldest child whole once every event in it may go,
// one child a call whatever `limit`, and returns the events it held: none
// go before all of them may (a child's span sets how long its events
// outlive `retention`). With `dropped_child`, says whether it dropped one
// (perhaps empty): call it again while it does.

// Holds PruneOutbox back until `tx` ends (the lock above, shared): for
// whoever owes retained events again (ReOwe, Replay). Call it before
// reading the events, in a transaction (not a pqxx::nontransaction).
void HoldRetentionBack(pqxx::transaction_base& tx);

}  // namespace outbox::relay
