#include "relay/marks.h"

#include <algorithm>
#include <array>
#include <map>
#include <set>
#include <stdexcept>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/db.h"
#include "common/fault.h"
#include "common/ids.h"
#include "common/schema.h"
#include "common/text.h"
#include "relay/delivery_store.h"
#include "relay/outbox_log.h"
#include "relay/policy.h"
#include "spdlog/spdlog.h"

namespace outbox::relay {
namespace {

// The reason stored with a row: a consumer's message, cut short, as
// PostgreSQL's text takes it (common/text.h).
std::string Stored(const std::string& reason) {
  return StorableText(reason, 2000);
}

// Deletes delivered rows: $1 the subscription, $2 and $3 MarkPlan's
// delivered and delivered_ids as array literals.
constexpr char kMarkDeliveredSql[] =
    "DELETE FROM outbox_delivery d USING "
    "unnest($2::bigint[], $3::uuid[]) AS k(s, e), outbox o "
    "WHERE d.subscription = $1 AND d.seq = k.s AND d.status = "
    "'pending' AND o.seq = k.s AND o.event_id = k.e";

}  // namespace

Answer AnswerOf(const InFlight& batch, const v1::DeliverResponse& response) {
  std::map<int64_t, const v1::EventResult*> by_seq;
  for (const v1::EventResult& r : response.results()) by_seq[r.seq()] = &r;
  Answer answer;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const int64_t seq = batch.seqs[i];
    const EventLogFields& event = batch.events[i];
    const std::string chain =
        OutboxChain(event.aggregate_type, event.aggregate_id);
    auto r = by_seq.find(seq);
    const v1::DeliveryOutcome outcome = r == by_seq.end()
                                            ? v1::DELIVERY_OUTCOME_UNSPECIFIED
                                            : r->second->outcome();
    Mark m{.seq = seq,
           .event_id = event.event_id,
           .chain = chain,
           .kind = Mark::kDelivered};
    m.from_log = batch.from_log;
    switch (outcome) {
      case v1::HELD:
        // Sent only once its predecessor was answered: the consumer lacks
        // events it had.
        if (batch.prev_seqs[i] > 0 &&
            r->second->applied_seq() < batch.prev_seqs[i]) {
          answer.reowe.push_back(
              {chain, r->second->applied_seq(), batch.prev_seqs[i]});
        }
        [[fallthrough]];
      case v1::APPLIED:
      case v1::DUPLICATE:
        break;
      case v1::REJECTED:
        m.kind = Mark::kRejected;
        m.reason = r->second->reason();
        m.log_fields = event;
        break;
      case v1::DIVERGED:
        m.kind = Mark::kDiverged;
        m.reason = r->second->reason();
        m.log_fields = event;
        m.applied_seq = r->second->applied_seq();
        break;
      default:
        if (!batch.from_log) {
          answer.unanswered.push_back(chain);
          continue;
        }
        m.kind = Mark::kOwed;
        m.log_fields = event;
    }
    answer.marks.push_back(std::move(m));
  }
  return answer;
}

MarkPlan PlanMarks(const std::vector<Mark>& marks) {
  MarkPlan plan;
  for (const Mark& m : marks) {
    plan.only_deliveries &= m.delivered();
    if (m.from_log) {
      if (!m.delivered()) plan.owed.push_back(m.seq);
      continue;
    }
    if (!m.delivered()) continue;
    plan.delivered.push_back(m.seq);
    plan.delivered_ids.push_back(m.event_id);
  }
  return plan;
}

MarkTally TallyMarks(const std::vector<Mark>& marks) {
  MarkTally tally;
  for (const Mark& m : marks) {
    tally.delivered += m.delivered() ? 1 : 0;
    tally.rejected += m.kind == Mark::kRejected ? 1 : 0;
    tally.rows_deleted += m.delivered() && !m.from_log ? 1 : 0;
  }
  return tally;
}

WrittenMarks WriteMarks(pqxx::transaction_base& tx,
                        const std::string& subscription,
                        const std::vector<Mark>& marks, const MarkPlan& plan,
                        const RejectPolicy& policy) {
  WrittenMarks written;
  if (!plan.delivered.empty()) {
    // Delivered: the row's work is done; deleting it writes no new row
    // version and leaves the claims a smaller table. A row goes only if
    // its event is the one answered.
    ExecPrepared(tx, "mark_delivered", kMarkDeliveredSql, subscription,
                 ArrayLiteral(plan.delivered).str(),
                 ArrayLiteral(plan.delivered_ids).str());
  }
  if (!plan.owed.empty()) {
    // Rows first: the rejections and divergences below are theirs.
    absl::StatusOr<int64_t> n = OweExceptions(tx, subscription, plan.owed);
    if (!n.ok()) throw std::runtime_error(n.status().ToString());
  }
  // Rejections and divergences, each kind in one statement whatever their
  // number (a failover's heal answers hundreds DIVERGED at once). A row is
  // marked only while pending and holding the event answered; one mark a
  // row (the first), as one statement updates a row once.
  std::vector<const Mark*> rejected, diverged;
  std::set<int64_t> seen;
  for (const Mark& m : marks) {
    if (m.kind != Mark::kRejected && m.kind != Mark::kDiverged) continue;
    if (!seen.insert(m.seq).second) continue;
    (m.kind == Mark::kRejected ? rejected : diverged).push_back(&m);
  }
  const auto arrays = [](const std::vector<const Mark*>& ms) {
    ArrayLiteral seqs, reasons, ids;
    for (const Mark* m : ms) {
      seqs.Add(m->seq);
      reasons.Add(Stored(m->reason));
      ids.Add(m->event_id);
    }
    return std::array<std::string, 3>{seqs.str(), reasons.str(), ids.str()};
  };
  if (!rejected.empty()) {
    // A rejected row backs off by RetryDelay after its attempts (the n-th
    // of $5 after the n-th failure; the last one beyond, long capped by
    // then): one schedule for the rows of this flush.
    ArrayLiteral delays;
    for (absl::Duration d :
         RetryDelays(policy.backoff, policy.backoff_max,
                     std::min(policy.max_attempts, kMaxCountedFailures),
                     RandomJitter)) {
      delays.Add(absl::StrCat(absl::ToDoubleSeconds(d)));
    }
    const auto [seqs, reasons, ids] = arrays(rejected);
    std::set<int64_t> dead;
    for (const auto& row : tx.exec_params(
             "UPDATE outbox_delivery d SET attempts = d.attempts + 1, "
             "last_error = m.reason, status = CASE WHEN d.attempts + 1 >= $3 "
             "THEN 'dead' ELSE 'pending' END, dead_at = CASE WHEN d.attempts "
             "+ 1 >= $3 THEN now() END, available_at = now() + "
             "make_interval(secs => ($4::float8[])[least(d.attempts + 1, "
             "cardinality($4::float8[]))]) FROM unnest($2::bigint[], "
             "$5::text[], $6::uuid[]) AS m(seq, reason, event_id) WHERE "
             "d.subscription = $1 AND d.seq = m.seq AND d.status = 'pending' "
             "AND EXISTS (SELECT 1 FROM outbox o WHERE o.seq = m.seq AND "
             "o.event_id = m.event_id) RETURNING d.seq, d.status",
             subscription, seqs, policy.max_attempts, delays.str(), reasons,
             ids)) {
      if (row["status"].as<std::string>() == kDeliveryDead) {
        dead.insert(row["seq"].as<int64_t>());
      }
    }
    for (const Mark* m : rejected) {
      if (!dead.count(m->seq)) continue;
      ++written.dead;
      LogEventScope scope(m->log_fields);
      spdlog::warn("relay: row {} is a dead letter: {}", m->seq, m->reason);
    }
  }
  if (!diverged.empty()) {
    // Not the event's fault, and no attempt: it waits, with its aggregate,
    // for an operator.
    const auto [seqs, reasons, ids] = arrays(diverged);
    std::set<int64_t> marked;
    for (const auto& row : tx.exec_params(
             "UPDATE outbox_delivery d SET status = 'diverged', last_error = "
             "m.reason FROM unnest($2::bigint[], $3::text[], $4::uuid[]) AS "
             "m(seq, reason, event_id) WHERE d.subscription = $1 AND d.seq = "
             "m.seq AND d.status = 'pending' AND EXISTS (SELECT 1 FROM outbox "
             "o WHERE o.seq = m.seq AND o.event_id = m.event_id) RETURNING "
             "d.seq",
             subscription, seqs, reasons, ids)) {
      marked.insert(row["seq"].as<int64_t>());
    }
    std::vector<NewDivergence> ds;
    std::vector<const Mark*> of;  // the mark of each of ds
    for (const Mark* m : diverged) {
      if (!marked.count(m->seq)) continue;
      NewDivergence d = NewDivergence::Of(subscription, m->chain);
      d.kind = absl::StartsWith(m->reason, "position reused")
                   ? "position_reused"
                   : "chain_broken";
      d.detail = m->reason;
      d.consumer_seq = m->applied_seq;
      d.outbox_seq = m->seq;
      d.outbox_event_id = m->event_id;
      ds.push_back(std::move(d));
      of.push_back(m);
    }
    const std::vector<bool> recorded = RecordDivergences(tx, ds);
    for (size_t i = 0; i < ds.size(); ++i) {
      if (recorded[i]) ++written.diverged;
      LogEventScope scope(of[i]->log_fields);
      spdlog::error(
          "relay: aggregate {} diverged at row {}: {}; it waits for an "
          "operator (outboxctl diverged, outboxctl resolve)",
          ChainLabel(of[i]->chain), of[i]->seq, of[i]->reason);
    }
  }
  return written;
}

absl::StatusOr<WrittenMarks> StoreMarks(pqxx::connection_base& conn,
                                        const std::string& subscription,
                                        const std::vector<Mark>& marks,
                                        const MarkPlan& plan,
                                        const RejectPolicy& policy) {
  try {
    std::unique_ptr<pqxx::transaction_base> tx;
    if (plan.only_deliveries) {
      MaybeCrash("relay.before_mark_commit");  // nothing written yet
      tx = OpenUnit(conn);
    } else {
      tx = std::make_unique<pqxx::work>(conn);
      ApplyLimits(*tx);
    }
    const WrittenMarks written =
        WriteMarks(*tx, subscription, marks, plan, policy);
    if (!plan.only_deliveries) MaybeCrash("relay.before_mark_commit");
    tx->commit();
    MaybeCrash("relay.after_mark_commit");
    return written;
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

}  // namespace outbox::relay
