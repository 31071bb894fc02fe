#pragma once
// Reading outbox rows into events: the columns the relay and its admin API
// select, and the one place that turns them into an outbox.v1.Event.

#include <pqxx/pqxx>
#include <string>

#include "absl/strings/string_view.h"
#include "outbox/v1/event.pb.h"

namespace outbox::relay {

// Columns 0-8 of every query that reads events, of the outbox aliased `o`;
// more may follow.
inline constexpr char kEventColumns[] =
    "o.seq, o.prev_seq, o.event_id::text, o.aggregate_type, o.aggregate_id, "
    "o.event_type, o.schema_version, coalesce(o.trace_parent, ''), o.payload";
inline constexpr int kEventColumnCount = 9;

// The envelope columns of an outbox row.
struct EnvelopeColumns {
  int64_t seq = 0;
  int64_t prev_seq = 0;
  std::string event_id, aggregate_type, aggregate_id, event_type;
  int schema_version = 0;
  std::string trace_parent;
};

// Decodes `payload` (a serialized outbox.v1.Event, as stored) into `out`
// and sets the envelope from `columns`, which are authoritative (the stored
// payload has no seq: it is assigned on insert). False if the payload is
// not a valid Event; the envelope is set either way. Any bytes are safe.
bool DecodeEvent(const EnvelopeColumns& columns, absl::string_view payload,
                 v1::Event* out);

// `select`, a query whose rows begin with kEventColumns (a column `seq` and
// one `payload`) in seq order, cut where its payloads reach `budget` bytes:
// a row comes only while the payloads before it sum to less (the first
// always comes). So one read of large events holds about `budget` bytes,
// not its row limit times the largest event (and libpqxx's text form
// doubles each payload). The rows keep their columns, and two more at the
// end: payload_bytes_before, and rows_uncut (how many `select` returned:
// more than the rows here when the cut left some out).
std::string BoundedByPayloadBytes(absl::string_view select, int64_t budget);
// The same with the budget an SQL expression: a parameter ("$7::bigint"),
// so that one prepared statement serves every budget.
std::string BoundedByPayloadBytes(absl::string_view select,
                                  absl::string_view budget);

// DecodeEvent for `row`, selected with kEventColumns first.
bool EventFromRow(const pqxx::row& row, v1::Event* out);

}  // namespace outbox::relay
