#include "relay/retention.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace outbox::relay {

namespace {

// Retention's advisory lock: PruneOutbox takes it exclusive, those who owe
// events again take it shared (HoldRetentionBack).
constexpr int kRetentionLockKey = 2834;

std::string RetentionLock(bool shared) {
  return absl::StrCat("SELECT pg_advisory_xact_lock",
                      shared ? "_shared" : "", "(", kRetentionLockKey, ", 0)");
}

}  // namespace

void HoldRetentionBack(pqxx::transaction_base& tx) {
  tx.exec(RetentionLock(/*shared=*/true));
}

int64_t PruneOutbox(pqxx::transaction_base& tx, absl::Duration retention,
                    int limit) {
  // Operators' replays and heals owe events again (ReOwe, Replay) under
  // this lock shared: taken exclusive in a statement of its own, before
  // the delete, whose snapshot then shows every delivery row they owed.
  // Without it a replay's rows, not yet committed, would not hold back the
  // delete of the events they point at.
  tx.exec(RetentionLock(/*shared=*/false));
  // f: the oldest tick the log's subscriptions need (none when the log
  // delivers to none) and its snapshot: an event it does not show (every
  // event written since the log began, if the tick is missing) stops the
  // prefix. Events from before the log have no xid and are judged by their
  // delivery rows alone.
  static const std::string kSql =
      "WITH f AS (SELECT fl, (SELECT t.snapshot FROM outbox_ticks t WHERE "
      "t.id = fl) AS snap FROM outbox_log_floor($3) fl), "
      "c AS (SELECT seq, created_at, xid FROM outbox WHERE seq < "
      "coalesce((SELECT min((SELECT min(d.seq) FROM outbox_delivery d "
      "WHERE d.subscription = s.name)) FROM subscriptions s), "
      "9223372036854775807) ORDER BY seq LIMIT $2) "
      "DELETE FROM outbox WHERE seq IN (SELECT seq FROM c WHERE seq < "
      "coalesce((SELECT min(seq) FROM c WHERE created_at >= now() - "
      "make_interval(secs => $1::float8) OR ((SELECT fl FROM f) IS NOT NULL "
      "AND xid IS NOT NULL AND NOT coalesce(pg_visible_in_snapshot(xid, "
      "(SELECT snap FROM f)), false))), 9223372036854775807))";
  return static_cast<int64_t>(tx.exec_params(kSql,
                                             absl::ToDoubleSeconds(retention),
                                             limit, kPartitionCount)
                                  .affected_rows());
}

}  // namespace outbox::relay
