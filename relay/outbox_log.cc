#include "relay/outbox_log.h"

#include <algorithm>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/db.h"
#include "common/ids.h"
#include "relay/delivery_store.h"
#include "relay/outbox_row.h"

namespace outbox::relay {

namespace {

constexpr char kTickColumns[] =
    "id, snapshot::text AS snapshot, high_seq, extract(epoch FROM "
    "clock_timestamp() - made_at)::float8 AS age";

absl::StatusOr<Tick> TickFromRow(const pqxx::row& row) {
  Tick t;
  t.id = row["id"].as<int64_t>();
  t.high_seq = row["high_seq"].as<int64_t>();
  t.age = absl::Seconds(row["age"].as<double>());
  absl::StatusOr<Snapshot> s = Snapshot::Parse(row["snapshot"].c_str());
  if (!s.ok()) return s.status();
  t.snapshot = *std::move(s);
  return t;
}

absl::StatusOr<Tick> OneTick(pqxx::transaction_base& tx, const std::string& sql,
                             int64_t id) {
  try {
    pqxx::result r = id == 0 ? tx.exec(sql) : tx.exec_params(sql, id);
    if (r.empty()) {
      return absl::NotFoundError(absl::StrCat("no tick ", id));
    }
    return TickFromRow(r[0]);
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

// The events of range (from, to] after $1. The late ones (seq at most
// from's high_seq, so committed after `from` although their seq was drawn
// before it) are found by xid: their transaction was running at `from` (in
// its xip) or had no xid yet (at least its xmax). The rest lie above from's
// high_seq, found by the primary key. Every part keeps only what `to`
// shows and `from` does not, and the whole is cut by a payload budget. The
// snapshots and bounds are parameters, never joined from outbox_ticks:
// joined, they could not bound an index scan.
//   $1 after_seq  $2 from.high_seq  $3 to.high_seq  $4 from's snapshot
//   $5 to's snapshot  $6 limit; with `late` $7 from's xip  $8 from's xmax
//   $9 to's xmax  $10 from's xmin; with `by_partition` then the
//   partitions; last the payload budget.
std::string ReadSql(bool late, bool by_partition) {
  int last = late ? 10 : 6;
  const std::string partitions =
      by_partition ? absl::StrCat(" AND o.partition = ANY($", ++last, "::int[])")
                   : "";
  const std::string budget = absl::StrCat("$", ++last, "::bigint");
  const std::string select =
      absl::StrCat("SELECT ", kEventColumns,
                   ", o.partition AS log_partition, o.xid::text AS log_xid "
                   "FROM outbox o WHERE ");
  const std::string in_range = absl::StrCat(
      " AND pg_visible_in_snapshot(o.xid, $5::pg_snapshot)"
      " AND NOT pg_visible_in_snapshot(o.xid, $4::pg_snapshot)",
      partitions);
  const std::string rest =
      absl::StrCat("(", select,
                   "o.seq > greatest($1::bigint, $2::bigint) AND o.seq <= "
                   "$3::bigint",
                   in_range, " ORDER BY o.seq LIMIT $6::int)");
  if (!late) return BoundedByPayloadBytes(rest, budget);
  // Two arms, each bounded on the (xid, seq) index: transactions in from's
  // xip, and those that got their xid after it. No ORDER BY in them: asked
  // for seq order, the planner would walk the primary key through the
  // whole history below from's high_seq. Their seq bounds are written so
  // that the primary key cannot serve them (`seq + 0`): the statement is
  // prepared, and a generic plan made while the outbox was nearly empty
  // chose a bitmap scan of the primary key on them, which reads every
  // event from after_seq (0 when a range starts) to from's high_seq.
  const std::string seq_bounds =
      " AND o.seq + 0 > $1::bigint AND o.seq + 0 <= $2::bigint";
  const std::string running = absl::StrCat(
      "(", select,
      "o.xid >= $10::xid8 AND o.xid < $8::xid8 AND o.xid = ANY($7::xid8[])",
      seq_bounds, in_range, ")");
  const std::string unassigned =
      absl::StrCat("(", select, "o.xid >= $8::xid8 AND o.xid < $9::xid8",
                   seq_bounds, in_range, ")");
  return BoundedByPayloadBytes(
      absl::StrCat("SELECT * FROM (", running, " UNION ALL ", unassigned,
                   " UNION ALL ", rest, ") u ORDER BY seq LIMIT $6::int"),
      budget);
}

// The read's four forms: their statement names, and their text.
struct ReadStatement {
  const char* name;
  std::string sql;
};

const ReadStatement& ReadStatementFor(bool late, bool by_partition) {
  static const ReadStatement* const kForms[4] = {
      new ReadStatement{"log_read", ReadSql(false, false)},
      new ReadStatement{"log_read_parts", ReadSql(false, true)},
      new ReadStatement{"log_read_late", ReadSql(true, false)},
      new ReadStatement{"log_read_late_parts", ReadSql(true, true)}};
  return *kForms[(late ? 2 : 0) + (by_partition ? 1 : 0)];
}

}  // namespace

absl::StatusOr<Snapshot> Snapshot::Parse(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  Snapshot s;
  const auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("not a pg_snapshot: \"", text, "\""));
  };
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &s.xmin) ||
      !absl::SimpleAtoi(parts[1], &s.xmax) || s.xmin > s.xmax) {
    return bad();
  }
  if (!parts[2].empty()) {
    for (absl::string_view x : absl::StrSplit(parts[2], ',')) {
      uint64_t xid = 0;
      if (!absl::SimpleAtoi(x, &xid) || xid < s.xmin || xid >= s.xmax ||
          (!s.xip.empty() && xid <= s.xip.back())) {
        return bad();
      }
      s.xip.push_back(xid);
    }
  }
  return s;
}

std::string Snapshot::ToString() const {
  return absl::StrCat(xmin, ":", xmax, ":", absl::StrJoin(xip, ","));
}

bool Snapshot::Shows(uint64_t xid) const {
  if (xid < xmin) return true;
  if (xid >= xmax) return false;
  return !std::binary_search(xip.begin(), xip.end(), xid);
}

absl::StatusOr<Tick> MakeTick(pqxx::transaction_base& tx) {
  static const std::string kSql =
      absl::StrCat("SELECT ", kTickColumns, " FROM outbox_tick()");
  return OneTick(tx, kSql, 0);
}

namespace {

double MinAgeSeconds(absl::Duration min_age) {
  // Any age: 30 years (more would take now() - min_age out of the
  // timestamp range).
  constexpr double kAnyAge = 30.0 * 365 * 24 * 3600;
  return std::min(absl::ToDoubleSeconds(min_age), kAnyAge);
}

}  // namespace

absl::StatusOr<TickAndExceptions> TickSince(
    pqxx::transaction_base& tx, absl::Duration min_age,
    const std::string& subscription, const std::vector<int>& partitions) {
  static const std::string kSql = absl::StrCat(
      "SELECT ", kTickColumns,
      ", EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.subscription = $2 "
      "AND d.partition = ANY($3::int[])) AS exceptions, made_at = now() AS "
      "made FROM outbox_tick_since(make_interval(secs => $1::float8))");
  try {
    pqxx::result r =
        ExecPrepared(tx, "log_tick_since", kSql.c_str(), MinAgeSeconds(min_age),
                     subscription, ArrayLiteral(partitions).str());
    absl::StatusOr<Tick> t = TickFromRow(r[0]);
    if (!t.ok()) return t.status();
    return TickAndExceptions{.tick = *std::move(t),
                             .made = r[0]["made"].as<bool>(),
                             .exceptions = r[0]["exceptions"].as<bool>()};
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

absl::StatusOr<Tick> ReadTick(pqxx::transaction_base& tx, int64_t id) {
  static const std::string kSql =
      absl::StrCat("SELECT ", kTickColumns, " FROM outbox_ticks WHERE id = $1");
  if (id <= 0) return absl::NotFoundError(absl::StrCat("no tick ", id));
  return OneTick(tx, kSql, id);
}

absl::StatusOr<Tick> LatestTick(pqxx::transaction_base& tx) {
  static const std::string kSql = absl::StrCat(
      "SELECT ", kTickColumns, " FROM outbox_ticks ORDER BY id DESC LIMIT 1");
  return OneTick(tx, kSql, 0);
}

absl::StatusOr<LogBatch> ReadLog(pqxx::transaction_base& tx,
                                 const LogRead& read) {
  if (read.from.id >= read.to.id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "log range (", read.from.id, ", ", read.to.id, "] is empty"));
  }
  if (read.limit < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("log read limit ", read.limit, " is below 1"));
  }
  const bool late = read.after_seq < read.from.high_seq;
  const bool by_partition = !read.partitions.empty();
  const ReadStatement& statement = ReadStatementFor(late, by_partition);
  LogBatch batch;
  batch.last_seq = read.after_seq;
  try {
    std::vector<std::string> params = {
        absl::StrCat(read.after_seq),   absl::StrCat(read.from.high_seq),
        absl::StrCat(read.to.high_seq), read.from.snapshot.ToString(),
        read.to.snapshot.ToString(),    absl::StrCat(read.limit)};
    if (late) {
      ArrayLiteral xip;
      for (uint64_t xid : read.from.snapshot.xip) {
        xip.Add(static_cast<int64_t>(xid));  // xid8 stays below 2^63
      }
      params.push_back(xip.str());
      params.push_back(absl::StrCat(read.from.snapshot.xmax));
      params.push_back(absl::StrCat(read.to.snapshot.xmax));
      params.push_back(absl::StrCat(read.from.snapshot.xmin));
    }
    if (by_partition) params.push_back(ArrayLiteral(read.partitions).str());
    params.push_back(absl::StrCat(std::max<int64_t>(read.payload_budget, 1)));
    // Prepared: planning was most of an unnamed read's time, and every
    // arm is bounded by its index whatever the parameters (ReadSql).
    pqxx::result r =
        ExecPrepared(tx, statement.name, statement.sql.c_str(),
                     pqxx::prepare::make_dynamic_params(params));
    int64_t uncut = 0;
    batch.events.reserve(r.size());
    for (const pqxx::row& row : r) {
      LogEvent e;
      e.payload_ok = EventFromRow(row, &e.event);
      e.partition = row["log_partition"].as<int>();
      if (!absl::SimpleAtoi(row["log_xid"].c_str(), &e.xid)) {
        return absl::InternalError(
            absl::StrCat("event ", e.event.seq(), ": bad xid"));
      }
      uncut = row["rows_uncut"].as<int64_t>();
      batch.last_seq = e.event.seq();
      batch.events.push_back(std::move(e));
    }
    batch.range_done = uncut < read.limit &&
                       static_cast<int64_t>(batch.events.size()) == uncut;
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  return batch;
}

absl::StatusOr<LogPosition> ReadPosition(pqxx::transaction_base& tx,
                                         const std::string& subscription,
                                         int partition) {
  // Made at the start tick if missing, then read.
  static const std::string kMakeSql =
      "INSERT INTO outbox_log_positions (subscription, partition, done_tick) "
      "SELECT name, $2, start_tick FROM subscriptions WHERE name = $1 AND "
      "start_tick IS NOT NULL ON CONFLICT DO NOTHING";
  static const std::string kReadSql =
      "SELECT p.done_tick, p.reading_tick, p.after_seq FROM subscriptions s "
      "LEFT JOIN outbox_log_positions p ON p.subscription = s.name AND "
      "p.partition = $2 WHERE s.name = $1";
  try {
    tx.exec_params(kMakeSql, subscription, partition);
    pqxx::result r = tx.exec_params(kReadSql, subscription, partition);
    if (r.empty()) {
      return absl::NotFoundError(
          absl::StrCat("no subscription \"", subscription, "\""));
    }
    const pqxx::row row = r[0];
    if (row["done_tick"].is_null()) return NotOnLogError(subscription);
    LogPosition at;
    at.done = row["done_tick"].as<int64_t>();
    at.reading = row["reading_tick"].as<int64_t>();
    at.after_seq = row["after_seq"].as<int64_t>();
    return at;
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

namespace {
constexpr absl::string_view kNotOnLog = "outbox/subscription-not-on-log";
}  // namespace

absl::Status NotOnLogError(const std::string& subscription) {
  absl::Status s = absl::FailedPreconditionError(
      absl::StrCat("subscription \"", subscription,
                   "\" has no start tick: the log does not deliver to it"));
  s.SetPayload(kNotOnLog, absl::Cord(subscription));
  return s;
}

bool IsNotOnLog(const absl::Status& status) {
  return absl::IsFailedPrecondition(status) &&
         status.GetPayload(kNotOnLog).has_value();
}

absl::StatusOr<bool> MovePosition(pqxx::transaction_base& tx,
                                  const std::string& subscription,
                                  int partition, const std::string& member,
                                  const LogPosition& from,
                                  const LogPosition& to) {
  absl::StatusOr<std::vector<int>> moved =
      MovePositions(tx, subscription, {partition}, member, from, to);
  if (!moved.ok()) return moved.status();
  return !moved->empty();
}

absl::StatusOr<std::vector<int>> MovePositions(
    pqxx::transaction_base& tx, const std::string& subscription,
    const std::vector<int>& partitions, const std::string& member,
    const LogPosition& from, const LogPosition& to) {
  if (!MovesForward(from, to)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "log position of ", subscription, "/", absl::StrJoin(partitions, ","),
        " cannot move from (", from.done, ", ", from.reading, ", ",
        from.after_seq, ") to (", to.done, ", ", to.reading, ", ", to.after_seq,
        ")"));
  }
  static const std::string kSql =
      "UPDATE outbox_log_positions p SET done_tick = $6, reading_tick = $7, "
      "after_seq = $8, moved_at = now() "
      "WHERE p.subscription = $1 AND p.partition = ANY($2::int[]) AND "
      "p.done_tick = $3 AND p.reading_tick = $4 AND p.after_seq = $5 AND "
      "EXISTS (SELECT 1 FROM outbox_partition_leases l WHERE l.subscription = "
      "$1 AND l.partition = p.partition AND l.owner = $9 AND l.expires_at > "
      "now()) RETURNING p.partition";
  std::vector<int> moved;
  try {
    pqxx::result r = ExecPrepared(
        tx, "log_move_positions", kSql.c_str(), subscription,
        ArrayLiteral(partitions).str(), from.done, from.reading,
        from.after_seq, to.done, to.reading, to.after_seq, member);
    for (const pqxx::row& row : r) moved.push_back(row["partition"].as<int>());
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  std::sort(moved.begin(), moved.end());
  return moved;
}

absl::StatusOr<std::set<std::string>> ExceptedChains(
    pqxx::transaction_base& tx, const std::string& subscription,
    const std::vector<int>& partitions) {
  // Exceptions are few (the log delivers everything else): the
  // subscription's rows are read through its primary key prefix.
  static const std::string kSql =
      "SELECT DISTINCT o.aggregate_type, o.aggregate_id FROM outbox_delivery "
      "d JOIN outbox o ON o.seq = d.seq WHERE d.subscription = $1 AND "
      "d.partition = ANY($2::int[])";
  std::set<std::string> chains;
  try {
    pqxx::result r = ExecPrepared(tx, "log_excepted_chains", kSql.c_str(),
                                  subscription, ArrayLiteral(partitions).str());
    for (const pqxx::row& row : r) {
      chains.insert(OutboxChain(row["aggregate_type"].c_str(),
                                row["aggregate_id"].c_str()));
    }
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  return chains;
}

absl::StatusOr<std::map<int, LogOwed>> LogOwedBy(
    pqxx::transaction_base& tx, const std::string& subscription,
    const std::vector<int>& partitions, int64_t cap) {
  static const std::string kSql =
      "SELECT part, events, coalesce(extract(epoch FROM now() - oldest), "
      "0)::float8 AS oldest, lowest FROM outbox_log_owed_by($1, $2::int[], "
      "$3)";
  std::vector<int> which = partitions;
  if (which.empty()) {
    for (int p = 0; p < kPartitionCount; ++p) which.push_back(p);
  }
  std::map<int, LogOwed> out;
  try {
    for (const auto& row :
         tx.exec_params(kSql, subscription, ArrayLiteral(which).str(), cap)) {
      out[row["part"].as<int>()] =
          LogOwed{.events = row["events"].as<int64_t>(),
                  .oldest_seconds = std::max(0.0, row["oldest"].as<double>()),
                  .lowest_seq = row["lowest"].as<int64_t>()};
    }
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  return out;
}

LogOwed LogOwedTotal(const std::map<int, LogOwed>& owed) {
  LogOwed total;
  for (const auto& [partition, o] : owed) {
    total.events += o.events;
    total.oldest_seconds = std::max(total.oldest_seconds, o.oldest_seconds);
    if (total.lowest_seq == 0 || o.lowest_seq < total.lowest_seq) {
      total.lowest_seq = o.lowest_seq;
    }
  }
  return total;
}

absl::StatusOr<int64_t> OweExceptions(pqxx::transaction_base& tx,
                                      const std::string& subscription,
                                      const std::vector<int64_t>& seqs) {
  if (seqs.empty()) return 0;
  static const std::string kSql =
      "INSERT INTO outbox_delivery (subscription, seq, aggregate_id, "
      "partition) SELECT $1, o.seq, o.aggregate_id, o.partition FROM outbox o "
      "WHERE o.seq = ANY($2::bigint[]) ON CONFLICT DO NOTHING";
  try {
    return static_cast<int64_t>(
        tx.exec_params(kSql, subscription, ArrayLiteral(seqs).str())
            .affected_rows());
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

absl::StatusOr<Rebased> RebaseLog(pqxx::transaction_base& tx) {
  // Under outbox_tick()'s lock, so that no tick is made meanwhile. Tick
  // ids keep growing: a relay that read a position before the rebase must
  // not find it unchanged after it.
  static const std::string kBehindSql =
      "SELECT pg_advisory_xact_lock(2833, 0), coalesce((SELECT "
      "pg_snapshot_xmax(pg_current_snapshot()) < pg_snapshot_xmax(snapshot) "
      "FROM outbox_ticks ORDER BY id DESC LIMIT 1), false) AS behind";
  // The subscriptions on the log before their positions, in the order
  // outbox_log_unsubscribe takes them: the other order let a move off the
  // log and a rebase each wait for the other (a deadlock PostgreSQL breaks
  // by failing one).
  static const std::string kLockSql =
      "SELECT name FROM subscriptions WHERE start_tick IS NOT NULL "
      "ORDER BY name FOR UPDATE";
  // The new tick: a snapshot taken now, in a statement of its own once the
  // lock is held, and the highest seq it shows. Everything it shows is
  // owed below unless delivered; everything it does not show, the log
  // reads after it. Taken before the owing, so that an event committing
  // while the owing runs is read from the log, not lost between the two.
  // old_high: the highest seq any tick of the old cluster showed.
  static const std::string kNowSql =
      "SELECT pg_current_snapshot()::text AS snapshot, coalesce((SELECT "
      "max(seq) FROM outbox), 0) AS high, coalesce((SELECT max(high_seq) "
      "FROM outbox_ticks), 0) AS old_high";
  // What the old positions had not delivered, or the old cluster's ticks
  // could not say. An event above every old tick's high seq was shown by
  // none of them: either the old cluster committed it after its last tick
  // (its transaction id lies ahead of this cluster's: committed data, so
  // owed), or this cluster did since the restore (owed if the new tick
  // shows it, else read from the log). Its new transaction id says
  // nothing to the old snapshots: one below their xmin would read as
  // delivered. An event at or below that seq is the old cluster's, judged
  // by the old start tick and positions as before.
  static const std::string kOweSql =
      "WITH owed AS (INSERT INTO outbox_delivery (subscription, seq, "
      "aggregate_id, partition) SELECT s.name, o.seq, o.aggregate_id, "
      "o.partition FROM subscriptions s JOIN outbox_ticks st ON st.id = "
      "s.start_tick CROSS JOIN outbox o WHERE o.seq >= s.start_seq AND "
      "o.xid IS NOT NULL AND CASE WHEN o.seq > $2 THEN "
      "o.xid >= pg_snapshot_xmax(pg_current_snapshot()) OR "
      "pg_visible_in_snapshot(o.xid, $1::pg_snapshot) ELSE "
      "NOT pg_visible_in_snapshot(o.xid, st.snapshot) "
      "AND NOT outbox_log_delivered(s.name, o.seq, o.xid, o.partition) END "
      "ON CONFLICT DO NOTHING RETURNING 1) SELECT count(*) FROM owed";
  // The old cluster's events whose transaction ids lie ahead of this
  // cluster's (every one this statement sees at or above its snapshot's
  // xmax: no id this cluster gave out can be there) lose their ids, as
  // events from before the log have none: the owing above has judged
  // them, and no range of the new log may hold them. Kept, they would
  // count as owed by the log until this cluster's ids passed theirs, and
  // come again then. Every such row is rewritten once, in this
  // transaction.
  static const std::string kForgetSql =
      "UPDATE outbox SET xid = NULL WHERE xid >= "
      "pg_snapshot_xmax(pg_current_snapshot())";
  static const std::string kRestartSql =
      "WITH gone AS (DELETE FROM outbox_ticks RETURNING id), "
      "t AS (INSERT INTO outbox_ticks (id, snapshot, high_seq) SELECT "
      "coalesce((SELECT max(id) FROM gone), 0) + 1, $1::pg_snapshot, $2 "
      "RETURNING id), "
      "p AS (UPDATE outbox_log_positions SET done_tick = (SELECT id FROM t), "
      "reading_tick = 0, after_seq = 0, moved_at = now()), "
      "s AS (UPDATE subscriptions SET start_tick = (SELECT id FROM t) WHERE "
      "start_tick IS NOT NULL) SELECT id FROM t";
  Rebased out;
  try {
    if (!tx.exec(kBehindSql)[0]["behind"].as<bool>()) return out;
    tx.exec(kLockSql);
    const pqxx::row now = tx.exec(kNowSql)[0];
    const std::string snapshot = now["snapshot"].as<std::string>();
    const int64_t high = now["high"].as<int64_t>();
    const int64_t old_high = now["old_high"].as<int64_t>();
    out.owed =
        tx.exec_params(kOweSql, snapshot, old_high)[0][0].as<int64_t>();
    tx.exec(kForgetSql);
    out.tick =
        tx.exec_params(kRestartSql, snapshot, high)[0]["id"].as<int64_t>();
    out.rebased = true;
    return out;
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

absl::StatusOr<int64_t> PruneTicks(pqxx::transaction_base& tx) {
  // A subscription's start tick is needed while one of its partitions has
  // no position yet; positions of a dropped subscription need nothing
  // (outbox_log_floor).
  static const std::string kSql =
      "DELETE FROM outbox_ticks WHERE id < least("
      "(SELECT max(id) FROM outbox_ticks), outbox_log_floor($1))";
  try {
    return static_cast<int64_t>(
        tx.exec_params(kSql, kPartitionCount).affected_rows());
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

}  // namespace outbox::relay
