#pragma once
// The schemas the outbox machinery owns, as versioned migrations:
//
// - "outbox", in the producing service's database: the events (`outbox`),
//   each aggregate's chain head (`outbox_heads`), the subscriptions and
//   their delivery state (`outbox_delivery`). The writer's service and
//   every relay apply it at startup.
// - "inbox", in each consumer's database: applied events (`inbox`), each
//   aggregate's applied position (`aggregate_cursors`) and the events held
//   for their predecessor (`held_events`). The consumer applies it, then
//   its handler's own migrations.
//
// Both adopt a database made by earlier releases, where the order demo's
// migrations ("orders", "billing") created these tables: every statement
// creates only what is missing and converts what is older.
// Table and column names named in DESIGN.md section 3 are a public contract.

#include <vector>

#include "common/db.h"

namespace outbox {

// The channel relays LISTEN on; a NOTIFY on it means "new events".
inline constexpr char kNotifyChannel[] = "outbox_events";

// An event's state for one subscription. outbox_delivery.status holds the
// first three; an event without a delivery row was delivered, or skipped when
// the subscription started after it.
inline constexpr char kDeliveryPending[] = "pending";
inline constexpr char kDeliveryDead[] = "dead";
inline constexpr char kDeliveryDiverged[] = "diverged";
inline constexpr char kDeliveryDelivered[] = "delivered";
inline constexpr char kDeliverySkipped[] = "skipped";

// That state in SQL, for the outbox row `o`, the subscription row `s` and
// its delivery row `d` (LEFT JOINed): the view outbox_deliveries, the
// relay's admin API and the checker read it alike. An event the outbox log
// still owes a subscription on it (outbox_log_owed) is pending.
inline constexpr char kDeliveryStatusSql[] =
    "coalesce(d.status, CASE WHEN o.seq < s.start_seq THEN 'skipped' "
    "WHEN s.start_tick IS NOT NULL AND outbox_log_owed(s.name, o.seq, o.xid, "
    "o.partition) THEN 'pending' ELSE 'delivered' END)";

const std::vector<Migration>& OutboxMigrations();
const std::vector<Migration>& InboxMigrations();

inline Schema OutboxSchema() { return {"outbox", &OutboxMigrations()}; }
inline Schema InboxSchema() { return {"inbox", &InboxMigrations()}; }

}  // namespace outbox
