#include "relay/delivery_store.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <pqxx/pqxx>

#include "absl/strings/str_cat.h"
#include "common/db.h"
#include "common/ids.h"
#include "common/limits.h"
#include "common/schema.h"
#include "common/text.h"
#include "relay/leases.h"
#include "relay/outbox_row.h"
#include "relay/retention.h"

namespace outbox::relay {
namespace {

// The chain walk of ReOwe: $2-$5 the ranges (aggregate type, "" for any,
// and id, after, through).
// Each range's events are found from `through` back along prev_seq; the
// walk stops at `after`, or where the outbox no longer holds the next
// predecessor (a gap, reported when that predecessor was owed).
constexpr char kReOweSql[] = R"sql(
WITH RECURSIVE r AS (
  SELECT * FROM unnest($2::text[], $3::text[], $4::bigint[], $5::bigint[])
      AS r(t, a, lo, hi)
  WHERE hi > lo),
s AS (SELECT start_seq, chain_from FROM subscriptions WHERE name = $1),
chain AS (
  SELECT o.seq, o.prev_seq, o.aggregate_type, o.aggregate_id, o.partition,
         r.lo
    FROM r JOIN outbox o ON o.seq = r.hi AND o.aggregate_id = r.a
                         AND (r.t = '' OR o.aggregate_type = r.t)
  UNION ALL
  SELECT o.seq, o.prev_seq, o.aggregate_type, o.aggregate_id, o.partition,
         c.lo
    FROM chain c JOIN outbox o ON o.seq = c.prev_seq
   WHERE c.prev_seq > c.lo),
ins AS (
  INSERT INTO outbox_delivery (subscription, seq, aggregate_id, partition)
  SELECT $1, c.seq, c.aggregate_id, c.partition FROM chain c, s
   WHERE c.seq > c.lo AND c.seq >= s.start_seq
  ON CONFLICT DO NOTHING RETURNING 1)
SELECT 'owed' AS what, '' AS aggregate_type, '' AS aggregate_id,
       count(*) AS n FROM ins
UNION ALL
SELECT 'gap', c.aggregate_type, c.aggregate_id, c.prev_seq FROM chain c, s
 WHERE c.prev_seq > c.lo AND c.prev_seq >= greatest(s.chain_from, s.start_seq)
   AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.seq = c.prev_seq)
UNION ALL
SELECT 'gap', r.t, r.a, r.hi FROM r, s
 WHERE r.hi >= greatest(s.chain_from, s.start_seq)
   AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.seq = r.hi)
)sql";

// The columns of a divergence, by name in DivergenceFromRow.
constexpr char kDivergenceColumns[] =
    "id, subscription::text AS subscription, aggregate_id::text AS "
    "aggregate_id, aggregate_type::text AS aggregate_type, kind, detail, "
    "(extract(epoch FROM detected_at) * 1000000)::bigint AS detected_us, "
    "coalesce(consumer_seq, 0) AS consumer_seq, "
    "coalesce(consumer_event_id::text, '') AS consumer_event_id, "
    "coalesce(outbox_seq, 0) AS outbox_seq, "
    "coalesce(outbox_event_id::text, '') AS outbox_event_id, "
    "coalesce((extract(epoch FROM resolved_at) * 1000000)::bigint, 0) AS "
    "resolved_us, coalesce(resolved_by, '') AS resolved_by, "
    "coalesce(resolution, '') AS resolution";

v1::Divergence DivergenceFromRow(const pqxx::row& row) {
  v1::Divergence d;
  d.set_id(row["id"].as<int64_t>());
  d.set_subscription(row["subscription"].as<std::string>());
  d.set_aggregate_id(row["aggregate_id"].as<std::string>());
  d.set_aggregate_type(row["aggregate_type"].as<std::string>());
  d.set_kind(row["kind"].as<std::string>());
  d.set_detail(row["detail"].as<std::string>());
  ToTimestamp(absl::FromUnixMicros(row["detected_us"].as<int64_t>()),
              d.mutable_detected_at());
  d.set_consumer_seq(row["consumer_seq"].as<int64_t>());
  d.set_consumer_event_id(row["consumer_event_id"].as<std::string>());
  d.set_outbox_seq(row["outbox_seq"].as<int64_t>());
  d.set_outbox_event_id(row["outbox_event_id"].as<std::string>());
  if (int64_t us = row["resolved_us"].as<int64_t>(); us != 0) {
    ToTimestamp(absl::FromUnixMicros(us), d.mutable_resolved_at());
  }
  d.set_resolved_by(row["resolved_by"].as<std::string>());
  d.set_resolution(row["resolution"].as<std::string>());
  return d;
}

}  // namespace

ReOwed ReOwe(pqxx::transaction_base& tx, const std::string& subscription,
             const std::vector<ChainRange>& ranges) {
  ReOwed out;
  if (ranges.empty()) return out;
  HoldRetentionBack(tx);
  ArrayLiteral types, ids, los, his;
  for (const ChainRange& r : ranges) {
    ChainId c;
    ParseChainKey(r.chain, &c);
    types.Add(c.type);
    ids.Add(c.id);
    los.Add(r.after);
    his.Add(r.through);
  }
  for (const auto& row : tx.exec_params(kReOweSql, subscription, types.str(),
                                        ids.str(), los.str(), his.str())) {
    if (row["what"].as<std::string>() == "owed") {
      out.owed += row["n"].as<int64_t>();
    } else {
      out.gaps.emplace_back(OutboxChain(row["aggregate_type"].as<std::string>(),
                                        row["aggregate_id"].as<std::string>()),
                            row["n"].as<int64_t>());
    }
  }
  if (out.owed > 0) {
    tx.exec_params("SELECT pg_notify($1, '')", kNotifyChannel);
  }
  return out;
}

std::vector<std::pair<int64_t, std::string>> ChainOf(
    pqxx::transaction_base& tx, const std::string& aggregate_type,
    const std::string& aggregate_id) {
  std::vector<std::pair<int64_t, std::string>> chain;
  for (const auto& row : tx.exec_params(
           "WITH RECURSIVE chain AS (SELECT o.seq, o.prev_seq, o.event_id "
           "FROM outbox_heads h JOIN outbox o ON o.seq = h.last_seq AND "
           "o.aggregate_type = h.aggregate_type AND o.aggregate_id = "
           "h.aggregate_id WHERE h.aggregate_id = $1 AND ($2 = '' OR "
           "h.aggregate_type = $2) "
           "UNION ALL SELECT o.seq, o.prev_seq, o.event_id FROM chain c JOIN "
           "outbox o ON o.seq = c.prev_seq WHERE c.prev_seq > 0) "
           "SELECT DISTINCT seq, event_id::text FROM chain ORDER BY seq",
           aggregate_id, aggregate_type)) {
    chain.emplace_back(row["seq"].as<int64_t>(),
                       row["event_id"].as<std::string>());
  }
  return chain;
}

int64_t DeletedThrough(
    pqxx::transaction_base& tx, const std::string& aggregate_type,
    const std::string& aggregate_id,
    const std::vector<std::pair<int64_t, std::string>>& chain) {
  if (chain.empty()) {
    return tx
        .exec_params1(
            "SELECT coalesce(max(last_seq), 0) FROM outbox_heads WHERE "
            "aggregate_id = $1 AND ($2 = '' OR aggregate_type = $2)",
            aggregate_id, aggregate_type)[0]
        .as<int64_t>();
  }
  const pqxx::result r = tx.exec_params(
      "SELECT prev_seq FROM outbox WHERE seq = $1", chain.front().first);
  // Gone since ChainOf read it: retention deleted that one too.
  return r.empty() ? chain.front().first : r[0][0].as<int64_t>();
}

Replayed Replay(pqxx::transaction_base& tx, const std::string& subscription,
                const ReplaySelector& sel) {
  HoldRetentionBack(tx);
  std::string matching;
  pqxx::result r;
  const char* kTail =
      "), i AS (INSERT INTO outbox_delivery (subscription, seq, "
      "aggregate_id, partition) SELECT $1, seq, aggregate_id, partition FROM "
      "m ON CONFLICT DO NOTHING RETURNING 1) SELECT (SELECT count(*) FROM "
      "m) AS matched, (SELECT count(*) FROM i) AS owed";
  const char* kHead =
      "WITH s AS (SELECT start_seq FROM subscriptions WHERE name = $1), m AS "
      "(SELECT o.seq, o.aggregate_id, o.partition FROM outbox o, s WHERE "
      "o.seq >= s.start_seq AND ";
  if (!sel.event_id.empty()) {
    r = tx.exec_params(absl::StrCat(kHead, "o.event_id = $2::uuid", kTail),
                       subscription, sel.event_id);
  } else if (!sel.aggregate_id.empty()) {
    ArrayLiteral seqs;
    for (const auto& [seq, id] :
         ChainOf(tx, sel.aggregate_type, sel.aggregate_id)) {
      seqs.Add(seq);
    }
    r = tx.exec_params(absl::StrCat(kHead, "o.seq = ANY($2::bigint[])", kTail),
                       subscription, seqs.str());
  } else if (sel.by_seq) {
    r = tx.exec_params(absl::StrCat(kHead,
                                    "o.seq >= $2 AND ($3::bigint = 0 OR "
                                    "o.seq <= $3)",
                                    kTail),
                       subscription, sel.from_seq, sel.to_seq);
  } else {
    r = tx.exec_params(
        absl::StrCat(kHead,
                     "o.created_at >= to_timestamp($2::float8) AND "
                     "o.created_at < to_timestamp($3::float8)",
                     kTail),
        subscription,
        sel.since == absl::InfinitePast() ? -1e12
                                          : absl::ToUnixMicros(sel.since) / 1e6,
        sel.until == absl::InfiniteFuture()
            ? 1e12
            : absl::ToUnixMicros(sel.until) / 1e6);
  }
  Replayed out;
  out.matched = r[0]["matched"].as<int64_t>();
  out.owed = r[0]["owed"].as<int64_t>();
  if (out.owed > 0) {
    tx.exec_params("SELECT pg_notify($1, '')", kNotifyChannel);
  }
  return out;
}

bool RecordDivergence(pqxx::transaction_base& tx, const NewDivergence& d) {
  return RecordDivergences(tx, {d})[0];
}

std::vector<bool> RecordDivergences(pqxx::transaction_base& tx,
                                    const std::vector<NewDivergence>& ds) {
  std::vector<bool> recorded(ds.size(), false);
  if (ds.empty()) return recorded;
  ArrayLiteral subs, types, ids, kinds, details, cseqs, cevents, oseqs, oevents,
      ords;
  for (size_t i = 0; i < ds.size(); ++i) {
    const NewDivergence& d = ds[i];
    subs.Add(d.subscription);
    types.Add(d.aggregate_type);
    ids.Add(d.aggregate_id);
    kinds.Add(d.kind);
    details.Add(StorableText(d.detail, 2000));
    cseqs.Add(d.consumer_seq);
    cevents.Add(d.consumer_event_id);
    oseqs.Add(d.outbox_seq);
    oevents.Add(d.outbox_event_id);
    ords.Add(static_cast<int64_t>(i));
  }
  // In the given order, so that of two for one chain the first is kept;
  // the ordinal comes back to say which were.
  for (const auto& row : tx.exec_params(
           "WITH n AS (SELECT * FROM unnest($1::text[], $2::text[], "
           "$3::text[], $4::text[], $5::text[], $6::bigint[], $7::text[], "
           "$8::bigint[], $9::text[], $10::bigint[]) AS n(s, t, a, k, d, cs, "
           "ce, os, oe, i)), "
           "ins AS (INSERT INTO outbox_divergences (subscription, "
           "aggregate_type, aggregate_id, kind, detail, consumer_seq, "
           "consumer_event_id, outbox_seq, outbox_event_id) SELECT s, t, a, "
           "k, d, nullif(cs, 0), nullif(ce, '')::uuid, nullif(os, 0), "
           "nullif(oe, '')::uuid FROM n ORDER BY i ON CONFLICT (subscription, "
           "aggregate_type, aggregate_id) WHERE resolved_at IS NULL DO "
           "NOTHING RETURNING subscription, aggregate_type, aggregate_id) "
           "SELECT min(n.i) FROM ins JOIN n ON n.s = ins.subscription AND "
           "n.t = ins.aggregate_type AND n.a = ins.aggregate_id "
           "GROUP BY ins.subscription, ins.aggregate_type, ins.aggregate_id",
           subs.str(), types.str(), ids.str(), kinds.str(), details.str(),
           cseqs.str(), cevents.str(), oseqs.str(), oevents.str(),
           ords.str())) {
    recorded[row[0].as<size_t>()] = true;
  }
  return recorded;
}

int64_t RecordGaps(pqxx::transaction_base& tx, const std::string& subscription,
                   const ReOwed& owed,
                   const std::map<std::string, int64_t>* applied) {
  std::vector<NewDivergence> ds;
  for (const auto& [agg, missing] : owed.gaps) {
    NewDivergence d = NewDivergence::Of(subscription, agg);
    d.kind = "lost_beyond_retention";
    d.detail = absl::StrCat(
        "the consumer lacks events of this aggregate it was given (its "
        "database lost commits or was restored), and the outbox no longer "
        "holds seq ",
        missing, " to give again (retention deleted it)");
    if (applied != nullptr) {
      auto it = applied->find(agg);
      if (it != applied->end()) d.consumer_seq = it->second;
    }
    d.outbox_seq = missing;
    ds.push_back(std::move(d));
  }
  const std::vector<bool> recorded = RecordDivergences(tx, ds);
  int64_t n = 0;
  for (size_t i = 0; i < ds.size(); ++i) {
    if (!recorded[i]) continue;
    ++n;
    spdlog::error(
        "relay: subscription {}, aggregate {}: {}", subscription,
        ChainLabel(OutboxChain(ds[i].aggregate_type, ds[i].aggregate_id)),
        ds[i].detail);
  }
  return n;
}

std::vector<v1::Divergence> ListDivergences(pqxx::transaction_base& tx,
                                            const std::string& subscription,
                                            bool include_resolved, int limit) {
  std::vector<v1::Divergence> out;
  for (const auto& row : tx.exec_params(
           absl::StrCat("SELECT ", kDivergenceColumns,
                        " FROM outbox_divergences WHERE subscription = $1 "
                        "AND ($2 OR resolved_at IS NULL) ORDER BY id LIMIT $3"),
           subscription, include_resolved, limit)) {
    out.push_back(DivergenceFromRow(row));
  }
  return out;
}

int64_t OpenDivergences(pqxx::transaction_base& tx,
                        const std::string& subscription) {
  return tx
      .exec_params1(
          "SELECT count(*) FROM outbox_divergences WHERE subscription = $1 "
          "AND resolved_at IS NULL",
          subscription)[0]
      .as<int64_t>();
}

std::map<int, WaitingFigures> PendingRows(pqxx::transaction_base& tx,
                                          const std::string& subscription,
                                          const std::vector<int>& partitions,
                                          int64_t cap) {
  std::map<int, WaitingFigures> figures;
  for (const auto& row : tx.exec_params(
           "WITH x AS (SELECT partition, seq FROM outbox_delivery WHERE "
           "subscription = $1 AND status = 'pending' AND partition = "
           "ANY($2::int[]) ORDER BY seq LIMIT $3), "
           "p AS (SELECT partition, count(*) AS n, min(seq) AS first FROM x "
           "GROUP BY partition) "
           "SELECT p.partition, p.n, coalesce(extract(epoch FROM now() - "
           "o.created_at), 0)::float8 AS age FROM p LEFT JOIN outbox o ON "
           "o.seq = p.first",
           subscription, ArrayLiteral(partitions).str(), cap)) {
    figures[row["partition"].as<int>()] = {
        .events = row["n"].as<int64_t>(),
        .oldest_seconds = std::max(0.0, row["age"].as<double>())};
  }
  return figures;
}

WaitingFigures DeadLetters(pqxx::transaction_base& tx,
                           const std::string& subscription) {
  const pqxx::row dead = tx.exec_params1(
      "SELECT count(*) AS n, coalesce(extract(epoch FROM now() - "
      "min(dead_at)), 0)::float8 AS age FROM outbox_delivery WHERE "
      "subscription = $1 AND status = 'dead'",
      subscription);
  return {.events = dead["n"].as<int64_t>(),
          .oldest_seconds = std::max(0.0, dead["age"].as<double>())};
}

std::optional<v1::Divergence> ResolveDivergence(
    pqxx::transaction_base& tx, const std::string& subscription,
    const std::string& aggregate_type, const std::string& aggregate_id,
    const std::string& resolved_by, const std::string& resolution) {
  pqxx::result r = tx.exec_params(
      absl::StrCat("UPDATE outbox_divergences SET resolved_at = now(), "
                   "resolved_by = $3, resolution = $4 WHERE subscription = $1 "
                   "AND aggregate_id = $2 AND aggregate_type = $5 AND "
                   "resolved_at IS NULL RETURNING ",
                   kDivergenceColumns),
      subscription, aggregate_id, resolved_by, StorableText(resolution, 100000),
      aggregate_type);
  if (r.empty()) return std::nullopt;
  // A divergence from before chains had a type ('') is of every type.
  tx.exec_params(
      "UPDATE outbox_delivery d SET status = 'pending', attempts = 0, "
      "last_error = NULL, dead_at = NULL, available_at = now() FROM outbox o "
      "WHERE d.subscription = $1 AND d.aggregate_id = $2 AND d.status = "
      "'diverged' AND o.seq = d.seq AND ($3 = '' OR o.aggregate_type = $3)",
      subscription, aggregate_id, aggregate_type);
  return DivergenceFromRow(r[0]);
}

std::optional<DatabaseIdentity> StoreConsumerIdentity(
    pqxx::transaction_base& tx, const std::string& subscription,
    const DatabaseIdentity& seen) {
  pqxx::result r = tx.exec_params(
      "UPDATE subscriptions s SET consumer_identity = $2, "
      "heal_requested_at = CASE WHEN o.consumer_identity IS NULL THEN "
      "s.heal_requested_at ELSE now() END, "
      "heal_reason = CASE WHEN o.consumer_identity IS NULL THEN "
      "s.heal_reason ELSE $3 END "
      "FROM (SELECT consumer_identity FROM subscriptions WHERE name = $1 "
      "FOR UPDATE) o WHERE s.name = $1 AND o.consumer_identity IS DISTINCT "
      "FROM $2 RETURNING coalesce(o.consumer_identity, '')",
      subscription, seen.Key(),
      absl::StrCat("the consumer's database changed to ", seen.ToString()));
  if (r.empty()) return std::nullopt;
  return DatabaseIdentity::FromKey(r[0][0].as<std::string>());
}

DatabaseIdentity ConsumerIdentity(pqxx::transaction_base& tx,
                                  const std::string& subscription) {
  pqxx::result r = tx.exec_params(
      "SELECT coalesce(consumer_identity, '') FROM subscriptions WHERE name "
      "= $1",
      subscription);
  if (r.empty()) return {};
  return DatabaseIdentity::FromKey(r[0][0].as<std::string>())
      .value_or(DatabaseIdentity{});
}

void RequestHeal(pqxx::transaction_base& tx, const std::string& subscription,
                 const std::string& reason) {
  tx.exec_params(
      "UPDATE subscriptions SET heal_requested_at = now(), heal_reason = $2 "
      "WHERE name = $1",
      subscription, StorableText(reason, 2000));
}

absl::Status RecordIdentityAndRequestHeal(pqxx::connection_base& conn,
                                          const DatabaseIdentity& identity,
                                          const std::string& subscription,
                                          const std::string& reason) {
  return InUnit(conn, [&](pqxx::transaction_base& tx) {
    RecordIdentity(tx, identity);
    RequestHeal(tx, subscription, reason);
  });
}

void HealDone(pqxx::transaction_base& tx, const std::string& subscription,
              const HealDue& due) {
  tx.exec_params(
      "UPDATE subscriptions SET healed_at = heal_requested_at WHERE name = $1 "
      "AND heal_requested_at = $2::timestamptz",
      subscription, due.requested_at);
}

namespace {

// An outbox row `o` with its delivery state `d` for subscription $1 (a row
// without one was delivered, or skipped when the subscription started
// after it): the event columns first (as kEventColumns), then the state,
// read by name in RowToProto.
const std::string kRowSelect = absl::StrCat(
    "SELECT ", kEventColumns, ", ", kDeliveryStatusSql,
    " AS status, coalesce(d.attempts, 0) AS attempts, "
    "coalesce(d.last_error, '') AS last_error, o.partition, "
    "(extract(epoch FROM o.created_at) * 1000000)::bigint AS created_us, "
    "coalesce((extract(epoch FROM d.available_at) * 1000000)::bigint, 0) "
    "AS available_us, "
    "coalesce((extract(epoch FROM d.dead_at) * 1000000)::bigint, 0) AS dead_us "
    "FROM outbox o JOIN subscriptions s ON s.name = $1 "
    "LEFT JOIN outbox_delivery d ON d.subscription = $1 AND d.seq = o.seq",
    kDeliveryLogJoinsSql);

v1::OutboxRow RowToProto(const pqxx::row& row) {
  v1::OutboxRow out;
  if (!EventFromRow(row, out.mutable_event())) {
    out.set_last_error("payload: not a valid outbox.v1.Event");
  }
  out.set_status(row["status"].as<std::string>());
  out.set_attempts(row["attempts"].as<int>());
  if (out.last_error().empty()) {
    out.set_last_error(row["last_error"].as<std::string>());
  }
  out.set_partition(row["partition"].as<int>());
  ToTimestamp(absl::FromUnixMicros(row["created_us"].as<int64_t>()),
              out.mutable_created_at());
  if (int64_t available = row["available_us"].as<int64_t>(); available != 0) {
    ToTimestamp(absl::FromUnixMicros(available), out.mutable_available_at());
  }
  if (int64_t dead = row["dead_us"].as<int64_t>(); dead != 0) {
    ToTimestamp(absl::FromUnixMicros(dead), out.mutable_dead_at());
  }
  return out;
}

}  // namespace

bool SubscriptionExists(pqxx::transaction_base& tx,
                        const std::string& subscription) {
  return !tx.exec_params("SELECT 1 FROM subscriptions WHERE name = $1",
                         subscription)
              .empty();
}

DeliveryRowCounts CountDeliveryRows(pqxx::transaction_base& tx,
                                    const std::string& subscription) {
  // Undelivered rows only: the table of them is small; the rest is what
  // the outbox retains beyond them.
  const pqxx::row r = tx.exec_params1(
      "SELECT count(*) FILTER (WHERE d.status = 'pending') AS pending, "
      "coalesce(extract(epoch FROM now() - min(o.created_at) FILTER "
      "(WHERE d.status = 'pending')), 0)::float8 AS oldest, "
      "count(*) FILTER (WHERE d.status = 'dead') AS dead, "
      "(SELECT count(*) FROM outbox WHERE seq >= (SELECT start_seq FROM "
      "subscriptions WHERE name = $1)) - count(*) AS without_row "
      "FROM outbox_delivery d JOIN outbox o USING (seq) "
      "WHERE d.subscription = $1",
      subscription);
  return {.pending = r["pending"].as<int64_t>(),
          .oldest_pending_seconds = r["oldest"].as<double>(),
          .dead = r["dead"].as<int64_t>(),
          .without_row = r["without_row"].as<int64_t>()};
}

std::optional<v1::OutboxRow> FindEvent(pqxx::transaction_base& tx,
                                       const std::string& subscription,
                                       const std::string& event_id) {
  const pqxx::result r =
      tx.exec_params(absl::StrCat(kRowSelect, " WHERE o.event_id = $2::uuid"),
                     subscription, event_id);
  if (r.empty()) return std::nullopt;
  return RowToProto(r[0]);
}

DeadLetterPage ReadDeadLetters(pqxx::transaction_base& tx,
                               const std::string& subscription,
                               const std::string& aggregate_id,
                               int64_t after_seq, int limit,
                               int64_t payload_budget) {
  // One more row than asked says whether more match.
  const pqxx::result rows = tx.exec_params(
      BoundedByPayloadBytes(
          absl::StrCat(kRowSelect,
                       " WHERE d.status = 'dead' AND ($2 = '' OR "
                       "o.aggregate_id = $2) AND o.seq > $4 ORDER BY "
                       "o.seq LIMIT $3 + 1"),
          payload_budget),
      subscription, aggregate_id, limit, after_seq);
  DeadLetterPage page;
  for (const auto& row : rows) {
    if (static_cast<int>(page.rows.size()) == limit) break;
    page.rows.push_back(RowToProto(row));
  }
  // More match: beyond the limit, or cut by size.
  page.more = !rows.empty() && rows[0]["rows_uncut"].as<int64_t>() >
                                   static_cast<int64_t>(page.rows.size());
  return page;
}

int64_t RequeueDeadLetters(pqxx::transaction_base& tx,
                           const std::string& subscription,
                           const DeadLetterFilter& filter) {
  return tx
      .exec_params1(
          "WITH q AS (UPDATE outbox_delivery SET status = 'pending', "
          "attempts = 0, available_at = now(), last_error = NULL, "
          "dead_at = NULL WHERE subscription = $7 AND status = 'dead' "
          "AND ($1 = '' OR seq = (SELECT seq FROM outbox WHERE event_id = "
          "nullif($1, '')::uuid)) "
          "AND ($2 = '' OR aggregate_id = $2) "
          "AND ($3::bigint = 0 OR dead_at >= to_timestamp($3::bigint / 1e6)) "
          "AND ($4::bigint = 0 OR dead_at < to_timestamp($4::bigint / 1e6)) "
          "AND ($5 = '' OR strpos(last_error, $5) > 0) RETURNING 1) "
          "SELECT count(*), pg_notify($6, '') FROM q",
          filter.event_id, filter.aggregate_id, filter.died_after_us,
          filter.died_before_us, filter.error_contains, kNotifyChannel,
          subscription)[0]
      .as<int64_t>();
}

std::vector<std::string> OpenDivergenceTypes(
    pqxx::transaction_base& tx, const std::string& subscription,
    const std::string& aggregate_id, const std::string& aggregate_type) {
  std::vector<std::string> types;
  for (const auto& row : tx.exec_params(
           "SELECT aggregate_type FROM outbox_divergences WHERE subscription "
           "= $1 AND aggregate_id = $2 AND ($3 = '' OR aggregate_type = $3) "
           "AND resolved_at IS NULL",
           subscription, aggregate_id, aggregate_type)) {
    types.push_back(row["aggregate_type"].as<std::string>());
  }
  return types;
}

std::string LastSubscriptionAction(pqxx::transaction_base& tx,
                                   const std::string& subscription) {
  const pqxx::result r = tx.exec_params(
      "SELECT detail FROM subscription_actions WHERE subscription = $1 "
      "ORDER BY id DESC LIMIT 1",
      subscription);
  return r.empty() ? "" : r[0]["detail"].as<std::string>();
}

void WakeRelays(pqxx::transaction_base& tx) {
  tx.exec_params("SELECT pg_notify($1, '')", kNotifyChannel);
}

}  // namespace outbox::relay
