#pragma once
// What lies between an event going out and its mark being written: the
// chains (aggregates) with events out or answered and not yet marked
// (BusyChains), and the marks those answers left (Mark). The relay's
// worker owns one; it holds the rule that keeps an aggregate in order:
// a chain stays busy, so nothing later of it is claimed or read, until
// every event of it that went out is either marked (written) or known to
// be unanswered (its stream broke, or the consumer left it).
//
// Invariant, asserted after each change: every mark not yet written is of
// a busy chain, counted once per mark at least.
//
// Not thread-safe (the worker's).
//
// Example:
//   settlement.Sent(built);          // BuildBatch's events went out
//   settlement.Answered(AnswerOf(batch, response));
//   const MarkPlan plan = PlanMarks(settlement.marks());
//   WrittenMarks w = WriteMarks(tx, "billing", settlement.marks(), plan, p);
//   tx.commit();
//   Settled s = settlement.Written(w);  // count s, settle s.from_log

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "relay/batch_builder.h"
#include "relay/busy_chains.h"
#include "relay/marks.h"

namespace outbox::relay {

// What a written set of marks settled, for the counters and the log's
// positions.
struct Settled {
  MarkTally tally;
  WrittenMarks written;
  std::vector<int64_t> from_log;  // seqs read from the log, now settled
};

class Settlement {
 public:
  // A built batch's events went out (or were rejected or owed at once,
  // leaving marks).
  void Sent(const BuiltBatch& built);
  // An answer came: its marks wait to be written, and the chains it left
  // unanswered are free of those events. Logs each rejection.
  void Answered(Answer answer);
  // No answer will come for `batch` (its stream broke): its events go
  // again, so their chains are free of them.
  void Dropped(const InFlight& batch);
  // Everything out and answered is forgotten (the outbox failed over).
  void Clear();

  const BusyChains& busy() const { return busy_; }
  const std::vector<Mark>& marks() const { return marks_; }
  bool settled() const { return marks_.empty(); }

  // Every mark is a delivery: the next claim of rows may delete their rows
  // (kMarkAndClaimSql) instead of a statement of their own.
  bool RideWithClaim() const;
  // The events of each chain whose marks would ride with a claim (empty
  // unless RideWithClaim).
  std::map<std::string, int> Riding() const;

  // The marks were committed (WriteMarks, or riding with a claim), or
  // needed no statement (PlanMarks(marks()).nothing()): their chains are
  // freed of them, and they are cleared.
  Settled Written(const WrittenMarks& written);

 private:
  void Check() const;

  BusyChains busy_;
  std::vector<Mark> marks_;  // answered, not yet written
};

}  // namespace outbox::relay
