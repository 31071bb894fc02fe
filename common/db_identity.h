#pragma once
// Which database a session reached, so that a failover, a restore or a
// server swapped behind an address is noticed instead of silently taken
// for the same database. A database is named by its server's system
// identifier (pg_control_system(): made by initdb, kept by every physical
// standby), the timeline (a promotion starts a new one) and the database's
// oid (a database dropped and restored from a dump gets a new one).
//
// Example (what Connect does for each new session):
//   IdentityWatch watch("orders database", [&](const IdentityChange& c) {
//     failovers->Add();
//   });
//   watch.Observe(ReadIdentity(tx));  // logs an error naming both timelines
//                                     // when the identity changed
//
// Thread-safe.

#include <cstdint>
#include <functional>
#include <optional>
#include <pqxx/pqxx>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "outbox/v1/sink.pb.h"

namespace outbox {

struct DatabaseIdentity {
  uint64_t system_identifier = 0;  // 0: unknown
  uint32_t timeline = 0;
  uint32_t database_oid = 0;
  bool in_recovery = false;  // a standby (read-only)

  bool known() const { return system_identifier != 0; }
  // For people: "system 7714441403134788341, timeline 2, database oid 16384".
  std::string ToString() const;
  // For storage and the wire: "7714441403134788341/2/16384"; "" if unknown.
  std::string Key() const;
  // The inverse of Key; nothing for "" or a malformed key.
  static std::optional<DatabaseIdentity> FromKey(absl::string_view key);

  bool operator==(const DatabaseIdentity& o) const {
    return system_identifier == o.system_identifier && timeline == o.timeline &&
           database_oid == o.database_oid;
  }
  bool operator!=(const DatabaseIdentity& o) const { return !(*this == o); }
};

// The wire form of an identity (outbox.v1.DatabaseIdentity).
void ToProto(const DatabaseIdentity& id, v1::DatabaseIdentity* out);
DatabaseIdentity FromProto(const v1::DatabaseIdentity& id);

// How a database's identity moved from `before` to `after`.
struct IdentityChange {
  enum Kind {
    kSame,       // or either unknown
    kFailover,   // same server lineage, another timeline: a promoted standby
    kNewServer,  // another system identifier: another cluster behind the
                 // address (a logical restore, a rebuilt server)
    kRecreated,  // same server and timeline, another database oid: the
                 // database was dropped and made again (a dump restored)
  };
  Kind kind = kSame;
  DatabaseIdentity before, after;

  bool changed() const { return kind != kSame; }
  // "failover: timeline 1 -> 2 (system 77...)"; the word "failover" leads
  // every kind, as operators and alerts search for it.
  std::string Describe() const;
  // "failover", "new_server", "recreated" or "same": a metric label.
  const char* KindName() const;
};

IdentityChange CompareIdentity(const DatabaseIdentity& before,
                               const DatabaseIdentity& after);

// One statement that reads the identity of the session's database (works
// on a primary and a standby, needs no privilege), then the backend's pid
// and its synchronous_commit. Columns: system_identifier (text), timeline
// (int), database_oid (bigint), in_recovery (bool), backend_pid (int),
// synchronous_commit (text).
inline constexpr char kIdentitySql[] =
    "SELECT s.system_identifier::text, CASE WHEN pg_is_in_recovery() THEN "
    "(SELECT timeline_id FROM pg_control_checkpoint()) ELSE ('x' || "
    "substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int "
    "END, d.oid::bigint, pg_is_in_recovery(), pg_backend_pid(), "
    "current_setting('synchronous_commit') FROM pg_control_system() s, "
    "pg_database d WHERE d.datname = current_database()";

// The identity in a row of kIdentitySql.
DatabaseIdentity IdentityFromRow(const pqxx::row& row);

// Reads the identity with kIdentitySql; throws as libpqxx does.
DatabaseIdentity ReadIdentity(pqxx::transaction_base& tx);

// Remembers the identity last seen of one database, so that every binary
// notices when it changes: the change is logged as an error (with the word
// "failover" and both identities) and `on_change` hears it, on the thread
// that observed it.
class IdentityWatch {
 public:
  using OnChange = std::function<void(const IdentityChange&)>;
  // `what` names the database in messages ("the outbox database").
  explicit IdentityWatch(std::string what, OnChange on_change = nullptr);

  // Records `seen`; the change from the identity seen before (kSame for the
  // first, or an unknown one).
  IdentityChange Observe(const DatabaseIdentity& seen);

  // The identity the database itself recorded (RecordedIdentity), compared
  // with the one this process has seen, once, before any change was
  // observed: a failover or a restore that happened while the process was
  // down is reported (as Observe reports) from `recorded` to the current
  // identity. Later calls, and an unknown `recorded`, report nothing.
  IdentityChange ObserveRecorded(const DatabaseIdentity& recorded);

  // The identity last seen (unknown before the first).
  DatabaseIdentity current() const;
  // Changes observed so far.
  int64_t changes() const;

 private:
  const std::string what_;
  const OnChange on_change_;
  mutable absl::Mutex mu_;
  DatabaseIdentity current_ ABSL_GUARDED_BY(mu_);
  int64_t changes_ ABSL_GUARDED_BY(mu_) = 0;
  bool recorded_seen_ ABSL_GUARDED_BY(mu_) = false;
};

// The identity recorded in the database's outbox_database_identity (made by
// the outbox and inbox migrations); nothing when there is none yet. Throws
// as libpqxx does.
std::optional<DatabaseIdentity> RecordedIdentity(pqxx::transaction_base& tx);

// Records `id` there, unless it is recorded already or unknown. False, with
// nothing written, on a read-only database (a standby); throws on other
// errors.
bool RecordIdentity(pqxx::transaction_base& tx, const DatabaseIdentity& id);

}  // namespace outbox
