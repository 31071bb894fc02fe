#include "writer/writer.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/ids.h"
#include "common/limits.h"
#include "outbox/v1/event.pb.h"
#include "writer/notifier.h"

namespace outbox {
namespace {

// Appends events of distinct aggregates in one statement: the input from
// arrays, then the writer's CTEs (see OUTBOX_WRITER_APPEND_CTES in
// writer.h). Arrays, one element per event: $1 aggregate_type,
// $2 aggregate_id, $3 event_id, $4 event_type, $5 schema_version,
// $6 payload (hex), $7 trace_parent ('' for none), $8 partition.
constexpr char kAppendSql[] =
    "WITH input AS (SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[], "
    "$4::text[], $5::int[], $6::text[], $7::text[], $8::int[]) WITH "
    "ORDINALITY AS t(aggregate_type, aggregate_id, event_id, event_type, "
    "schema_version, payload, trace_parent, partition, "
    "n)), " OUTBOX_WRITER_APPEND_CTES
    " SELECT i.n, h.last_seq, h.prev_seq "
    "FROM input i JOIN h USING (aggregate_type, aggregate_id)";

absl::Status Bad(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

}  // namespace

NewEvent NewEvent::Of(std::string aggregate_type, std::string aggregate_id,
                      const google::protobuf::Message& message) {
  NewEvent e;
  e.aggregate_type = std::move(aggregate_type);
  e.aggregate_id = std::move(aggregate_id);
  e.event_type = message.GetDescriptor()->name();
  e.payload.PackFrom(message);
  return e;
}

Writer::Writer(WriterOptions options) {
  if (!options.notify_url.empty()) {
    notifier_ = std::make_unique<Notifier>(options.notify_url, options.session);
  }
}

Writer::~Writer() = default;

void Writer::Committed() {
  if (notifier_ != nullptr) notifier_->Poke();
}

absl::Status Writer::Validate(const NewEvent& e) {
  if (e.aggregate_type.empty() || e.aggregate_type.size() > 64) {
    return Bad("aggregate_type", "must be 1-64 bytes");
  }
  if (e.aggregate_id.empty() || e.aggregate_id.size() > 128) {
    return Bad("aggregate_id", "must be 1-128 bytes");
  }
  if (e.event_type.empty() || e.event_type.size() > 128) {
    return Bad("event_type", "must be 1-128 bytes");
  }
  if (e.schema_version < 1) return Bad("schema_version", "must be >= 1");
  if (!e.event_id.empty() && !IsUuid(e.event_id)) {
    return Bad("event_id", "must be a UUID (or empty for a new one)");
  }
  if (!e.trace_parent.empty() && !IsTraceParent(e.trace_parent)) {
    return Bad("trace_parent", "must be a W3C traceparent (or empty)");
  }
  // The envelope adds a few hundred bytes at most.
  if (e.payload.ByteSizeLong() + 1024 > kMaxEventBytes) {
    return Bad("payload", absl::StrCat("larger than an event may be (",
                                       kMaxEventBytes, " bytes)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Appended> Writer::Append(pqxx::transaction_base& tx,
                                        const NewEvent& event) {
  // A copy of one event is cheap next to the statement.
  auto all = AppendMany(tx, std::vector<NewEvent>{event});
  if (!all.ok()) return all.status();
  return std::move((*all)[0]);
}

absl::StatusOr<EventRows> Writer::Rows(const std::vector<NewEvent>& events) {
  std::vector<const NewEvent*> all;
  all.reserve(events.size());
  for (const NewEvent& e : events) all.push_back(&e);
  return Rows(all);
}

absl::StatusOr<EventRows> Writer::Rows(
    const std::vector<const NewEvent*>& events) {
  if (absl::Status s = ValidateEach(events); !s.ok()) return s;
  std::set<std::pair<std::string, std::string>> aggregates;
  for (size_t i = 0; i < events.size(); ++i) {
    const NewEvent& e = *events[i];
    if (!aggregates.emplace(e.aggregate_type, e.aggregate_id).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "events[", i, "].aggregate_id: \"", e.aggregate_id.substr(0, 128),
          "\" comes twice in one statement's events"));
    }
  }
  return RowsOf(events);
}

absl::Status Writer::ValidateEach(const std::vector<const NewEvent*>& events) {
  for (size_t i = 0; i < events.size(); ++i) {
    if (absl::Status s = Validate(*events[i]); !s.ok()) {
      if (events.size() == 1) return s;
      return absl::InvalidArgumentError(
          absl::StrCat("events[", i, "].", s.message()));
    }
  }
  return absl::OkStatus();
}

EventRows Writer::RowsOf(const std::vector<const NewEvent*>& events) {
  EventRows rows;
  ArrayLiteral type, id, event_id, event_type, version, payload, trace,
      partition;
  const absl::Time now = absl::Now();
  for (const NewEvent* ev : events) {
    const NewEvent& e = *ev;
    v1::Event stored;
    stored.set_event_id(e.event_id.empty() ? NewTimeOrderedUuid() : e.event_id);
    stored.set_aggregate_type(e.aggregate_type);
    stored.set_aggregate_id(e.aggregate_id);
    stored.set_event_type(e.event_type);
    stored.set_schema_version(e.schema_version);
    ToTimestamp(e.occurred_at == absl::InfinitePast() ? now : e.occurred_at,
                stored.mutable_occurred_at());
    stored.set_trace_parent(e.trace_parent);
    *stored.mutable_payload() = e.payload;
    rows.event_ids.push_back(stored.event_id());
    type.Add(e.aggregate_type);
    id.Add(e.aggregate_id);
    event_id.Add(stored.event_id());
    event_type.Add(e.event_type);
    version.Add(e.schema_version);
    payload.AddHex(stored.SerializeAsString());
    trace.Add(e.trace_parent);
    partition.Add(PartitionOf(e.aggregate_id));
  }
  rows.aggregate_type = type.str();
  rows.aggregate_id = id.str();
  rows.event_id = event_id.str();
  rows.event_type = event_type.str();
  rows.schema_version = version.str();
  rows.payload = payload.str();
  rows.trace_parent = trace.str();
  rows.partition = partition.str();
  return rows;
}

void Writer::CheckGivenIds(pqxx::transaction_base& tx,
                           const std::vector<const NewEvent*>& events) {
  ArrayLiteral given;
  for (const NewEvent* e : events) {
    if (!e->event_id.empty()) given.Add(e->event_id);
  }
  if (given.empty()) return;
  ExecPrepared(tx, "outbox_writer_ids_free",
               "SELECT outbox_event_ids_free($1::uuid[])", given.str());
}

absl::StatusOr<std::vector<Appended>> Writer::AppendMany(
    pqxx::transaction_base& tx, const std::vector<NewEvent>& events) {
  std::vector<const NewEvent*> all;
  all.reserve(events.size());
  for (const NewEvent& e : events) all.push_back(&e);
  if (absl::Status s = ValidateEach(all); !s.ok()) return s;
  CheckGivenIds(tx, all);
  std::vector<Appended> out(events.size());
  // Rounds: an aggregate at most once per statement (a head row can move
  // once per statement), its events in input order across rounds.
  std::map<std::pair<std::string, std::string>, int> seen;
  std::vector<std::vector<size_t>> rounds;
  for (size_t i = 0; i < events.size(); ++i) {
    const int round =
        seen[{events[i].aggregate_type, events[i].aggregate_id}]++;
    if (static_cast<size_t>(round) == rounds.size()) rounds.emplace_back();
    rounds[round].push_back(i);
  }
  for (const std::vector<size_t>& round : rounds) {
    std::vector<const NewEvent*> of_round;
    of_round.reserve(round.size());
    for (size_t i : round) of_round.push_back(all[i]);
    const EventRows rows = RowsOf(of_round);
    for (size_t k = 0; k < round.size(); ++k) {
      out[round[k]].event_id = rows.event_ids[k];
    }
    pqxx::result r = ExecPrepared(
        tx, "outbox_writer_append", kAppendSql, rows.aggregate_type,
        rows.aggregate_id, rows.event_id, rows.event_type, rows.schema_version,
        rows.payload, rows.trace_parent, rows.partition);
    for (const auto& row : r) {
      const size_t i = round[row[0].as<size_t>() - 1];
      out[i].seq = row[1].as<int64_t>();
      out[i].prev_seq = row[2].as<int64_t>();
    }
  }
  return out;
}

}  // namespace outbox
