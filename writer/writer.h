#pragma once
// outbox::Writer appends events to the outbox inside the caller's own
// PostgreSQL transaction, next to the business rows they describe: both
// commit, or neither does.
//
//   outbox::Writer writer({.notify_url = url});
//   pqxx::work tx(conn);
//   tx.exec_params("UPDATE accounts SET ...", ...);
//   auto appended = writer.Append(
//       tx, outbox::NewEvent::Of("account", account_id, deposited));
//   if (!appended.ok()) { ... }  // the event was refused; tx is untouched
//   tx.commit();
//   writer.Committed();  // wakes the relays (they also poll)
//
// Each aggregate's events form one chain: every event carries prev_seq,
// the seq of its aggregate's previous event (0 for the first). The writer
// keeps the chain itself, in outbox_heads, one row per aggregate that the
// appending statement locks and moves: appenders of one aggregate queue
// on that row until the one before them commits, so an event is visible
// only after its predecessor, and seq grows along every chain. No
// business table is involved. The outbox tables come from
// OutboxSchema() (common/schema.h); apply it before the first Append.

#include <memory>
#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/db.h"
#include "google/protobuf/any.pb.h"
#include "google/protobuf/message.h"

namespace outbox {

class Notifier;

// One event to append.
struct NewEvent {
  std::string aggregate_type;  // 1-64 bytes, e.g. "order"
  std::string aggregate_id;    // 1-128 bytes
  std::string event_type;      // 1-128 bytes, e.g. "OrderPaid"
  int schema_version = 1;      // of the payload
  google::protobuf::Any payload;
  std::string trace_parent;  // optional W3C traceparent
  // Optional UUID; a new one (time-ordered) when empty. One given must
  // never have been used before: the outbox refuses a repeat only while
  // it still holds the first (--retention deletes it), and consumers know
  // an event by its id. On a partitioned outbox (rotation) a given id is
  // checked by a statement of its own before the append, and needs a READ
  // COMMITTED transaction.
  std::string event_id;
  absl::Time occurred_at = absl::InfinitePast();  // now when unset

  // An event whose payload is `message` and whose type is its name.
  static NewEvent Of(std::string aggregate_type, std::string aggregate_id,
                     const google::protobuf::Message& message);
};

// Where an appended event landed.
struct Appended {
  std::string event_id;
  int64_t seq = 0;
  int64_t prev_seq = 0;  // its aggregate's previous event; 0 for the first
};

// The events of one statement as its parameters: one array literal per
// column of OUTBOX_WRITER_APPEND_CTES's input, in that order.
struct EventRows {
  std::string aggregate_type;          // text[]
  std::string aggregate_id;            // text[]
  std::string event_id;                // uuid[]
  std::string event_type;              // text[]
  std::string schema_version;          // int[]
  std::string payload;                 // text[]: the stored event, hex
  std::string trace_parent;            // text[], '' for none
  std::string partition;               // int[]
  std::vector<std::string> event_ids;  // as given, or new, in input order
};

// The writer's part of a statement that also writes the caller's rows, so
// that both take one round trip (in autocommit, not even BEGIN and COMMIT
// besides). It reads the events from `input`, which the caller's WITH
// defines before it, with the columns (aggregate_type text, aggregate_id
// text, event_id uuid, event_type text, schema_version int, payload text,
// trace_parent text, partition int), each aggregate at most once; filled
// from Writer::Rows, and filtered as the caller needs (say, to the rows its
// insert returned). Its CTEs are named h and e; the caller's final SELECT
// may read h (aggregate_type, aggregate_id, last_seq = the event's seq,
// prev_seq). See producer/order_store.cc.
//
// Each aggregate's head row is inserted, or locked and moved; its seq is
// drawn only once the lock is held (in the DO UPDATE), so it is larger
// than the seq of the event before, whose transaction has committed by
// then. Heads are taken in sorted order, so two multi-event appends never
// deadlock.
#define OUTBOX_WRITER_APPEND_CTES                                            \
  "h AS (INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, "      \
  "last_seq) SELECT aggregate_type, aggregate_id, "                          \
  "nextval('outbox_seq_seq') FROM input ORDER BY aggregate_type, "           \
  "aggregate_id ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET "   \
  "prev_seq = h.last_seq, last_seq = nextval('outbox_seq_seq') "             \
  "RETURNING h.aggregate_type, h.aggregate_id, h.last_seq, h.prev_seq), "    \
  "e AS (INSERT INTO outbox (seq, event_id, aggregate_type, aggregate_id, "  \
  "prev_seq, event_type, schema_version, payload, trace_parent, partition) " \
  "SELECT h.last_seq, i.event_id, i.aggregate_type, i.aggregate_id, "        \
  "h.prev_seq, i.event_type, i.schema_version, decode(i.payload, 'hex'), "   \
  "NULLIF(i.trace_parent, ''), i.partition "                                 \
  "FROM input i JOIN h USING (aggregate_type, aggregate_id))"

struct WriterOptions {
  // Where Committed() sends NOTIFY (on a connection of its own); empty:
  // never, the relays then find events by polling only.
  std::string notify_url;
  DbSession session;
};

class Writer {
 public:
  explicit Writer(WriterOptions options = {});
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // InvalidArgument naming the field, with nothing written, for an event
  // that breaks the rules above or is too large to deliver. A database
  // error is thrown, as libpqxx throws it from any statement of `tx`.
  absl::StatusOr<Appended> Append(pqxx::transaction_base& tx,
                                  const NewEvent& event);

  // Append for many events, in as few statements as their aggregates allow
  // (one when no aggregate comes twice). Results in the order of `events`;
  // events of one aggregate chain in that order. All or none are valid.
  absl::StatusOr<std::vector<Appended>> AppendMany(
      pqxx::transaction_base& tx, const std::vector<NewEvent>& events);

  // Call after the transaction that appended committed: wakes the relays
  // soon (one NOTIFY per burst). Never blocks.
  void Committed();

  // Refuses, as the outbox's unique key does (pqxx::unique_violation,
  // thrown), an event_id among `events` that a retained event carries; on
  // a partitioned outbox that key holds per child only, and this check
  // (outbox_event_ids_free) holds for all of them until `tx` ends. Append
  // and AppendMany call it; no statement when no event gives its id.
  static void CheckGivenIds(pqxx::transaction_base& tx,
                            const std::vector<const NewEvent*>& events);

  // The checks Append makes, without a database.
  static absl::Status Validate(const NewEvent& event);

  // `events` as the parameters of OUTBOX_WRITER_APPEND_CTES's input; the
  // checks of Append, and each aggregate at most once (InvalidArgument
  // naming the event otherwise). Call Committed() after the commit. When
  // an event carries a given event_id, call CheckGivenIds in `tx` before
  // the appending statement.
  static absl::StatusOr<EventRows> Rows(const std::vector<NewEvent>& events);
  // The same, without copying the events.
  static absl::StatusOr<EventRows> Rows(
      const std::vector<const NewEvent*>& events);

 private:
  // Validate for each event; an error names the event when there are
  // several.
  static absl::Status ValidateEach(const std::vector<const NewEvent*>& events);
  // The rows of events already checked.
  static EventRows RowsOf(const std::vector<const NewEvent*>& events);

  std::unique_ptr<Notifier> notifier_;
};

}  // namespace outbox
