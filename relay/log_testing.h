#pragma once
// For the tests of the outbox log: events appended as the writer would,
// without its chain heads.

#include <functional>
#include <pqxx/pqxx>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace outbox::relay {

inline constexpr int kPartitions = kPartitionCount;

// Inserts one event of `aggregate` in `tx` (seq drawn now, unless given;
// its partition from the aggregate, unless given). Returns its seq.
inline int64_t Append(pqxx::transaction_base& tx, const std::string& aggregate,
                      int64_t seq = 0, int partition = -1) {
  if (partition < 0) {
    partition =
        static_cast<int>(std::hash<std::string>()(aggregate) % kPartitions);
  }
  const std::string columns =
      "event_id, aggregate_type, aggregate_id, prev_seq, event_type, "
      "schema_version, payload, partition";
  const std::string values =
      "gen_random_uuid(), 'order', $1, 0, 'order.created', 1, ''::bytea, $2";
  pqxx::result r =
      seq == 0 ? tx.exec_params(
                     absl::StrCat("INSERT INTO outbox (", columns, ") VALUES (",
                                  values, ") RETURNING seq"),
                     aggregate, partition)
               : tx.exec_params(
                     absl::StrCat("INSERT INTO outbox (seq, ", columns,
                                  ") VALUES ($3, ", values, ") RETURNING seq"),
                     aggregate, partition, seq);
  return r[0][0].as<int64_t>();
}

}  // namespace outbox::relay
