#include "inbox/engine.h"

#include <spdlog/spdlog.h>

#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/fault.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/server.h"
#include "common/sql_state.h"
#include "common/text.h"
#include "inbox/envelope.h"

namespace outbox::inbox {
namespace {

constexpr char kBatchesWrittenHelp[] =
    "Batches committed, by how they were written: foreseen (each event next "
    "in its chain, nothing held: written by the statement that locks the "
    "chains) or planned (cursors read, then written).";

// Advisory lock class (first key) of a chain's apply lock; the second key
// is hashtext(aggregate_id): the chains of one id share it.
constexpr int kAggregateLockClass = 0x0b10;

// Locks every aggregate of the batch for the rest of the transaction, in
// sorted order (so replicas never deadlock), and reads their cursors (none
// yet: cursor 0). Holding and applying serialize on these locks, so two
// consumer replicas never strand a held event. A transaction-scoped
// advisory lock needs no row, so a new aggregate's cursor is written once,
// at the end, instead of inserted, locked and updated.
//
// Both in one round trip, by a function of the inbox schema
// (outbox_inbox_lock_cursors, common/schema.cc) that reads the cursors with
// a snapshot taken once the locks are held: a statement that first waited
// for a lock would see the data as of its start, miss what the lock's
// holder just committed (a held event, say), and strand it.
//
// The lookups by key, there and in InInbox, are LATERAL subqueries with
// LIMIT 1, which the planner cannot flatten into a join: a cached generic
// plan, made while a table is still empty, would otherwise be a hash join
// over a sequential scan, kept as the table grows (one scan of every
// aggregate's cursor per batch). With the LIMIT it is a lookup per key,
// which the index wins even on an empty table's estimates.
// One chain's cursor, as outbox_inbox_lock_chains and
// outbox_inbox_apply_chains return it, into `snap`.
void TakeCursor(const pqxx::row& row, Snapshot* snap) {
  snap->aggregates[ChainKey(row["source"].as<std::string>(),
                            row["aggregate_type"].as<std::string>(),
                            row["aggregate_id"].as<std::string>())] = {
      row["last_seq"].as<int64_t>(), row["held_count"].as<int64_t>(),
      row["pruned_through"].as<int64_t>()};
}

void LockCursors(pqxx::work& tx, const std::set<std::string>& aggregates,
                 Snapshot* snap) {
  ChainColumns keys;
  for (const std::string& a : aggregates) {
    snap->aggregates[a] = {0, 0};
    keys.Add(a);
  }
  for (const auto& row : ExecPrepared(
           tx, "lock_read_chains",
           "SELECT * FROM outbox_inbox_lock_chains($1::text[], $2::text[], "
           "$3::text[], $4)",
           keys.source.str(), keys.type.str(), keys.id.str(),
           kAggregateLockClass)) {
    TakeCursor(row, snap);
  }
}

// The held events `q` asks for: the chains from its links (each link's
// event, then its successor's, ...), and those at its positions or ids. A
// held event may come more than once; the planner reads each once.
absl::Status ReadHeld(pqxx::work& tx, const HeldQuery& q, Snapshot* snap) {
  ChainColumns link, pos;
  ArrayLiteral link_prev, pos_seq;
  for (const auto& [a, p] : q.links) {
    link.Add(a);
    link_prev.Add(p);
  }
  for (const auto& [a, s] : q.positions) {
    pos.Add(a);
    pos_seq.Add(s);
  }
  // A row's chain is its columns' (a row held before chains had a source
  // kept none in its payload, and took its chain over with its cursor).
  for (const auto& row : ExecPrepared(
           tx, "read_held_chains",
           "WITH RECURSIVE chain AS ("
           " SELECT h.event_id, h.source, h.aggregate_type, h.aggregate_id,"
           " h.seq FROM held_events h"
           " JOIN unnest($1::text[], $2::text[], $3::text[], $4::bigint[])"
           " AS l(s, t, a, p) ON h.source = l.s AND h.aggregate_type = l.t"
           " AND h.aggregate_id = l.a AND h.prev_seq = l.p"
           " UNION ALL"
           " SELECT h.event_id, h.source, h.aggregate_type, h.aggregate_id,"
           " h.seq FROM held_events h JOIN chain c ON h.source = c.source"
           " AND h.aggregate_type = c.aggregate_type"
           " AND h.aggregate_id = c.aggregate_id AND h.prev_seq = c.seq) "
           "SELECT source, aggregate_type, payload FROM held_events WHERE "
           "event_id IN (SELECT event_id FROM chain) "
           "UNION ALL SELECT source, aggregate_type, payload FROM held_events "
           "WHERE event_id = ANY($5::uuid[]) "
           "UNION ALL SELECT h.source, h.aggregate_type, h.payload FROM "
           "held_events h JOIN unnest($6::text[], $7::text[], $8::text[], "
           "$9::bigint[]) AS q(s, t, a, n) ON h.source = q.s AND "
           "h.aggregate_type = q.t AND h.aggregate_id = q.a AND h.seq = q.n",
           link.source.str(), link.type.str(), link.id.str(), link_prev.str(),
           ArrayLiteral(q.ids).str(), pos.source.str(), pos.type.str(),
           pos.id.str(), pos_seq.str())) {
    v1::Event h;
    if (!h.ParseFromString(pqxx::binarystring(row[2]).str())) {
      return absl::DataLossError("a row of held_events is unreadable");
    }
    h.set_source(row[0].as<std::string>());
    h.set_aggregate_type(row[1].as<std::string>());
    snap->held.push_back(std::move(h));
  }
  return absl::OkStatus();
}

std::map<std::string, InboxPlace> InInbox(
    pqxx::work& tx, const std::vector<std::string>& ids) {
  std::map<std::string, InboxPlace> found;
  if (ids.empty()) return found;
  for (const auto& row : ExecPrepared(
           tx, "in_inbox",
           "SELECT i.event_id::text AS event_id, i.aggregate_id::text AS "
           "aggregate_id, i.seq FROM unnest($1::uuid[]) AS e JOIN LATERAL "
           "(SELECT event_id, aggregate_id, seq FROM inbox WHERE event_id = e "
           "LIMIT 1) i ON true",
           ArrayLiteral(ids).str())) {
    found[row["event_id"].as<std::string>()] = {
        row["aggregate_id"].as<std::string>(), row["seq"].as<int64_t>()};
  }
  return found;
}

// The inbox rows of a batch: $1-$7 event_id, source, aggregate_type,
// aggregate_id, seq, event_type, occurred_at.
#define OUTBOX_INSERT_INBOX                                                \
  "INSERT INTO inbox (event_id, source, aggregate_type, aggregate_id, "    \
  "seq, event_type, occurred_at) SELECT * FROM unnest($1::uuid[], "        \
  "$2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], "         \
  "$7::timestamptz[]) ON CONFLICT DO NOTHING"
// The new cursors and held counts of chains: $N-$N+2 source,
// aggregate_type, aggregate_id, $N+3 last_seq, $N+4 held_count.
#define OUTBOX_UPSERT_CURSORS(s, t, a, b, c)                                \
  "INSERT INTO aggregate_cursors (source, aggregate_type, aggregate_id, "   \
  "last_seq, held_count) SELECT * FROM unnest(" s "::text[], " t            \
  "::text[], " a "::text[], " b "::bigint[], " c "::int[]) "                \
  "ON CONFLICT (source, aggregate_type, aggregate_id) DO UPDATE SET "       \
  "last_seq = EXCLUDED.last_seq, held_count = EXCLUDED.held_count, "        \
  "updated_at = now()"

struct InboxRows {
  ArrayLiteral ev, seq, type, at;
  ChainColumns chain;
  explicit InboxRows(const std::vector<const v1::Event*>& events) {
    for (const v1::Event* e : events) {
      ev.Add(e->event_id());
      chain.Add(*e);
      seq.Add(e->seq());
      type.Add(e->event_type());
      at.Add(SqlTimestamp(e->occurred_at()));
    }
  }
};

struct CursorRows {
  ChainColumns chain;
  ArrayLiteral last, held;
  explicit CursorRows(const std::map<std::string, AggregateState>& changed) {
    for (const auto& [a, st] : changed) {
      chain.Add(a);
      last.Add(st.cursor);
      held.Add(st.held_count);
    }
  }
};

// What inserting a batch's inbox rows did: whether every row went in (else
// some event id or position was there already, and nothing of the batch
// may commit), and the apply_id numbers they took.
struct Inserted {
  bool all = false;
  int64_t from = 0, through = 0;
};

// Inserts the inbox rows of `events`.
Inserted InsertInbox(pqxx::work& tx,
                     const std::vector<const v1::Event*>& events) {
  const InboxRows r(events);
  const pqxx::result ids = ExecPrepared(
      tx, "insert_inbox_chains", OUTBOX_INSERT_INBOX " RETURNING apply_id",
      r.ev.str(), r.chain.source.str(), r.chain.type.str(), r.chain.id.str(),
      r.seq.str(), r.type.str(), r.at.str());
  Inserted out;
  out.all = ids.size() == events.size();
  for (const auto& row : ids) {
    const int64_t id = row[0].as<int64_t>();
    out.from = out.from == 0 ? id : std::min(out.from, id);
    out.through = std::max(out.through, id);
  }
  return out;
}

// InsertInbox and UpdateCursors in one statement (one round trip), for a
// batch that holds, drains and passes no held event.
Inserted InsertInboxAndCursors(
    pqxx::work& tx, const std::vector<const v1::Event*>& events,
    const std::map<std::string, AggregateState>& changed) {
  const InboxRows r(events);
  const CursorRows c(changed);
  const pqxx::row inserted =
      ExecPrepared(
          tx, "insert_inbox_cursors_chains",
          "WITH i AS (" OUTBOX_INSERT_INBOX
          " RETURNING apply_id), c AS (" OUTBOX_UPSERT_CURSORS(
              "$8", "$9", "$10", "$11", "$12") ") SELECT count(*), "
                                               "coalesce(min(apply_id), 0), "
                                               "coalesce(max(apply_id), 0) "
                                               "FROM i",
          r.ev.str(), r.chain.source.str(), r.chain.type.str(),
          r.chain.id.str(), r.seq.str(), r.type.str(), r.at.str(),
          c.chain.source.str(), c.chain.type.str(), c.chain.id.str(),
          c.last.str(), c.held.str())[0];
  return {inserted[0].as<size_t>() == events.size(), inserted[1].as<int64_t>(),
          inserted[2].as<int64_t>()};
}

// LockCursors and, if each chain stands where `foreseen` says, the
// batch's inbox rows and new cursors, in one call (one round trip) to a
// function of the inbox schema (outbox_inbox_apply_chains,
// common/schema.cc). Fills `snap` as LockCursors does, with the cursors as
// they were; returns whether it wrote, and `inserted` the apply_ids taken.
bool LockCursorsAndWrite(pqxx::work& tx, const std::set<std::string>& aggregates,
                         const std::vector<const v1::Event*>& events,
                         const Foreseen& foreseen, Snapshot* snap,
                         Inserted* inserted) {
  ChainColumns keys;
  ArrayLiteral from, through;
  for (const std::string& a : aggregates) {
    snap->aggregates[a] = {0, 0};
    keys.Add(a);
    const Foreseen::Chain& c = foreseen.chains.at(a);
    from.Add(c.from);
    through.Add(c.through);
  }
  const InboxRows r(events);
  bool wrote = false;
  for (const auto& row : ExecPrepared(
           tx, "lock_write_chains",
           "SELECT * FROM outbox_inbox_apply_chains($1::text[], $2::text[], "
           "$3::text[], $4, $5::bigint[], $6::bigint[], $7::uuid[], "
           "$8::text[], $9::text[], $10::text[], $11::bigint[], $12::text[], "
           "$13::timestamptz[])",
           keys.source.str(), keys.type.str(), keys.id.str(),
           kAggregateLockClass, from.str(), through.str(), r.ev.str(),
           r.chain.source.str(), r.chain.type.str(), r.chain.id.str(),
           r.seq.str(), r.type.str(), r.at.str())) {
    TakeCursor(row, snap);
    inserted->from = row["applied_from"].as<int64_t>();
    inserted->through = row["applied_through"].as<int64_t>();
    wrote = inserted->from != 0;  // the same on every row
  }
  inserted->all = wrote;
  return wrote;
}

void InsertHeld(pqxx::work& tx, const std::vector<const v1::Event*>& events) {
  ArrayLiteral ev, seq, prev, pay;
  ChainColumns chain;
  for (const v1::Event* e : events) {
    ev.Add(e->event_id());
    chain.Add(*e);
    seq.Add(e->seq());
    prev.Add(e->prev_seq());
    pay.AddHex(e->SerializeAsString());
  }
  ExecPrepared(
      tx, "insert_held_chains",
      "INSERT INTO held_events (event_id, source, aggregate_type, "
      "aggregate_id, seq, prev_seq, payload) SELECT e, c, t, a, s, p, "
      "decode(h, 'hex') FROM unnest($1::uuid[], $2::text[], $3::text[], "
      "$4::text[], $5::bigint[], $6::bigint[], $7::text[]) AS t(e, c, t, a, "
      "s, p, h)",
      ev.str(), chain.source.str(), chain.type.str(), chain.id.str(),
      seq.str(), prev.str(), pay.str());
}

// Deletes the held events that the chains of `changed` passed: they were
// held for a position another event took (a fork, or a forgery), and can
// never apply. Their aggregates' held counts go down by as many. Returns
// their ids.
std::vector<std::string> DeletePassedHeld(
    pqxx::work& tx, const std::map<std::string, AggregateState>& before,
    std::map<std::string, AggregateState>* changed) {
  ChainColumns chain;
  ArrayLiteral cursor;
  for (const auto& [a, st] : *changed) {
    if (before.at(a).held_count == 0 || st.held_count == 0) continue;
    chain.Add(a);
    cursor.Add(st.cursor);
  }
  std::vector<std::string> gone;
  if (chain.id.empty()) return gone;
  for (const auto& row : ExecPrepared(
           tx, "delete_passed_held_chains",
           "DELETE FROM held_events h USING unnest($1::text[], $2::text[], "
           "$3::text[], $4::bigint[]) AS m(c, t, a, s) WHERE h.source = m.c "
           "AND h.aggregate_type = m.t AND h.aggregate_id = m.a AND h.seq <= "
           "m.s RETURNING h.source, h.aggregate_type, h.aggregate_id, "
           "h.event_id::text",
           chain.source.str(), chain.type.str(), chain.id.str(),
           cursor.str())) {
    --(*changed)[ChainKey(row[0].as<std::string>(), row[1].as<std::string>(),
                          row[2].as<std::string>())]
          .held_count;
    gone.push_back(row[3].as<std::string>());
  }
  return gone;
}

void UpdateCursors(pqxx::work& tx,
                   const std::map<std::string, AggregateState>& changed) {
  const CursorRows c(changed);
  ExecPrepared(tx, "upsert_cursors_chains",
               OUTBOX_UPSERT_CURSORS("$1", "$2", "$3", "$4", "$5"),
               c.chain.source.str(), c.chain.type.str(), c.chain.id.str(),
               c.last.str(), c.held.str());
}

#undef OUTBOX_INSERT_INBOX
#undef OUTBOX_UPSERT_CURSORS

}  // namespace

void ChainColumns::Add(const std::string& key) {
  ChainView c;
  ParseChainKey(key, &c);
  source.Add(c.source);
  type.Add(c.type);
  id.Add(c.id);
}

void ChainColumns::Add(const v1::Event& e) {
  source.Add(e.source());
  type.Add(e.aggregate_type());
  id.Add(e.aggregate_id());
}

void LockAggregates(pqxx::transaction_base& tx,
                    const std::set<std::string>& chains) {
  std::set<std::string> ids;
  for (const std::string& key : chains) {
    ChainId c;
    ParseChainKey(key, &c);
    ids.insert(c.id);
  }
  ExecPrepared(tx, "lock_aggregates",
               "SELECT pg_advisory_xact_lock($2, hashtext(a)) "
               "FROM unnest($1::text[]) AS a",
               ArrayLiteral(ids).str(), kAggregateLockClass);
}

Engine::Engine(Database* db, Handler* handler, Metrics* metrics,
               EngineOptions options, Watchdog* watchdog)
    : db_(db),
      handler_(handler),
      options_(options),
      watchdog_(watchdog),
      apply_seconds_(metrics->AddHistogram(
          "outbox_consumer_apply_seconds",
          "One batch's transaction: locks, reads, the handler's writes, "
          "commit.",
          Histogram::LatencyBuckets())),
      latency_seconds_(metrics->AddHistogram(
          "outbox_consumer_event_latency_seconds",
          "From an event's occurred_at (its commit in the outbox, give or "
          "take the producer's clock) to its effect's commit here.",
          Histogram::LatencyBuckets())),
      applied_(metrics->AddCounter(
          "outbox_consumer_events_total{outcome=\"applied\"}",
          "Events answered, by outcome.")),
      duplicates_(metrics->AddCounter(
          "outbox_consumer_events_total{outcome=\"duplicate\"}",
          "Events answered, by outcome.")),
      held_(
          metrics->AddCounter("outbox_consumer_events_total{outcome=\"held\"}",
                              "Events answered, by outcome.")),
      rejected_(metrics->AddCounter(
          "outbox_consumer_events_total{outcome=\"rejected\"}",
          "Events answered, by outcome.")),
      deferred_(metrics->AddCounter(
          "outbox_consumer_events_total{outcome=\"deferred\"}",
          "Events answered, by outcome.")),
      diverged_(metrics->AddCounter(
          "outbox_consumer_events_total{outcome=\"diverged\"}",
          "Events answered, by outcome.")),
      drained_(metrics->AddCounter(
          "outbox_consumer_held_applied_total",
          "Held events applied once their predecessor arrived.")),
      position_reused_(metrics->AddCounter(
          "outbox_consumer_position_reused_total",
          "Events answered DIVERGED because the outbox reused a position "
          "this consumer had passed with another event (a restored backup, "
          "a failover that lost writes).")),
      forks_(metrics->AddCounter(
          "outbox_consumer_forks_total",
          "Events REJECTED because another event already holds their link "
          "or position in the chain.")),
      over_cap_(
          metrics->AddCounter("outbox_consumer_held_cap_rejections_total",
                              "Events REJECTED because their aggregate holds "
                              "--max_held_per_aggregate events.")),
      discarded_(metrics->AddCounter(
          "outbox_consumer_held_discarded_total",
          "Held events dropped because their aggregate's chain passed their "
          "position with another event (a fork), or their id was applied "
          "elsewhere.")),
      unavailable_(metrics->AddCounter(
          "outbox_consumer_batches_unavailable_total",
          "Batches not answered because the database failed for a reason "
          "that is not the events' (read-only, full, timeout, ...).")),
      foreseen_(metrics->AddCounter(
          "outbox_consumer_batches_total{write=\"foreseen\"}",
          kBatchesWrittenHelp)),
      planned_(metrics->AddCounter(
          "outbox_consumer_batches_total{write=\"planned\"}",
          kBatchesWrittenHelp)),
      refused_held_(metrics->AddCounter(
          "outbox_consumer_held_refused_total",
          "Times the handler refused a held event as it drained; it stays "
          "held, and its aggregate waits behind it.")) {}

void Engine::Count(const Attempt& attempt,
                   const std::vector<const v1::Event*>& events) {
  const Plan& plan = attempt.plan;
  applied_->Add(plan.applied);
  duplicates_->Add(plan.duplicates);
  held_->Add(plan.held);
  deferred_->Add(plan.deferred);
  diverged_->Add(plan.diverged);
  rejected_->Add(plan.rejected);
  drained_->Add(plan.drained);
  position_reused_->Add(plan.position_reused);
  forks_->Add(plan.forks);
  over_cap_->Add(plan.over_cap);
  discarded_->Add(plan.discarded + attempt.passed_held.size());
  for (const std::string& id : attempt.passed_held) {
    spdlog::warn(
        "consumer: held event {} discarded: its aggregate's chain "
        "passed its position with another event (a fork)",
        id);
  }
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < plan.results.size() && i < events.size(); ++i) {
    const v1::EventResult& r = plan.results[i];
    if (r.outcome() == v1::APPLIED && events[i]->has_occurred_at()) {
      latency_seconds_->Observe(std::max(
          0.0, absl::ToDoubleSeconds(now -
                                     FromTimestamp(events[i]->occurred_at()))));
    }
    if (r.outcome() == v1::REJECTED) {
      LogEventScope scope(FieldsOf(*events[i]));
      spdlog::warn("consumer: event {} REJECTED: {}", r.event_id(), r.reason());
    } else if (r.outcome() == v1::DIVERGED) {
      LogEventScope scope(FieldsOf(*events[i]));
      spdlog::error("consumer: event {} DIVERGED: {}", r.event_id(),
                    r.reason());
    }
  }
}

absl::StatusOr<std::vector<v1::EventResult>> Engine::ApplyBatch(
    const std::vector<const v1::Event*>& events, BatchOrigin* origin) {
  std::vector<std::string> invalid(events.size());
  for (size_t i = 0; i < events.size(); ++i) {
    absl::Status s = ValidateEnvelope(*events[i]);
    if (s.ok()) s = handler_->Validate(*events[i]);
    if (!s.ok()) invalid[i] = std::string(s.message());
  }
  if (watchdog_ != nullptr) watchdog_->Working();
  auto results = ApplyValidated(events, invalid, origin, AttemptOptions());
  if (watchdog_ != nullptr) {
    if (results.ok()) {
      watchdog_->Done();
    } else {
      watchdog_->Failed(results.status());
    }
  }
  return results;
}

absl::StatusOr<std::vector<v1::EventResult>> Engine::ApplyValidated(
    const std::vector<const v1::Event*>& events,
    std::vector<std::string> invalid, BatchOrigin* origin,
    AttemptOptions options) {
  absl::StatusOr<Attempt> attempt;
  std::vector<std::string> drained;
  // Each refusal, and each held event charged, removes an event from the
  // next attempt, so this ends.
  for (int conflicts = 0;;) {
    attempt = ApplyOnce(events, invalid, options, origin, &drained);
    if (attempt.ok() && attempt->unforeseen) {
      // Foresee and PlanBatch disagree: a fault of this code, not of the
      // events. The batch goes the usual way.
      spdlog::error(
          "consumer: a batch's plan was not the foreseen one; applying it "
          "the usual way");
      options.foresee = false;
      continue;
    }
    if (attempt.ok() && attempt->inbox_collision &&
        !options.ask_inbox_about_all) {
      options.ask_inbox_about_all = true;  // an id the plan did not know
      continue;
    }
    if (attempt.ok() && !attempt->refused.empty()) {
      bool progress = false;
      for (const auto& [id, reason] : attempt->refused) {
        bool in_batch = false;
        for (size_t i = 0; i < events.size(); ++i) {
          if (events[i]->event_id() == id && invalid[i].empty()) {
            invalid[i] = reason;
            in_batch = progress = true;
          }
        }
        if (!in_batch && options.keep_held.insert(id).second) {
          progress = true;
          if (absl::Status c = ChargeHeld(id, reason); !c.ok()) {
            attempt = c;
            break;
          }
          refused_held_->Add();
          spdlog::warn(
              "consumer: {} refused held event {} ({}); it stays "
              "held, charged with the failure",
              handler_->name(), id, reason);
        }
      }
      if (!attempt.ok()) break;
      if (progress) continue;
      attempt = absl::InternalError(
          "the handler refused events that were not in its batch");
      break;
    }
    if (!attempt.ok() && OriginOf(attempt.status()) == ErrorOrigin::kData &&
        !drained.empty()) {
      // A held event that drained may be the one whose data fails.
      auto culprit = FindHeldCulprit(events, invalid, options, drained,
                                     attempt.status());
      if (!culprit.ok()) {
        attempt = culprit.status();
      } else if (culprit->has_value()) {
        const auto& [id, why] = **culprit;
        options.keep_held.insert(id);
        if (absl::Status c = ChargeHeld(id, why); !c.ok()) {
          attempt = c;
          break;
        }
        refused_held_->Add();
        spdlog::warn("consumer: held event {} failed as it drained ({}); it "
                     "stays held, charged with the failure, and its "
                     "predecessor applies",
                     id, why);
        continue;
      }
    }
    if (!attempt.ok() && OriginOf(attempt.status()) == ErrorOrigin::kConflict &&
        ++conflicts <= options_.conflict_retries) {
      continue;
    }
    break;
  }
  if (attempt.ok() && attempt->inbox_collision) {
    // The inbox knows an event that neither the cursors nor a lookup by id
    // explain: never written by this code. Refuse rather than guess.
    attempt = absl::DataLossError(
        "inbox and aggregate cursors disagree; refusing the batch");
  }
  if (attempt.ok()) {
    Count(*attempt, events);
    return std::move(attempt->results);
  }
  const absl::Status& s = attempt.status();
  if (OriginOf(s) == ErrorOrigin::kData && !events.empty()) {
    if (events.size() > 1) {
      // One event carries data the database refuses. Apply one by one so
      // that only the culprit is rejected.
      spdlog::warn(
          "consumer: batch of {} events failed on its data ({}); "
          "applying them one by one",
          events.size(), s.ToString());
      std::vector<v1::EventResult> each;
      std::set<std::string> rejected;  // as in one plan: later events defer
      for (size_t i = 0; i < events.size(); ++i) {
        const v1::Event& e = *events[i];
        if (rejected.count(ChainKeyOf(e))) {
          v1::EventResult r;
          r.set_event_id(e.event_id());
          r.set_seq(e.seq());
          r.set_outcome(v1::DEFERRED);
          r.set_reason(
              "an earlier event of its aggregate in this batch was rejected");
          deferred_->Add();
          each.push_back(std::move(r));
          continue;
        }
        auto one = ApplyValidated({events[i]}, {invalid[i]}, origin, options);
        if (!one.ok()) return one.status();
        if ((*one)[0].outcome() == v1::REJECTED)
          rejected.insert(ChainKeyOf(e));
        each.push_back(std::move((*one)[0]));
      }
      return each;
    }
    rejected_->Add();
    v1::EventResult r;
    r.set_event_id(events[0]->event_id());
    r.set_seq(events[0]->seq());
    r.set_outcome(v1::REJECTED);
    // The full error is logged under the id PublicMessage gives it. A
    // handler's message may hold any bytes: the answer carries them as a
    // protobuf string, which must be valid UTF-8.
    r.set_reason(
        StorableText(absl::StrCat("cannot apply: ", PublicMessage(s)), 2000));
    LogEventScope scope(FieldsOf(*events[0]));
    spdlog::warn("consumer: event {} REJECTED: {}", r.event_id(), r.reason());
    return std::vector<v1::EventResult>{std::move(r)};
  }
  unavailable_->Add();
  return absl::UnavailableError(
      absl::StrCat("database (", ErrorOriginName(OriginOf(s)),
                   " error, not the events'): ", s.message()));
}

absl::StatusOr<Engine::Attempt> Engine::ApplyOnce(
    const std::vector<const v1::Event*>& events,
    const std::vector<std::string>& invalid, const AttemptOptions& options,
    BatchOrigin* origin, std::vector<std::string>* drained) {
  const std::set<std::string>& keep_held = options.keep_held;
  drained->clear();
  std::set<std::string> aggregates = options.release;
  for (size_t i = 0; i < events.size(); ++i) {
    if (invalid[i].empty()) aggregates.insert(ChainKeyOf(*events[i]));
  }
  // The common batch is written as its cursors are read, and planned after
  // as any other, to check that the plan is what was written.
  std::optional<Foreseen> foreseen;
  if (options.foresee && options.release.empty() && options.skip.empty() &&
      options.keep_held.empty() && !options.ask_inbox_about_all &&
      !options.dry_run) {
    foreseen = Foresee(events, invalid);
  }
  Attempt out;
  if (aggregates.empty()) {
    out.plan = PlanBatch(events, invalid, {}, options_.plan);
    out.results = out.plan.results;
    return out;
  }
  const absl::Time t0 = absl::Now();
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    out = Attempt{};
    drained->clear();
    Snapshot snap;
    snap.drain = options.release;
    DatabaseIdentity inbox;
    {
      const SessionInfo* info = SessionOf(c);
      if (info != nullptr) inbox = info->identity;
      const IdentityWatch* w = db_->session().identity_watch;
      if (info != nullptr && info->pooled && w != nullptr &&
          w->current().known()) {
        // Behind a pooler the server may change under the connection: the
        // identity read last (Database::Run reads it every few seconds).
        inbox = w->current();
      }
    }
    pqxx::work tx(c);
    ApplyLimits(tx);
    Inserted inserted;
    // Written, it left nothing for the steps below to read: no cursor
    // was passed (no inbox question) and none holds (no held question).
    const bool written =
        foreseen.has_value() && LockCursorsAndWrite(tx, aggregates, events,
                                                    *foreseen, &snap,
                                                    &inserted);
    if (!foreseen.has_value()) LockCursors(tx, aggregates, &snap);
    if (HeldQuery q = HeldQuestions(events, invalid, snap); !q.empty()) {
      if (absl::Status h = ReadHeld(tx, q, &snap); !h.ok()) return h;
      // A held row found by its event id may be of a chain this batch
      // does not touch (an id reused across chains): not the plan's.
      snap.held.erase(std::remove_if(snap.held.begin(), snap.held.end(),
                                     [&](const v1::Event& h) {
                                       return snap.aggregates.count(
                                                  ChainKeyOf(h)) == 0;
                                     }),
                      snap.held.end());
      if (!keep_held.empty()) {
        // Unseen, they are not drained: their chains stop before them.
        std::vector<v1::Event> seen;
        for (v1::Event& h : snap.held) {
          if (keep_held.count(h.event_id()) == 0) seen.push_back(std::move(h));
        }
        snap.held = std::move(seen);
      }
    }
    snap.in_inbox =
        InInbox(tx, InboxQuestions(events, invalid, snap,
                                   options.ask_inbox_about_all));
    bool skip_done = false;
    if (!options.skip.empty()) {
      // An operator's skip, in the transaction that drains what follows:
      // the held event at its aggregate's cursor is done without its effect
      // (an inbox row, so a redelivery is a DUPLICATE).
      auto it = std::find_if(snap.held.begin(), snap.held.end(),
                             [&](const v1::Event& h) {
                               return h.event_id() == options.skip;
                             });
      if (it != snap.held.end() &&
          it->prev_seq() == snap.aggregates[ChainKeyOf(*it)].cursor) {
        const v1::Event skipped = *it;
        snap.held.erase(std::remove_if(snap.held.begin(), snap.held.end(),
                                       [&](const v1::Event& h) {
                                         return h.event_id() == options.skip;
                                       }),
                        snap.held.end());
        if (!InsertInbox(tx, {&skipped}).all) {
          out.inbox_collision = true;
          return absl::OkStatus();  // rolled back
        }
        ExecPrepared(tx, "unhold",
                     "DELETE FROM held_events WHERE event_id = ANY($1::uuid[])",
                     ArrayLiteral(std::vector<std::string>{options.skip}).str());
        AggregateState& st = snap.aggregates[ChainKeyOf(skipped)];
        st.cursor = skipped.seq();
        st.held_count = std::max<int64_t>(0, st.held_count - 1);
        UpdateCursors(tx, {{ChainKeyOf(skipped), st}});
        skip_done = true;
      }
    }
    Plan plan = PlanBatch(events, invalid, snap, options_.plan);
    if (!snap.held.empty()) {  // the common batch reads no held event
      const std::set<const v1::Event*> own(events.begin(), events.end());
      for (const v1::Event* e : plan.apply) {
        if (own.count(e) == 0) drained->push_back(e->event_id());
      }
    }
    // The common batch (it applies events and touches no held one): its
    // cursors are written with its inbox rows, a round trip fewer.
    bool holding = !plan.hold.empty() || !plan.unhold.empty();
    for (const auto& [a, st] : snap.aggregates) holding |= st.held_count > 0;
    const bool cursors_with_inbox =
        written || (!plan.apply.empty() && !holding);
    if (written && !PlanIsForeseen(plan, events, *foreseen)) {
      out.unforeseen = true;
      return absl::OkStatus();  // rolled back
    }
    if (!plan.apply.empty()) {
      if (!written) {
        inserted = cursors_with_inbox
                       ? InsertInboxAndCursors(tx, plan.apply, plan.changed)
                       : InsertInbox(tx, plan.apply);
      }
      if (!inserted.all) {
        out.inbox_collision = true;
        return absl::OkStatus();  // rolled back
      }
      std::vector<Rejection> refused = handler_->Apply(tx, plan.apply);
      if (!refused.empty()) {
        for (const Rejection& r : refused) {
          if (r.index < plan.apply.size()) {
            out.refused[plan.apply[r.index]->event_id()] = r.reason;
          }
        }
        if (out.refused.empty()) {
          return absl::InternalError("the handler refused events out of range");
        }
        return absl::OkStatus();  // rolled back
      }
    }
    if (!plan.hold.empty()) InsertHeld(tx, plan.hold);
    if (!plan.unhold.empty()) {
      ExecPrepared(tx, "unhold",
                   "DELETE FROM held_events WHERE event_id = ANY($1::uuid[])",
                   ArrayLiteral(plan.unhold).str());
    }
    if (!cursors_with_inbox) {
      out.passed_held = DeletePassedHeld(tx, snap.aggregates, &plan.changed);
      if (!plan.changed.empty()) UpdateCursors(tx, plan.changed);
    }
    if (options.dry_run) {
      tx.abort();
      out.results = plan.results;
      return absl::OkStatus();  // `out.plan` stays empty: it points into snap
    }
    MaybeCrash("consumer.before_commit");
    tx.commit();
    (written ? foreseen_ : planned_)->Add();
    if (skip_done && options.skipped != nullptr) *options.skipped = true;
    if (origin != nullptr) {
      origin->inbox = inbox;
      origin->Add(inserted.from, inserted.through);
    }
    out.results = plan.results;
    plan.apply.clear();  // they point into `snap`, which ends here
    plan.hold.clear();
    out.plan = std::move(plan);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (!options.dry_run) {
    apply_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  return out;
}

absl::StatusOr<std::optional<std::pair<std::string, std::string>>>
Engine::FindHeldCulprit(const std::vector<const v1::Event*>& events,
                        const std::vector<std::string>& invalid,
                        const AttemptOptions& options,
                        const std::vector<std::string>& drained,
                        const absl::Status& failure) {
  // Whether a dry run that drains only drained[0, n) goes through; its
  // failure, if any, in `why`.
  auto fails = [&](size_t n, absl::Status* why) -> absl::StatusOr<bool> {
    AttemptOptions trial = options;
    trial.dry_run = true;
    for (size_t j = n; j < drained.size(); ++j) {
      trial.keep_held.insert(drained[j]);
    }
    std::vector<std::string> ignored;
    auto a = ApplyOnce(events, invalid, trial, nullptr, &ignored);
    if (a.ok()) {
      if (a->refused.empty()) return false;
      *why = absl::InvalidArgumentError(a->refused.begin()->second);
      return true;
    }
    if (OriginOf(a.status()) != ErrorOrigin::kData) return a.status();
    *why = a.status();
    return true;
  };
  absl::Status why;
  auto alone = fails(0, &why);
  if (!alone.ok()) return alone.status();
  if (*alone) return std::nullopt;  // the batch's own events fail
  // Draining all fails, none does not: the culprit is the first n whose
  // drain fails (each aggregate's chain drains in order, so any prefix of
  // `drained` is a set of chain prefixes).
  size_t lo = 1, hi = drained.size();
  absl::Status at_hi = failure;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    auto f = fails(mid, &why);
    if (!f.ok()) return f.status();
    if (*f) {
      hi = mid;
      at_hi = why;
    } else {
      lo = mid + 1;
    }
  }
  return std::make_pair(drained[lo - 1],
                        absl::StrCat("cannot apply as it drained: ",
                                     PublicMessage(at_hi)));
}

absl::Status Engine::ChargeHeld(const std::string& id,
                                const std::string& why) {
  return db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::work tx(c);
    ApplyLimits(tx);
    ExecPrepared(tx, "charge_held",
                 "UPDATE held_events SET attempts = attempts + 1, "
                 "last_error = $2, failed_at = now() WHERE event_id = $1",
                 id, StorableText(why, 2000));
    tx.commit();
    return absl::OkStatus();
  });
}

absl::Status Engine::ParkRefused(const v1::Event& event,
                                 const std::string& reason, int64_t attempts) {
  if (absl::Status v = ValidateEnvelope(event); !v.ok()) return v;
  std::string refused;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    refused.clear();
    pqxx::work tx(c);
    ApplyLimits(tx);
    // The chain's lock, as a batch takes it: without it, a batch that read
    // the cursor before this commits would write its held count back over
    // this one's, and never drain what this parks. The reads below start
    // after it is held. The row is made for the count's update.
    LockAggregates(tx, {ChainKeyOf(event)});
    tx.exec_params(
        "INSERT INTO aggregate_cursors (source, aggregate_type, aggregate_id) "
        "VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
        event.source(), event.aggregate_type(), event.aggregate_id());
    const pqxx::row cursor = tx.exec_params1(
        "SELECT last_seq, held_count, EXISTS (SELECT 1 FROM held_events WHERE "
        "event_id = $4) AS parked, EXISTS (SELECT 1 FROM inbox WHERE event_id "
        "= $4) AS applied FROM aggregate_cursors WHERE source = $1 AND "
        "aggregate_type = $2 AND aggregate_id = $3 FOR UPDATE",
        event.source(), event.aggregate_type(), event.aggregate_id(),
        event.event_id());
    if (cursor["parked"].as<bool>()) {
      tx.exec_params(
          "UPDATE held_events SET attempts = greatest(attempts, $2), "
          "last_error = $3, failed_at = coalesce(failed_at, now()) WHERE "
          "event_id = $1",
          event.event_id(), attempts, StorableText(reason, 2000));
      tx.commit();
      return absl::OkStatus();
    }
    if (cursor["applied"].as<bool>()) {
      refused = "its event_id is in the inbox";
    } else if (event.seq() <= cursor["last_seq"].as<int64_t>()) {
      refused = absl::StrCat("its chain passed seq ", event.seq());
    } else if (cursor["held_count"].as<int64_t>() >=
               options_.plan.max_held_per_aggregate) {
      refused = absl::StrCat("its aggregate holds ",
                             cursor["held_count"].as<int64_t>(), " events");
    }
    if (!refused.empty()) return absl::OkStatus();
    const pqxx::result in = tx.exec_params(
        "INSERT INTO held_events (event_id, source, aggregate_type, "
        "aggregate_id, seq, prev_seq, payload, attempts, last_error, "
        "failed_at) VALUES ($1, $2, $3, $4, $5, $6, decode($7, 'hex'), $8, "
        "$9, now()) ON CONFLICT DO NOTHING RETURNING event_id",
        event.event_id(), event.source(), event.aggregate_type(),
        event.aggregate_id(), event.seq(), event.prev_seq(),
        absl::BytesToHexString(event.SerializeAsString()), attempts,
        StorableText(reason, 2000));
    if (in.empty()) {
      refused = "another event holds its link or position";
      return absl::OkStatus();
    }
    tx.exec_params(
        "UPDATE aggregate_cursors SET held_count = held_count + 1, "
        "updated_at = now() WHERE source = $1 AND aggregate_type = $2 AND "
        "aggregate_id = $3",
        event.source(), event.aggregate_type(), event.aggregate_id());
    tx.commit();
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (!refused.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "event ", event.event_id(), " cannot be parked: ", refused));
  }
  refused_held_->Add();
  spdlog::warn(
      "consumer: event {} (seq {}) refused {} times ({}); parked as a failed "
      "held event: `outboxctl held --failed`, then release or skip it",
      event.event_id(), event.seq(), attempts, reason);
  return absl::OkStatus();
}

absl::StatusOr<HeldActionResult> Engine::NextHeld(const std::string& event_id,
                                                  const char* what) {
  if (!IsUuid(event_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("event_id: \"", event_id, "\" is not a UUID"));
  }
  HeldActionResult r;
  int64_t prev = 0;
  bool found = false;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::read_transaction tx(c);
    ApplyLimits(tx);
    const pqxx::result row = tx.exec_params(
        "SELECT h.event_id::text, h.aggregate_id, h.seq, h.prev_seq, "
        "coalesce(c.last_seq, 0), (SELECT count(*) FROM held_events x "
        "WHERE (x.source, x.aggregate_type, x.aggregate_id) = (h.source, "
        "h.aggregate_type, h.aggregate_id)), h.source, h.aggregate_type FROM "
        "held_events h LEFT JOIN aggregate_cursors c USING (source, "
        "aggregate_type, aggregate_id) WHERE h.event_id = $1",
        event_id);
    found = !row.empty();
    if (found) {
      r.event_id = row[0][0].as<std::string>();
      r.aggregate_id = row[0][1].as<std::string>();
      r.source = row[0][6].as<std::string>();
      r.aggregate_type = row[0][7].as<std::string>();
      r.seq = row[0][2].as<int64_t>();
      prev = row[0][3].as<int64_t>();
      r.cursor = row[0][4].as<int64_t>();
      r.held_before = row[0][5].as<int64_t>();
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (!found) {
    return absl::NotFoundError(
        absl::StrCat("event_id: no held event ", event_id, " here"));
  }
  if (prev != r.cursor) {
    return absl::FailedPreconditionError(absl::StrCat(
        "held event ", event_id, " (seq ", r.seq, " of aggregate ",
        ChainLabel(r.chain()), ") waits for the event after seq ", prev,
        ", which has not arrived (the aggregate is applied through seq ",
        r.cursor, "): a gap, not a failure; only the next event of a chain "
        "can be ", what));
  }
  return r;
}

absl::Status Engine::FinishAction(HeldActionResult* r, const char* action,
                                  const std::string& actor,
                                  const std::string& reason) {
  return db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::work tx(c);
    ApplyLimits(tx);
    const pqxx::row st = tx.exec_params1(
        "SELECT coalesce((SELECT last_seq FROM aggregate_cursors WHERE "
        "(source, aggregate_type, aggregate_id) = ($3, $4, $1)), 0), (SELECT "
        "count(*) FROM held_events WHERE (source, aggregate_type, "
        "aggregate_id) = ($3, $4, $1)), (SELECT coalesce(last_error, '') "
        "FROM held_events WHERE event_id = $2), EXISTS (SELECT 1 FROM "
        "held_events WHERE event_id = $2)",
        r->aggregate_id, r->event_id, r->source, r->aggregate_type);
    const int64_t before = r->cursor;
    r->cursor = st[0].as<int64_t>();
    r->held_left = st[1].as<int64_t>();
    const bool still_held = st[3].as<bool>();
    // Drained, or dropped as a fork the chain passed.
    r->drained = std::max<int64_t>(
        0, r->held_before - r->held_left -
               (std::string(action) == "skip" || !still_held ? 1 : 0));
    if (std::string(action) == "release") {
      r->applied = !still_held;
      if (still_held) r->last_error = st[2].as<std::string>();
    }
    const std::string outcome =
        still_held ? absl::StrCat("still held: ", r->last_error)
                   : absl::StrCat("cursor ", before, " -> ", r->cursor, ", ",
                                  r->drained, " drained");
    tx.exec_params(
        "INSERT INTO held_actions (event_id, aggregate_id, seq, action, actor, "
        "reason, outcome, source, aggregate_type) VALUES ($1, $2, $3, $4, $5, "
        "$6, $7, $8, $9)",
        r->event_id, r->aggregate_id, r->seq, action, actor, reason, outcome,
        r->source, r->aggregate_type);
    tx.commit();
    return absl::OkStatus();
  });
}

absl::StatusOr<HeldActionResult> Engine::ReleaseHeld(
    const std::string& event_id, const std::string& actor,
    const std::string& reason) {
  auto r = NextHeld(event_id, "released");
  if (!r.ok()) return r.status();
  if (absl::Status d = DrainAggregate(r->chain()); !d.ok()) return d;
  if (absl::Status s = FinishAction(&*r, "release", actor, reason); !s.ok()) {
    return s;
  }
  spdlog::warn("consumer: {} released held event {} ({}): {}", actor,
               event_id, reason,
               r->applied ? "applied" : "still held: " + r->last_error);
  return r;
}

absl::StatusOr<HeldActionResult> Engine::SkipHeld(const std::string& event_id,
                                                  const std::string& actor,
                                                  const std::string& reason) {
  auto r = NextHeld(event_id, "skipped");
  if (!r.ok()) return r.status();
  bool skipped = false;
  if (absl::Status d = DrainAggregate(r->chain(), event_id, &skipped);
      !d.ok()) {
    return d;
  }
  if (!skipped) {
    return absl::AbortedError(absl::StrCat(
        "held event ", event_id,
        " left held_events or its place while this skip ran; list again"));
  }
  if (absl::Status f = FinishAction(&*r, "skip", actor, reason); !f.ok()) {
    return f;
  }
  spdlog::warn("consumer: {} skipped held event {} (seq {} of aggregate {}; "
               "{}): its effect was never applied",
               actor, event_id, r->seq, ChainLabel(r->chain()), reason);
  return r;
}

absl::Status Engine::DrainAggregate(const std::string& chain,
                                    const std::string& skip, bool* skipped) {
  AttemptOptions options;
  options.release = {chain};
  options.skip = skip;
  options.skipped = skipped;
  return ApplyValidated({}, {}, nullptr, options).status();
}

}  // namespace outbox::inbox
