#pragma once
// Reading outbox rows into events: the columns the relay and its admin API
// select, and the one place that turns them into an outbox.v1.Event.

#include <pqxx/pqxx>

#include "outbox/v1/event.pb.h"

namespace outbox::relay {

// Columns 0-8 of every query that reads events; more may follow.
inline constexpr char kEventColumns[] =
    "seq, prev_seq, event_id::text, aggregate_type, aggregate_id, "
    "event_type, schema_version, coalesce(trace_parent, ''), payload";
inline constexpr int kEventColumnCount = 9;

// Decodes the payload of `row` (selected with kEventColumns first) into
// `out` and sets the envelope from the columns, which are authoritative
// (the stored payload has no seq: it is assigned on insert). False if the
// payload is not a valid Event; the envelope is set either way.
bool EventFromRow(const pqxx::row& row, v1::Event* out);

}  // namespace outbox::relay
