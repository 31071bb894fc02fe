#pragma once
// The invariant checker shared by `outboxctl verify`, `scripts/up --demo`
// and the failure-injection suite. It reads the orders database (the truth
// of what was committed) and the billing database (what was applied) and
// reports each guarantee of DESIGN.md section 5.

#include <map>
#include <pqxx/pqxx>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/db.h"

namespace outbox::tools {

struct CheckReport {
  int64_t events = 0;             // committed outbox rows
  int64_t applied = 0;            // inbox rows
  int64_t dead_letters = 0;       // rows the relay gave up on
  int64_t behind_dead = 0;        // pending rows waiting behind a dead letter
  int64_t pending = 0;            // other undelivered rows
  int64_t held = 0;               // parked at the consumer
  int64_t lost = 0;               // I1: delivered or drained, never applied
  int64_t duplicate_effects = 0;  // I2: charges beyond one per paying event
  int64_t missing_effects = 0;    // I1 for effects: expected charge absent
  int64_t order_violations = 0;   // I3: applied out of the prev_seq chain
  int64_t phantoms = 0;           // I4: applied but never committed
  int64_t view_mismatches = 0;    // consumer's order view != producer's order
  // Retention, reported and not counted against anything: applied events
  // whose outbox row the relay's --retention deleted, and committed events
  // whose inbox row the consumer's --inbox_retention deleted (its
  // aggregate's cursor passed them).
  int64_t pruned_from_outbox = 0;
  int64_t pruned_from_inbox = 0;
  // Histories that diverged (a lossy failover, a restore), for an operator
  // to decide: aggregates with an open divergence (outbox_divergences), the
  // deliveries parked behind them, and applied events the outbox does not
  // hold that such a divergence names (not counted as phantoms).
  int64_t diverged = 0;
  int64_t diverged_events = 0;
  int64_t orphaned = 0;
  // Applied events an operator superseded while resolving a divergence
  // (inbox_superseded): their effects stay, recorded; not phantoms.
  int64_t superseded = 0;
  absl::Duration drain_time;  // I5: time until drained (or the wait)
  // Not drained either while a heal is due (a database changed under the
  // subscription): until a relay compared the consumer with the outbox,
  // what the consumer lost is not owed again nor what diverged recorded.
  // Its reason, "" when none is due.
  std::string heal_due;
  bool drained = false;
  double latency_p50_ms = 0, latency_p99_ms = 0;  // created -> applied
  std::vector<std::string> examples;  // the first violations, readable

  // Every invariant holds and nothing waits for an operator's decision
  // (dead letters are I6's business, reported apart).
  bool ok() const {
    return drained && lost == 0 && duplicate_effects == 0 &&
           missing_effects == 0 && order_violations == 0 && phantoms == 0 &&
           view_mismatches == 0 && diverged == 0;
  }
  // A multi-line summary for people.
  std::string Summary() const;
  // One JSON object, for scripts.
  std::string Json() const;
};

// What the checker reads of both databases, and all its verdict depends
// on. Chains are keyed as the relay keys them (OutboxChain: type and id).
struct CommittedEvent {
  std::string chain;
  std::string aggregate_id;
  int64_t seq = 0;
  int64_t prev_seq = 0;
  std::string type;    // event type
  std::string status;  // kDeliveryPending, kDeliveryDead, ... or "delivered"
  int64_t created_us = 0;
  int64_t refund_cents = 0;  // of an OrderCancelled
};
struct AppliedEvent {
  std::string event_id;
  std::string chain;
  std::string aggregate_id;
  int64_t seq = 0;
  int64_t applied_us = 0;
};
struct CheckFacts {
  // The subscription's committed events still in the outbox, by event id.
  std::map<std::string, CommittedEvent> committed;
  // The consumer's inbox rows of this outbox, in apply order.
  std::vector<AppliedEvent> applied;
  // The lowest seq the outbox still holds (retention deletes a prefix).
  int64_t retained_from = 1;
  std::map<std::string, std::string> order_status;  // orders: id -> status
  std::map<std::string, std::string> view_status;   // order_view
  std::map<std::string, int> charges_by_event;      // charges rows per event
  std::map<std::string, std::string> diverged;      // open: chain -> why
  // How far the consumer's inbox retention deleted each chain's rows (a
  // chain of type "" is every type of its id).
  std::map<std::string, int64_t> pruned_through;
  std::set<std::string> superseded;  // event ids an operator superseded
  int64_t held = 0;                  // held at the consumer
  std::string heal_due;              // CheckReport::heal_due
  bool drained = false;
  absl::Duration drain_time;
};

// The report those facts make: every count and example of CheckReport but
// the drain's, which it copies. A pure function (tools/checker_test.cc).
CheckReport Verdict(const CheckFacts& facts);

// Checks `subscription`'s deliveries (the events from its start on).
// Waits up to `wait` until nothing drainable is pending and nothing is held
// (rows behind a dead letter or a divergence cannot drain and are reported
// apart), then checks every invariant. Until it drained it cannot tell
// lost from late: `lost` then counts only what is known lost, and the
// report says the rest is unknown. Unavailable if a database cannot be
// read.
// The name an outbox's events carry (outbox_source), "" when none is
// recorded (no relay ran, or a release before sources).
std::string OutboxSourceName(pqxx::transaction_base& outbox);
// A condition on a consumer table's rows (columns prefixed by `prefix`,
// e.g. "t.") that holds for those of `source`: its own, and those without
// a source that it took over or nobody did yet (inbox_legacy_source);
// "true" for a consumer of a release before sources.
std::string RowsOfSource(pqxx::transaction_base& consumer,
                         const std::string& source, const std::string& prefix);

absl::StatusOr<CheckReport> Check(const std::string& orders_url,
                                  const std::string& billing_url,
                                  absl::Duration wait,
                                  const DbSession& session = {},
                                  const std::string& subscription = "billing");

}  // namespace outbox::tools
