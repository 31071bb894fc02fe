#include "relay/retention.h"

#include <string>

#include "common/ids.h"

namespace outbox::relay {

int64_t PruneOutbox(pqxx::transaction_base& tx, absl::Duration retention,
                    int limit) {
  // f: the xmin of the oldest tick the log's subscriptions need (NULL when
  // the log delivers to none; 0, which stops at every event written since
  // the log began, if that tick is missing). Events from before the log
  // have no xid and are judged by their delivery rows alone.
  static const std::string kSql =
      "WITH f AS (SELECT CASE WHEN fl IS NOT NULL THEN coalesce((SELECT "
      "pg_snapshot_xmin(t.snapshot) FROM outbox_ticks t WHERE t.id = fl), "
      "'0'::xid8) END AS xmin FROM outbox_log_floor($3) fl), "
      "c AS (SELECT seq, created_at, xid FROM outbox WHERE seq < "
      "coalesce((SELECT min((SELECT min(d.seq) FROM outbox_delivery d "
      "WHERE d.subscription = s.name)) FROM subscriptions s), "
      "9223372036854775807) ORDER BY seq LIMIT $2) "
      "DELETE FROM outbox WHERE seq IN (SELECT seq FROM c WHERE seq < "
      "coalesce((SELECT min(seq) FROM c WHERE created_at >= now() - "
      "make_interval(secs => $1::float8) OR xid >= (SELECT xmin FROM f)), "
      "9223372036854775807))";
  return static_cast<int64_t>(tx.exec_params(kSql,
                                             absl::ToDoubleSeconds(retention),
                                             limit, kPartitionCount)
                                  .affected_rows());
}

}  // namespace outbox::relay
