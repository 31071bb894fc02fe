#include "consumer/audit.h"

#include "common/db.h"
#include "common/ids.h"

namespace outbox::consumer {
namespace {

const std::vector<Migration> kMigrations = {
    {1, "audit log", R"sql(
-- Every event received, in the order applied (each aggregate's in chain
-- order). payload is the event's payload as delivered (a serialized
-- google.protobuf.Any value), payload_type its type URL.
CREATE TABLE audit_log (
  event_id       uuid PRIMARY KEY,
  aggregate_type text NOT NULL,
  aggregate_id   text COLLATE "C" NOT NULL,
  seq            bigint NOT NULL,
  prev_seq       bigint NOT NULL,
  event_type     text NOT NULL,
  schema_version int NOT NULL,
  payload_type   text NOT NULL,
  payload        bytea NOT NULL,
  trace_parent   text,
  occurred_at    timestamptz,
  recorded_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX audit_log_aggregate_idx ON audit_log (aggregate_id, seq);
)sql"},
};

}  // namespace

const std::vector<Migration>& AuditHandler::migrations() const {
  return kMigrations;
}

absl::Status AuditHandler::Validate(const v1::Event&) const {
  return absl::OkStatus();
}

std::vector<inbox::Rejection> AuditHandler::Apply(
    pqxx::work& tx, const std::vector<const v1::Event*>& events) {
  ArrayLiteral id, type, agg, seq, prev, event_type, version, payload_type,
      payload, trace, at;
  for (const v1::Event* e : events) {
    id.Add(e->event_id());
    type.Add(e->aggregate_type());
    agg.Add(e->aggregate_id());
    seq.Add(e->seq());
    prev.Add(e->prev_seq());
    event_type.Add(e->event_type());
    version.Add(e->schema_version());
    if (!e->has_payload() &&
        !e->GetReflection()->GetUnknownFields(*e).empty()) {
      // Written before the envelope was domain-free: its payload is in
      // fields this envelope no longer names; keep the whole event.
      payload_type.Add("outbox.v1.Event");
      payload.AddHex(e->SerializeAsString());
    } else {
      payload_type.Add(e->payload().type_url());
      payload.AddHex(e->payload().value());
    }
    trace.Add(e->trace_parent());
    at.Add(SqlTimestamp(e->occurred_at()));
  }
  ExecPrepared(
      tx, "insert_audit",
      "INSERT INTO audit_log (event_id, aggregate_type, aggregate_id, seq, "
      "prev_seq, event_type, schema_version, payload_type, payload, "
      "trace_parent, occurred_at) SELECT e, t, a, s, p, et, v, pt, "
      "decode(pl, 'hex'), NULLIF(tp, ''), o FROM unnest($1::uuid[], "
      "$2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::text[], "
      "$7::int[], $8::text[], $9::text[], $10::text[], $11::timestamptz[]) "
      "AS x(e, t, a, s, p, et, v, pt, pl, tp, o)",
      id.str(), type.str(), agg.str(), seq.str(), prev.str(), event_type.str(),
      version.str(), payload_type.str(), payload.str(), trace.str(), at.str());
  return {};
}

}  // namespace outbox::consumer
