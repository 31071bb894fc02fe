#include "relay/claim.h"

#include "absl/strings/str_cat.h"
#include "common/db.h"
#include "common/limits.h"
#include "relay/leases.h"
#include "relay/outbox_row.h"

namespace outbox::relay {

// The claim: pending deliveries of subscription $1 in partitions $2
// (int[]), of aggregates not in $3 (text[]: those with events in flight or
// answered but not yet marked), above seq $5, at most $4, in seq order,
// with each row's event and whether its predecessor (prev_seq) is no longer
// owed to the subscription (column `prev_done`: delivered, or before the
// subscription's start). Events are delivered in chain order, so such a row
// is its aggregate's first undelivered event. The relay takes an
// aggregate's rows only when the first of them is that, and then takes them
// all: they are the aggregate's next consecutive events, which the consumer
// applies in chain order in one transaction. So a row that is rejected,
// backing off or dead stalls its own aggregate only, and a long chain
// drains a batch at a time instead of an event at a time.
//
// $6 (bigint[]): rows delivered (answered) and not yet marked, which this
// claim treats as gone: neither claimed again nor owed as a predecessor.
// kMarkAndClaimSql deletes them in the same statement, so that a cycle
// (answer, mark, claim, send) costs one round trip to the database, not
// two, and an answered event's successor goes out with the next batch; the
// statement is atomic, so a failed one marks nothing and sends nothing.
// kClaimSql (no DELETE, so it runs on a read-only server too) gets '{}'.
//
// $5: the relay first claims above the highest seq it has sent, which
// skips the rows in flight at the front of the table instead of reading
// and rejecting each; when that runs dry, at least once per poll, and once
// an aggregate that was busy during such a claim is freed, it claims from
// the start ($5 = 0), finding rows passed over (their aggregate was busy
// then, or they were backing off). Each further claim of the same round
// continues after the last row the one before returned, so rows that must
// wait (their predecessor backs off or is dead) are passed, not excluded
// by id.
//
// The lists $3 and $6 are tested as NOT IN subqueries, which PostgreSQL
// hashes once per claim: as NOT (... = ANY(...)) each row read compared
// itself with every entry, and a claim with a backlog's ~1,000 aggregates
// in flight took 8.6 ms instead of 2 (26.6 from the start of the table).
// The predecessor test of each claimed row keeps = ANY: it reads one row.
//
// The claimed delivery rows are materialized first, so that the outbox is
// read by primary key for them alone: a merge join with the outbox would
// walk its whole delivered history on every claim. OFFSET 0 keeps the
// predecessor test a probe per row returned: without it PostgreSQL may
// hash the whole subscription's pending rows for it instead, on every
// claim (a generic plan with a backlog did: 10 ms per claim instead of 2).
// $7: this replica's member name: only partitions whose lease it holds
// (relay/leases.h) are read, so a replica that lost one while frozen sends
// nothing of it. $8 (uuid[], mark only): the event id of each seq in $6; a
// delivery row is deleted only if its event is that one, so an answer from
// before a failover that reused its seq never deletes another event's row.
// With `lsn`, each row also carries the primary's WAL insert position
// (column `lsn`), past the commit of every row read (relay/fence.h).
// The rows stop at kMaxDeliveryBatchBytes of payloads, whatever $4 says
// (BoundedByPayloadBytes): a backlog of large events is read a batch's
// worth at a time, not $4 full payloads.
//
// Prepared once per connection as "claim", "mark_and_claim" and their
// fenced forms. Columns: kEventColumns, then partition, prev_done (and
// lsn).
std::string ClaimSql(bool mark, bool lsn) {
  const std::string with = absl::StrCat(
      "WITH ",
      mark ? "m AS (DELETE FROM outbox_delivery d USING unnest($6::bigint[], "
             "$8::uuid[]) AS k(s, e), outbox o WHERE d.subscription = $1 AND "
             "d.seq = k.s AND d.status = 'pending' AND o.seq = k.s AND "
             "o.event_id = k.e), "
           : "",
      "c AS MATERIALIZED (SELECT d.seq, d.partition FROM outbox_delivery d "
      "WHERE d.subscription = $1 AND d.status = 'pending' "
      "AND d.partition = ANY($2::int[]) AND ",
      PartitionLeases::ClaimFence(7),
      " AND d.available_at <= now() "
      "AND d.aggregate_id NOT IN (SELECT unnest($3::text[])) AND d.seq > $5 "
      "AND d.seq NOT IN (SELECT unnest($6::bigint[])) "
      "ORDER BY d.seq LIMIT $4) ");
  const std::string select = absl::StrCat(
      "SELECT ", kEventColumns,
      ", c.partition, "
      "NOT EXISTS (SELECT 1 FROM outbox_delivery p WHERE p.subscription = $1 "
      "AND p.seq = o.prev_seq AND NOT (p.seq = ANY($6::bigint[])) OFFSET 0) "
      "AS prev_done",
      lsn ? ", pg_current_wal_insert_lsn()::text AS lsn" : "",
      " FROM c JOIN outbox o ON o.seq = c.seq ORDER BY c.seq");
  // The WITH stays at the top, where a data-modifying one must be.
  return absl::StrCat(with,
                      BoundedByPayloadBytes(select, kMaxDeliveryBatchBytes));
}

Claimed ClaimPending(pqxx::transaction_base& tx, const ClaimQuery& q) {
  static const std::string kSql[2][2] = {
      {ClaimSql(false, false), ClaimSql(false, true)},
      {ClaimSql(true, false), ClaimSql(true, true)}};
  static const char* const kName[2][2] = {
      {"claim", "claim_fenced"}, {"mark_and_claim", "mark_and_claim_fenced"}};
  std::vector<std::string> params = {
      q.subscription,         ArrayLiteral(q.partitions).str(),
      ArrayLiteral(q.excluded_ids).str(), absl::StrCat(q.limit),
      absl::StrCat(q.after),  ArrayLiteral(q.delivered).str(),
      q.member};
  if (q.mark) params.push_back(ArrayLiteral(q.delivered_ids).str());
  const pqxx::result rows =
      ExecPrepared(tx, kName[q.mark][q.lsn], kSql[q.mark][q.lsn].c_str(),
                   pqxx::prepare::make_dynamic_params(params));
  Claimed claimed;
  claimed.candidates.resize(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    Candidate& c = claimed.candidates[r];
    c.parsed = EventFromRow(rows[r], &c.event);
    c.partition = rows[r]["partition"].as<int>();
    c.goes = rows[r]["prev_done"].as<bool>();
  }
  if (!rows.empty()) {
    claimed.last_seq = rows[rows.size() - 1]["seq"].as<int64_t>();
    if (q.lsn) claimed.lsn = rows[0]["lsn"].as<std::string>();
  }
  return claimed;
}

}  // namespace outbox::relay
