#include "relay/leases.h"

#include <pqxx/pqxx>

#include "absl/strings/str_cat.h"
#include "common/db.h"

namespace outbox::relay {

PartitionLeases::PartitionLeases(std::string subscription, std::string member,
                                 absl::Duration ttl)
    : subscription_(std::move(subscription)),
      member_(std::move(member)),
      ttl_(ttl) {}

LeaseRound PartitionLeases::Heartbeat(pqxx::transaction_base& tx,
                                      const std::set<int>& owned,
                                      int partitions) {
  const double ttl = absl::ToDoubleSeconds(ttl_);
  LeaseRound round;
  // One statement: the lease rows, the membership, the count of live
  // members, and the renewal of every lease this member holds.
  const pqxx::result r = tx.exec_params(
      "WITH mk AS (INSERT INTO outbox_partition_leases (subscription, "
      "partition) SELECT $1, g FROM generate_series(0, $4 - 1) AS g ON "
      "CONFLICT DO NOTHING), "
      "me AS (INSERT INTO outbox_relay_members (subscription, member, "
      "expires_at) VALUES ($1, $2, now() + make_interval(secs => $3)) ON "
      "CONFLICT (subscription, member) DO UPDATE SET expires_at = "
      "EXCLUDED.expires_at), "
      "mine AS (UPDATE outbox_partition_leases SET expires_at = now() + "
      "make_interval(secs => $3) WHERE subscription = $1 AND owner = $2 "
      "RETURNING partition) "
      "SELECT -1 AS partition, (SELECT count(*) FROM outbox_relay_members "
      "WHERE subscription = $1 AND expires_at > now() AND member <> $2) + 1 "
      "AS members UNION ALL SELECT partition, 0 FROM mine",
      subscription_, member_, ttl, partitions);
  for (const auto& row : r) {
    const int p = row["partition"].as<int>();
    if (p < 0) {
      round.members = row["members"].as<int>();
    } else {
      round.owned.insert(p);
    }
  }
  for (int p : owned) {
    if (!round.owned.count(p)) round.lost.insert(p);
  }
  // Members gone for a while: their rows only take room.
  tx.exec_params(
      "DELETE FROM outbox_relay_members WHERE subscription = $1 AND "
      "expires_at < now() - interval '1 minute'",
      subscription_);
  return round;
}

void PartitionLeases::Release(pqxx::transaction_base& tx,
                              const std::set<int>& partitions) {
  if (partitions.empty()) return;
  tx.exec_params(
      "UPDATE outbox_partition_leases SET owner = NULL, expires_at = "
      "'-infinity' WHERE subscription = $1 AND owner = $2 AND partition = "
      "ANY($3::int[])",
      subscription_, member_, ArrayLiteral(partitions).str());
}

std::set<int> PartitionLeases::Acquire(pqxx::transaction_base& tx,
                                       const std::vector<int>& preference,
                                       size_t count) {
  std::set<int> taken;
  if (count == 0) return taken;
  for (const auto& row : tx.exec_params(
           "UPDATE outbox_partition_leases l SET owner = $2, token = "
           "l.token + 1, expires_at = now() + make_interval(secs => $3) FROM "
           "(SELECT partition FROM outbox_partition_leases WHERE "
           "subscription = $1 AND (owner IS NULL OR expires_at <= now()) AND "
           "partition = ANY($4::int[]) ORDER BY array_position($4::int[], "
           "partition) LIMIT $5 FOR UPDATE SKIP LOCKED) f WHERE "
           "l.subscription = $1 AND l.partition = f.partition RETURNING "
           "l.partition",
           subscription_, member_, absl::ToDoubleSeconds(ttl_),
           ArrayLiteral(preference).str(), static_cast<int64_t>(count))) {
    taken.insert(row[0].as<int>());
  }
  return taken;
}

void PartitionLeases::ReleaseAll(pqxx::transaction_base& tx) {
  tx.exec_params(
      "UPDATE outbox_partition_leases SET owner = NULL, expires_at = "
      "'-infinity' WHERE subscription = $1 AND owner = $2",
      subscription_, member_);
  tx.exec_params(
      "DELETE FROM outbox_relay_members WHERE subscription = $1 AND member = "
      "$2",
      subscription_, member_);
}

std::string PartitionLeases::ClaimFence(int param) {
  return absl::StrCat(
      "d.partition IN (SELECT l.partition FROM outbox_partition_leases l "
      "WHERE l.subscription = $1 AND l.owner = $",
      param, " AND l.expires_at > now())");
}

}  // namespace outbox::relay
