#include "inbox/retention.h"

#include <spdlog/spdlog.h>

#include <map>
#include <set>
#include <string>

#include "common/ids.h"
#include "inbox/engine.h"

namespace outbox::inbox {

int64_t PruneInboxOnce(pqxx::connection& conn, absl::Duration keep, int batch) {
  pqxx::work tx(conn);
  ApplyLimits(tx);
  // A BRIN index on applied_at finds the old pages; no order is needed, so
  // the scan stops after `batch` rows.
  const pqxx::result old = tx.exec_params(
      "SELECT event_id::text, source, aggregate_type, aggregate_id, seq FROM "
      "inbox "
      "WHERE applied_at < now() - make_interval(secs => $1::float8) LIMIT $2",
      absl::ToDoubleSeconds(keep), batch);
  if (old.empty()) return 0;
  std::set<std::string> aggregates;
  std::map<std::string, int64_t> through;
  ArrayLiteral ids;
  for (const auto& row : old) {
    ids.Add(row[0].as<std::string>());
    const std::string agg =
        ChainKey(row[1].as<std::string>(), row[2].as<std::string>(),
                 row[3].as<std::string>());
    aggregates.insert(agg);
    int64_t& t = through[agg];
    t = std::max(t, row[4].as<int64_t>());
  }
  // A batch applying these aggregates reads the inbox and the cursor
  // together: it sees both before or both after this transaction.
  LockAggregates(tx, aggregates);
  const int64_t deleted =
      tx.exec_params("DELETE FROM inbox WHERE event_id = ANY($1::uuid[])",
                     ids.str())
          .affected_rows();
  ChainColumns chains;
  ArrayLiteral seqs;
  for (const auto& [agg, seq] : through) {
    chains.Add(agg);
    seqs.Add(seq);
  }
  tx.exec_params(
      "UPDATE aggregate_cursors c SET pruned_through = "
      "greatest(c.pruned_through, t.n) "
      "FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS "
      "t(s, y, a, n) WHERE c.source = t.s AND c.aggregate_type = t.y AND "
      "c.aggregate_id = t.a",
      chains.source.str(), chains.type.str(), chains.id.str(), seqs.str());
  tx.commit();
  return deleted;
}

InboxRetention::InboxRetention(Database* db, absl::Duration keep,
                               Metrics* metrics, absl::Duration interval,
                               int batch, absl::Duration busy_pause)
    : db_(db),
      keep_(keep),
      batch_(batch),
      pruned_(metrics->AddCounter(
          "outbox_consumer_inbox_pruned_total",
          "Inbox rows deleted by retention (--inbox_retention).")),
      task_(
          interval, [this] { return RunOnce(); }, busy_pause) {}

bool InboxRetention::RunOnce() {
  int64_t deleted = 0;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    deleted = PruneInboxOnce(c, keep_, batch_);
    return absl::OkStatus();
  });
  if (!s.ok()) {
    spdlog::warn("consumer: inbox retention: {}", std::string(s.message()));
    return false;
  }
  if (deleted > 0) {
    pruned_->Add(deleted);
    spdlog::debug("consumer: inbox retention deleted {} rows", deleted);
  }
  return deleted == batch_;  // more to do: soon
}

}  // namespace outbox::inbox
