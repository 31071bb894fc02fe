#include "relay/outbox_row.h"

#include "absl/strings/str_cat.h"

namespace outbox::relay {

bool DecodeEvent(const EnvelopeColumns& c, absl::string_view payload,
                 v1::Event* out) {
  const bool parsed =
      out->ParseFromArray(payload.data(), static_cast<int>(payload.size()));
  if (!parsed) out->Clear();
  out->set_seq(c.seq);
  out->set_prev_seq(c.prev_seq);
  out->set_event_id(c.event_id);
  out->set_aggregate_type(c.aggregate_type);
  out->set_aggregate_id(c.aggregate_id);
  out->set_event_type(c.event_type);
  out->set_schema_version(c.schema_version);
  out->set_trace_parent(c.trace_parent);
  return parsed;
}

std::string BoundedByPayloadBytes(absl::string_view select, int64_t budget) {
  return BoundedByPayloadBytes(select, absl::StrCat(budget));
}

std::string BoundedByPayloadBytes(absl::string_view select,
                                  absl::string_view budget) {
  return absl::StrCat(
      "SELECT * FROM (SELECT b.*, coalesce(sum(octet_length(b.payload)) OVER "
      "(ORDER BY b.seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) "
      "AS payload_bytes_before, count(*) OVER () AS rows_uncut FROM (",
      select, ") b) bounded WHERE payload_bytes_before < ", budget,
      " ORDER BY seq");
}

bool EventFromRow(const pqxx::row& row, v1::Event* out) {
  EnvelopeColumns c;
  c.seq = row[0].as<int64_t>();
  c.prev_seq = row[1].as<int64_t>();
  c.event_id = row[2].as<std::string>();
  c.aggregate_type = row[3].as<std::string>();
  c.aggregate_id = row[4].as<std::string>();
  c.event_type = row[5].as<std::string>();
  c.schema_version = row[6].as<int>();
  c.trace_parent = row[7].as<std::string>();
  const pqxx::binarystring payload(row[8]);
  return DecodeEvent(
      c,
      absl::string_view(reinterpret_cast<const char*>(payload.data()),
                        payload.size()),
      out);
}

}  // namespace outbox::relay
