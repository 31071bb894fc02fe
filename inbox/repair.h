#pragma once
// What a relay needs from a consumer's inbox to repair delivery after a
// database lost commits or two histories diverged: each aggregate's applied
// position (the relay compares it with what it delivered and delivers
// again what is missing), and the rewind of one diverged aggregate to the
// history the producer holds, recording what is superseded.
//
// Example (EventSink.GetCursors):
//   InboxRepair repair(&db);
//   auto page = repair.Cursors({.after = "", .limit = 1000});
//
// Thread-safe; every call is a transaction of its own on `db`.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/db.h"
#include "inbox/handler.h"

namespace outbox::inbox {

struct CursorQuery {
  // The chains of this source, and those recorded before chains had a
  // source that it may take over (inbox_legacy_source).
  std::string source;
  std::string after, after_type;  // a page of chains after this id and type
  int limit = 1000;               // 1-5000
  std::vector<std::string> only;  // or exactly these ids (at most 5000)
};

struct Cursor {
  std::string source, aggregate_type, aggregate_id;
  int64_t applied_seq = 0;
  std::string applied_event_id;  // "" when inbox retention deleted its row
  int64_t pruned_through = 0;
  int64_t held = 0;
};

struct CursorPage {
  std::vector<Cursor> cursors;  // in aggregate (byte) order
  bool more = false;            // a page, and more aggregates follow
  DatabaseIdentity identity;    // of the database read
};

struct RewindRequest {
  std::string source, aggregate_type, aggregate_id;  // the chain
  // The producer's retained history of the aggregate, by event id.
  std::vector<std::string> keep_event_ids;
  // ... and its events up to this seq, delivered and then deleted by the
  // producer's retention (0: none).
  int64_t shared_through_seq = 0;
  std::string reason;
  std::string operator_name;
};

struct Superseded {
  std::string event_id;
  int64_t seq = 0;
  std::string event_type;
  absl::Time applied_at;
};

struct RewindResult {
  int64_t applied_seq = 0;  // the cursor after the rewind
  std::vector<Superseded> superseded;
  int64_t held_dropped = 0;
};

class InboxRepair {
 public:
  // `db` and `handler` (may be null) must outlive this.
  explicit InboxRepair(Database* db, Handler* handler = nullptr);

  // InvalidArgument for a limit or list out of range; Unavailable when the
  // database cannot be read.
  absl::StatusOr<CursorPage> Cursors(const CursorQuery& q);

  // Moves the aggregate's inbox rows from the first one whose event is not
  // in keep_event_ids on to inbox_superseded, drops its held events, and
  // sets its cursor to the last row kept (0 if none), and lets the handler
  // set its own state back (Handler::Rewound), all in one transaction under
  // the aggregate's apply lock. FailedPrecondition when
  // inbox retention deleted rows that the comparison needs.
  absl::StatusOr<RewindResult> Rewind(RewindRequest r);

 private:
  Database* const db_;
  Handler* const handler_;
};

}  // namespace outbox::inbox
