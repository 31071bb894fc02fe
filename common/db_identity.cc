#include "common/db_identity.h"

#include <spdlog/spdlog.h>

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace outbox {

std::string DatabaseIdentity::ToString() const {
  if (!known()) return "unknown";
  return absl::StrCat("system ", system_identifier, ", timeline ", timeline,
                      ", database oid ", database_oid,
                      in_recovery ? " (a standby)" : "");
}

std::string DatabaseIdentity::Key() const {
  if (!known()) return "";
  return absl::StrCat(system_identifier, "/", timeline, "/", database_oid);
}

std::optional<DatabaseIdentity> DatabaseIdentity::FromKey(
    absl::string_view key) {
  std::vector<absl::string_view> parts = absl::StrSplit(key, '/');
  DatabaseIdentity id;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &id.system_identifier) ||
      !absl::SimpleAtoi(parts[1], &id.timeline) ||
      !absl::SimpleAtoi(parts[2], &id.database_oid) || !id.known()) {
    return std::nullopt;
  }
  return id;
}

void ToProto(const DatabaseIdentity& id, v1::DatabaseIdentity* out) {
  out->set_system_identifier(id.system_identifier);
  out->set_timeline(id.timeline);
  out->set_database_oid(id.database_oid);
}

DatabaseIdentity FromProto(const v1::DatabaseIdentity& id) {
  DatabaseIdentity out;
  out.system_identifier = id.system_identifier();
  out.timeline = id.timeline();
  out.database_oid = id.database_oid();
  return out;
}

IdentityChange CompareIdentity(const DatabaseIdentity& before,
                               const DatabaseIdentity& after) {
  IdentityChange c;
  c.before = before;
  c.after = after;
  if (!before.known() || !after.known() || before == after) return c;
  if (before.system_identifier != after.system_identifier) {
    c.kind = IdentityChange::kNewServer;
  } else if (before.timeline != after.timeline) {
    c.kind = IdentityChange::kFailover;
  } else {
    c.kind = IdentityChange::kRecreated;
  }
  return c;
}

std::string IdentityChange::Describe() const {
  switch (kind) {
    case kSame:
      return "no change";
    case kFailover:
      return absl::StrCat("failover: timeline ", before.timeline, " -> ",
                          after.timeline, " (system ", after.system_identifier,
                          ")");
    case kNewServer:
      return absl::StrCat(
          "failover to another server: system ", before.system_identifier,
          " timeline ", before.timeline, " -> system ", after.system_identifier,
          " timeline ", after.timeline);
    case kRecreated:
      return absl::StrCat(
          "failover of the database: it was dropped and made again (a "
          "restore?), oid ",
          before.database_oid, " -> ", after.database_oid, " (timeline ",
          before.timeline, " -> ", after.timeline, ")");
  }
  return "";
}

const char* IdentityChange::KindName() const {
  switch (kind) {
    case kSame:
      return "same";
    case kFailover:
      return "failover";
    case kNewServer:
      return "new_server";
    case kRecreated:
      return "recreated";
  }
  return "same";
}

DatabaseIdentity IdentityFromRow(const pqxx::row& row) {
  DatabaseIdentity id;
  if (!absl::SimpleAtoi(row[0].as<std::string>(), &id.system_identifier)) {
    id.system_identifier = 0;
  }
  id.timeline = row[1].is_null() ? 0 : row[1].as<uint32_t>();
  id.database_oid = row[2].as<uint32_t>();
  id.in_recovery = row[3].as<bool>();
  return id;
}

DatabaseIdentity ReadIdentity(pqxx::transaction_base& tx) {
  return IdentityFromRow(tx.exec(kIdentitySql)[0]);
}

IdentityWatch::IdentityWatch(std::string what, OnChange on_change)
    : what_(std::move(what)), on_change_(std::move(on_change)) {}

IdentityChange IdentityWatch::Observe(const DatabaseIdentity& seen) {
  IdentityChange c;
  {
    absl::MutexLock lock(&mu_);
    c = CompareIdentity(current_, seen);
    if (seen.known()) current_ = seen;
    if (c.changed()) ++changes_;
  }
  if (!c.changed()) return c;
  spdlog::error("{} {}; was {}, now {}", what_, c.Describe(),
                c.before.ToString(), c.after.ToString());
  if (on_change_) on_change_(c);
  return c;
}

IdentityChange IdentityWatch::ObserveRecorded(
    const DatabaseIdentity& recorded) {
  IdentityChange c;
  {
    absl::MutexLock lock(&mu_);
    if (recorded_seen_ || changes_ > 0 || !recorded.known()) {
      recorded_seen_ = true;
      return c;
    }
    recorded_seen_ = true;
    c = CompareIdentity(recorded, current_);
    if (c.changed()) ++changes_;
  }
  if (!c.changed()) return c;
  spdlog::error("{} {} (since it was last recorded); was {}, now {}", what_,
                c.Describe(), c.before.ToString(), c.after.ToString());
  if (on_change_) on_change_(c);
  return c;
}

DatabaseIdentity IdentityWatch::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

int64_t IdentityWatch::changes() const {
  absl::MutexLock lock(&mu_);
  return changes_;
}

}  // namespace outbox

namespace outbox {

std::optional<DatabaseIdentity> RecordedIdentity(pqxx::transaction_base& tx) {
  pqxx::result r =
      tx.exec("SELECT identity FROM outbox_database_identity WHERE id = 1");
  if (r.empty()) return std::nullopt;
  return DatabaseIdentity::FromKey(r[0][0].as<std::string>());
}

bool RecordIdentity(pqxx::transaction_base& tx, const DatabaseIdentity& id) {
  if (!id.known() || id.in_recovery) return false;
  tx.exec_params(
      "INSERT INTO outbox_database_identity (id, identity) VALUES (1, $1) "
      "ON CONFLICT (id) DO UPDATE SET identity = EXCLUDED.identity, "
      "recorded_at = now() WHERE outbox_database_identity.identity IS "
      "DISTINCT FROM EXCLUDED.identity",
      id.Key());
  return true;
}

}  // namespace outbox
