#include "relay/outbox_row.h"

namespace outbox::relay {

bool EventFromRow(const pqxx::row& row, v1::Event* out) {
  const bool parsed = out->ParseFromString(pqxx::binarystring(row[8]).str());
  if (!parsed) out->Clear();
  out->set_seq(row[0].as<int64_t>());
  out->set_prev_seq(row[1].as<int64_t>());
  out->set_event_id(row[2].as<std::string>());
  out->set_aggregate_type(row[3].as<std::string>());
  out->set_aggregate_id(row[4].as<std::string>());
  out->set_event_type(row[5].as<std::string>());
  out->set_schema_version(row[6].as<int>());
  out->set_trace_parent(row[7].as<std::string>());
  return parsed;
}

}  // namespace outbox::relay
