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

// Appends events of distinct aggregates in one statement. Each aggregate's
// head row is inserted or locked and moved; its seq is drawn only once the
// lock is held (in the DO UPDATE), so it is larger than the seq of the
// event before, whose transaction has committed by then. Heads are taken
// in sorted order, so two multi-event appends never deadlock.
// Arrays, one element per event: $1 aggregate_type, $2 aggregate_id,
// $3 event_id, $4 event_type, $5 schema_version, $6 payload (hex),
// $7 trace_parent ('' for none), $8 partition.
constexpr char kAppendSql[] =
    "WITH input AS (SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[], "
    "$4::text[], $5::int[], $6::text[], $7::text[], $8::int[]) WITH "
    "ORDINALITY AS t(aggregate_type, aggregate_id, event_id, event_type, "
    "schema_version, payload, trace_parent, partition, n)), "
    "h AS (INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, "
    "last_seq) SELECT aggregate_type, aggregate_id, "
    "nextval('outbox_seq_seq') FROM input ORDER BY aggregate_type, "
    "aggregate_id ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET "
    "prev_seq = h.last_seq, last_seq = nextval('outbox_seq_seq') "
    "RETURNING h.aggregate_type, h.aggregate_id, h.last_seq, h.prev_seq), "
    "e AS (INSERT INTO outbox (seq, event_id, aggregate_type, aggregate_id, "
    "prev_seq, event_type, schema_version, payload, trace_parent, partition) "
    "SELECT h.last_seq, i.event_id, i.aggregate_type, i.aggregate_id, "
    "h.prev_seq, i.event_type, i.schema_version, decode(i.payload, 'hex'), "
    "NULLIF(i.trace_parent, ''), i.partition "
    "FROM input i JOIN h USING (aggregate_type, aggregate_id)) "
    "SELECT i.n, h.last_seq, h.prev_seq "
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

absl::StatusOr<std::vector<Appended>> Writer::AppendMany(
    pqxx::transaction_base& tx, const std::vector<NewEvent>& events) {
  for (size_t i = 0; i < events.size(); ++i) {
    if (absl::Status s = Validate(events[i]); !s.ok()) {
      if (events.size() == 1) return s;
      return absl::InvalidArgumentError(
          absl::StrCat("events[", i, "].", s.message()));
    }
  }
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
  const absl::Time now = absl::Now();
  for (const std::vector<size_t>& round : rounds) {
    ArrayLiteral type, id, event_id, event_type, version, payload, trace,
        partition;
    for (size_t i : round) {
      const NewEvent& e = events[i];
      v1::Event stored;
      stored.set_event_id(e.event_id.empty() ? NewTimeOrderedUuid()
                                             : e.event_id);
      stored.set_aggregate_type(e.aggregate_type);
      stored.set_aggregate_id(e.aggregate_id);
      stored.set_event_type(e.event_type);
      stored.set_schema_version(e.schema_version);
      ToTimestamp(e.occurred_at == absl::InfinitePast() ? now : e.occurred_at,
                  stored.mutable_occurred_at());
      stored.set_trace_parent(e.trace_parent);
      *stored.mutable_payload() = e.payload;
      out[i].event_id = stored.event_id();
      type.Add(e.aggregate_type);
      id.Add(e.aggregate_id);
      event_id.Add(stored.event_id());
      event_type.Add(e.event_type);
      version.Add(e.schema_version);
      payload.AddHex(stored.SerializeAsString());
      trace.Add(e.trace_parent);
      partition.Add(PartitionOf(e.aggregate_id));
    }
    pqxx::result r =
        ExecPrepared(tx, "outbox_writer_append", kAppendSql, type.str(),
                     id.str(), event_id.str(), event_type.str(), version.str(),
                     payload.str(), trace.str(), partition.str());
    for (const auto& row : r) {
      const size_t i = round[row[0].as<size_t>() - 1];
      out[i].seq = row[1].as<int64_t>();
      out[i].prev_seq = row[2].as<int64_t>();
    }
  }
  return out;
}

}  // namespace outbox
