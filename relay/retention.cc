#include "relay/retention.h"

#include <optional>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/db_identity.h"
#include "common/ids.h"
#include "common/schema.h"

namespace outbox::relay {

namespace {

// Retention's advisory lock: PruneOutbox takes it exclusive, those who owe
// events again take it shared (HoldRetentionBack).
constexpr int kRetentionLockKey = 2834;

std::string RetentionLock(bool shared) {
  return absl::StrCat("SELECT pg_advisory_xact_lock", shared ? "_shared" : "",
                      "(", kRetentionLockKey, ", 0)");
}

// What the row delete and rotation share, as SQL. `p`: a parameter's
// number.
//
// The CTE f: the oldest tick the log's subscriptions need (none when the
// log delivers to none) and its snapshot; the partition count is $p.
std::string FloorCte(int p) {
  return absl::StrCat(
      "f AS (SELECT fl, (SELECT t.snapshot FROM outbox_ticks t WHERE t.id = "
      "fl) AS snap FROM outbox_log_floor($",
      p, ") fl)");
}

// Whether an event (columns created_at and xid, after `alias`) must stay,
// with f in scope: younger than the retention ($p, seconds), or not shown
// by f's tick (every event written since the log began, if the tick is
// missing). Events from before the log have no xid.
std::string MustStay(const std::string& alias, int p) {
  return absl::StrCat(alias, "created_at >= now() - make_interval(secs => $", p,
                      "::float8) OR ((SELECT fl FROM f) IS NOT NULL AND ",
                      alias, "xid IS NOT NULL AND NOT coalesce(",
                      "pg_visible_in_snapshot(", alias,
                      "xid, (SELECT snap FROM f)), false))");
}

// The CTEs that fold the marks up to the horizon $p into one, of no open
// transaction, which holds what they showed.
std::string FoldMarksCtes(int p) {
  return absl::StrCat(
      "old AS (DELETE FROM outbox_retention_marks WHERE last_seq <= $", p,
      "), kept AS (INSERT INTO outbox_retention_marks (last_seq, "
      "open_xacts) VALUES ($",
      p, ", '{}'))");
}

// The oldest child of a partitioned outbox: its name and upper bound
// (exclusive), as the catalog gives them.
constexpr char kOldestChildSql[] =
    "SELECT child, hi FROM (SELECT c.oid::regclass::text AS child, "
    "(regexp_match(pg_get_expr(c.relpartbound, c.oid), "
    "'TO \\(''?(-?[0-9]+)''?\\)'))[1]::bigint AS hi FROM pg_inherits i "
    "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = "
    "'outbox'::regclass) k ORDER BY hi LIMIT 1";

// PruneOutbox on a partitioned outbox: drops its oldest child, whole,
// once every event in it may go (by the same rules as a row's delete) and
// every seq below its bound is at or below the horizon `below` (so no
// transaction that may still commit holds one, and no writer draws one
// any more). Returns the events it held. One child a call: the drop holds
// the parent alone (ACCESS EXCLUSIVE) until the commit, so nothing else
// (the next child's scan) runs under it. It waits 100 ms at most for the
// reads and writes in progress, since those that come meanwhile queue
// behind it, and tries again at the next step. An empty child kept would
// still cost every read with a generic plan a lock, so none is kept.
int64_t RotateOutbox(pqxx::transaction_base& tx, absl::Duration retention,
                     int64_t below, std::string* held_back,
                     bool* dropped_child) {
  const pqxx::result oldest = tx.exec(kOldestChildSql);
  if (oldest.empty()) return 0;
  const std::string child = oldest[0]["child"].as<std::string>();
  const int64_t hi = oldest[0]["hi"].as<int64_t>();
  // Seqs up to the bound all drawn by transactions that ended; none of
  // them owed by a delivery row; the newest row old enough (a cheap first
  // look before reading the whole child).
  const pqxx::row ready = tx.exec_params1(
      absl::StrCat("SELECT $1::bigint - 1 <= $2::bigint AND NOT EXISTS "
                   "(SELECT 1 FROM subscriptions s WHERE EXISTS (SELECT 1 "
                   "FROM outbox_delivery d WHERE d.subscription = s.name "
                   "AND d.seq < $1)) AND coalesce((SELECT o.created_at < "
                   "now() - make_interval(secs => $3::float8) FROM ",
                   child, " o ORDER BY o.seq DESC LIMIT 1), true)"),
      hi, below, absl::ToDoubleSeconds(retention));
  if (!ready[0].as<bool>()) return 0;
  // Every event old enough, and shown by the oldest tick the log's
  // subscriptions need.
  const pqxx::row rows = tx.exec_params1(
      absl::StrCat("WITH ", FloorCte(2),
                   " SELECT count(*) AS n, count(*) FILTER (WHERE ",
                   MustStay("o.", 1), ") AS young FROM ", child, " o"),
      absl::ToDoubleSeconds(retention), kPartitionCount);
  if (rows["young"].as<int64_t>() > 0) return 0;
  try {
    auto* outer = dynamic_cast<pqxx::dbtransaction*>(&tx);
    if (outer == nullptr) {
      throw std::logic_error("rotation needs a transaction");
    }
    pqxx::subtransaction lock(*outer, "rotate");
    lock.exec("SET LOCAL lock_timeout = '100ms'");
    lock.exec("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE");
    lock.commit();
  } catch (const pqxx::sql_error& e) {
    if (e.sqlstate() != "55P03") throw;
    if (held_back != nullptr) {
      *held_back = absl::StrCat(
          "reads or writes of the outbox in progress while rotation waited "
          "100 ms to drop its oldest child, ",
          child);
    }
    return 0;
  }
  tx.exec(absl::StrCat("DROP TABLE ", child));
  if (dropped_child != nullptr) *dropped_child = true;
  static const std::string kDroppedSql =
      absl::StrCat("WITH ", FoldMarksCtes(1),
                   " UPDATE outbox_retention_state SET deleted_through = "
                   "greatest(deleted_through, $2) WHERE id = 1");
  tx.exec_params(kDroppedSql, below, hi - 1);
  return rows["n"].as<int64_t>();
}

}  // namespace

void HoldRetentionBack(pqxx::transaction_base& tx) {
  tx.exec(RetentionLock(/*shared=*/true));
}

int64_t PruneOutbox(pqxx::transaction_base& tx, absl::Duration retention,
                    int limit, std::string* held_back, bool* dropped_child) {
  if (held_back != nullptr) held_back->clear();
  if (dropped_child != nullptr) *dropped_child = false;
  // Operators' replays and heals owe events again (ReOwe, Replay) under
  // this lock shared: taken exclusive in a statement of its own, before
  // the delete, whose snapshot then shows every delivery row they owed.
  // Without it a replay's rows, not yet committed, would not hold back the
  // delete of the events they point at. The same statement reads how far
  // the sequence has been drawn.
  const pqxx::row first = tx.exec1(absl::StrCat(
      RetentionLock(/*shared=*/false),
      ", current_setting('transaction_isolation') AS isolation, (SELECT CASE "
      "WHEN is_called THEN last_value ELSE last_value - 1 END FROM "
      "outbox_seq_seq) AS drawn, EXISTS (SELECT 1 FROM outbox_rotation) AS "
      "partitioned"));
  if (first["isolation"].as<std::string>() != "read committed") {
    // Each statement must see what committed before it: the horizon below
    // is read in one, and holds for the delete only if the delete's
    // snapshot is newer.
    throw std::logic_error(
        absl::StrCat("retention needs a READ COMMITTED transaction, not ",
                     first["isolation"].as<std::string>()));
  }
  // A failover or a restore that no binary has recorded yet is recorded
  // now, which requests every subscription's heal (the trigger
  // outbox_identity_changed): the check below then holds this delete back.
  const DatabaseIdentity now = ReadIdentity(tx);
  const std::optional<DatabaseIdentity> recorded = RecordedIdentity(tx);
  if (recorded.has_value() && *recorded != now) RecordIdentity(tx, now);
  // Nothing goes while a heal is due: after a failover or a restore of
  // the outbox's database, the heal tells a lost applied event (its seq
  // at or above what retention deleted) from a deleted one, and after one
  // of the consumer's, it owes again from the outbox what the consumer
  // lost. Deleting first would hide the one and make the other
  // lost_beyond_retention. Read after the lock: a heal requested later
  // finds this delete's record (outbox_retention_state).
  static const std::string kHealSql = absl::StrCat(
      "SELECT h.name, h.reason, coalesce((SELECT o.created_at < now() - "
      "make_interval(secs => $2::float8) FROM outbox o ORDER BY o.seq LIMIT "
      "1), false) AS due FROM (",
      kHealDueSql, ") h ORDER BY h.age_s DESC LIMIT 1");
  const pqxx::result heal =
      tx.exec_params(kHealSql, "", absl::ToDoubleSeconds(retention));
  if (!heal.empty()) {
    if (held_back != nullptr && heal[0]["due"].as<bool>()) {
      *held_back = absl::StrCat("the heal of subscription ",
                                heal[0]["name"].as<std::string>(),
                                ", due: ", heal[0]["reason"].as<std::string>(),
                                " (a relay delivering to it runs it)");
    }
    return 0;
  }
  // The horizon: a seq no transaction that may still commit holds below.
  // A transaction's seq is drawn while it is open, so every seq up to
  // `drawn` belongs to one that had ended by now or is open now: the mark
  // records those open (by virtual transaction id, which a transaction has
  // before it writes and even without an xid) and becomes the horizon
  // once none of them is open any more (nor prepared: a prepared
  // transaction drops its virtual id). Left out: a transaction idle after
  // an error, and one idle that has written nothing (no xid), since the
  // writer draws a seq and writes its event in one statement; a session
  // whose state this role may not see counts as open. Marks are read a
  // statement before the delete, so the delete's snapshot shows the rows
  // of every transaction that ended. Without it, an event deleted above a
  // transaction that commits later would leave what is gone no prefix of
  // the outbox. A mark at most every 50 ms, 64 at most (a transaction open
  // for long makes each one wait): the horizon lags the sequence by a
  // mark's age.
  static const std::string kHorizonSql =
      "WITH taken AS (INSERT INTO outbox_retention_marks (last_seq, "
      "open_xacts) SELECT $1, coalesce((SELECT array_agg(l.virtualxid) FROM "
      "pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE "
      "l.locktype = 'virtualxid' AND l.granted AND l.virtualxid = "
      "l.virtualtransaction AND a.datname = current_database() AND l.pid <> "
      "pg_backend_pid() AND NOT coalesce(a.state = 'idle in transaction "
      "(aborted)' OR (a.state = 'idle in transaction' AND a.backend_xid IS "
      "NULL), false)), '{}') WHERE NOT EXISTS (SELECT 1 FROM "
      "outbox_retention_marks WHERE taken_at > clock_timestamp() - interval "
      "'50 milliseconds') AND (SELECT count(*) FROM outbox_retention_marks) < "
      "64 RETURNING last_seq, open_xacts), "
      "h AS (SELECT max(m.last_seq) AS horizon FROM (SELECT last_seq, "
      "open_xacts FROM outbox_retention_marks UNION ALL SELECT * FROM taken) "
      "m WHERE (cardinality(m.open_xacts) = 0 OR NOT EXISTS (SELECT 1 FROM "
      "pg_locks l WHERE l.locktype = 'virtualxid' AND l.virtualxid = "
      "ANY(m.open_xacts))) AND NOT EXISTS "
      "(SELECT 1 FROM pg_prepared_xacts p WHERE p.database = "
      "current_database())) "
      // Held back: the first event above the horizon is old enough.
      "SELECT horizon, coalesce((SELECT o.created_at < now() - "
      "make_interval(secs => $2::float8) FROM outbox o WHERE o.seq > "
      "coalesce(h.horizon, 0) ORDER BY o.seq LIMIT 1), false) AS held FROM h";
  const pqxx::row horizon =
      tx.exec_params1(kHorizonSql, first["drawn"].as<int64_t>(),
                      absl::ToDoubleSeconds(retention));
  if (held_back != nullptr && horizon["held"].as<bool>()) {
    *held_back =
        "a transaction of the outbox's database that may still commit below "
        "events old enough to go (a session idle in a transaction after "
        "writing, or a prepared transaction: pg_stat_activity, "
        "pg_prepared_xacts)";
  }
  if (horizon["horizon"].is_null()) return 0;
  const int64_t below = horizon["horizon"].as<int64_t>();
  if (first["partitioned"].as<bool>()) {
    return RotateOutbox(tx, retention, below, held_back, dropped_child);
  }
  // The first event that must stay (MustStay) stops the prefix; events
  // from before the log have no xid and are judged by their delivery rows
  // alone. The marks up to the horizon are folded into one;
  // outbox_retention_state records the newest seq deleted.
  static const std::string kSql = absl::StrCat(
      "WITH ", FloorCte(3), ", ",
      "c AS (SELECT seq, created_at, xid FROM outbox WHERE seq <= $4 AND seq "
      "< coalesce((SELECT min((SELECT min(d.seq) FROM outbox_delivery d "
      "WHERE d.subscription = s.name)) FROM subscriptions s), "
      "9223372036854775807) ORDER BY seq LIMIT $2), ",
      FoldMarksCtes(4), ", ",
      "d AS (DELETE FROM outbox WHERE seq IN (SELECT seq FROM c WHERE seq < "
      "coalesce((SELECT min(seq) FROM c WHERE ",
      MustStay("", 1),
      "), 9223372036854775807)) RETURNING seq), "
      "u AS (UPDATE outbox_retention_state SET deleted_through = "
      "greatest(deleted_through, (SELECT max(seq) FROM d)) WHERE id = 1 AND "
      "EXISTS (SELECT 1 FROM d)) "
      "SELECT count(*) FROM d");
  return tx
      .exec_params1(kSql, absl::ToDoubleSeconds(retention), limit,
                    kPartitionCount, below)[0]
      .as<int64_t>();
}

}  // namespace outbox::relay
