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

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
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

// That state in SQL, for the outbox row `o`, the subscription row `s`, its
// delivery row `d` and the rows kDeliveryLogJoinsSql adds (all LEFT
// JOINed): the view outbox_deliveries, the relay's admin API, the checker
// and reconcile read it alike. An event the outbox log still owes a
// subscription on it is pending: the subscription's start tick does not
// show it, and its partition's position has not passed it. That is what
// outbox_log_owed says of one event, joined here once per query instead
// of called per event (120 us each: minutes for a reconcile window).
inline constexpr char kDeliveryStatusSql[] =
    "coalesce(d.status, CASE WHEN o.seq < s.start_seq THEN 'skipped' "
    "WHEN s.start_tick IS NOT NULL AND o.xid IS NOT NULL "
    "AND NOT coalesce(pg_visible_in_snapshot(o.xid, lst.snapshot), false) "
    "AND NOT coalesce(pg_visible_in_snapshot(o.xid, lpd.snapshot) "
    "OR (lp.reading_tick > 0 AND o.seq <= lp.after_seq "
    "AND pg_visible_in_snapshot(o.xid, lpr.snapshot)), false) "
    "THEN 'pending' ELSE 'delivered' END)";
// The rows kDeliveryStatusSql reads for the log, joined after `o` and `s`:
// the start tick, the partition's position and the ticks it stands at.
inline constexpr char kDeliveryLogJoinsSql[] =
    " LEFT JOIN outbox_ticks lst ON lst.id = s.start_tick"
    " LEFT JOIN outbox_log_positions lp ON lp.subscription = s.name"
    " AND lp.partition = o.partition"
    " LEFT JOIN outbox_ticks lpd ON lpd.id = lp.done_tick"
    " LEFT JOIN outbox_ticks lpr ON lpr.id = lp.reading_tick"
    " AND lp.reading_tick > 0 ";

// The lowest seq --retention may have left, as an SQL expression: it
// deleted every event below it (a prefix), and none at or above it, so an
// event missing there went some other way (a failover, a restore).
// Subscriptions, heals, the checker and reconcile read it alike.
inline constexpr char kMinRetainedSql[] =
    "(SELECT deleted_through + 1 FROM outbox_retention_state WHERE id = 1)";

// The heal a subscription ($1; '' for every one, the oldest first) waits
// for, if any: requested (a database changed under it, or an operator asked)
// and not yet done. Its columns: name, requested_at (text, as the database
// prints it), reason, and age_s (how long ago it was requested). The
// relays run it; verify and reconcile say that what it will find is not
// known yet; retention deletes nothing while one is due.
inline constexpr char kHealDueSql[] =
    "SELECT name, heal_requested_at::text AS requested_at, "
    "coalesce(heal_reason, '') AS reason, extract(epoch FROM now() - "
    "heal_requested_at)::float8 AS age_s FROM subscriptions WHERE ($1 = '' "
    "OR name = $1) AND heal_requested_at IS NOT NULL AND (healed_at IS NULL "
    "OR healed_at < heal_requested_at) ORDER BY heal_requested_at";
// A heal that is due: requested after the last one completed.
struct HealDue {
  std::string requested_at;  // as the database prints it, to close it with
  std::string reason;
  absl::Duration age;  // since it was requested

  // For people: "reason, requested N s ago".
  std::string Text() const;
};
// The heal `subscription` waits for, if any.
std::optional<HealDue> DueHeal(pqxx::transaction_base& outbox,
                               const std::string& subscription);
// Its Text(); "" when none is due (verify's and reconcile's reports).
std::string DueHealText(pqxx::transaction_base& outbox,
                        const std::string& subscription);
// Every due heal, by subscription: one query for a listing.
std::map<std::string, HealDue> DueHeals(pqxx::transaction_base& outbox);

const std::vector<Migration>& OutboxMigrations();
const std::vector<Migration>& InboxMigrations();

inline Schema OutboxSchema() { return {"outbox", &OutboxMigrations()}; }
inline Schema InboxSchema() { return {"inbox", &InboxMigrations()}; }

}  // namespace outbox
