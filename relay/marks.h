#pragma once
// What the consumer's answers leave to write to a subscription's delivery
// state (marks), and the SQL that writes them. A delivery row answered
// APPLIED or DUPLICATE is deleted; a rejected one counts an attempt and
// backs off by policy.h's schedule, a dead letter after max_attempts; a
// diverged one waits, with its aggregate, for an operator. An event read
// from the outbox log has no row: delivered, it only lets the position
// pass it (the relay's business); anything else makes it an exception row
// first, which the rejection, if any, then marks.
//
// Each mark is written only if its row still holds the event answered
// (event_id): a row re-owed meanwhile with another event is left alone.
//
// Example (the relay, after answers came back):
//   const MarkPlan plan = PlanMarks(marks);
//   if (!plan.nothing()) {
//     WrittenMarks w = WriteMarks(tx, "billing", marks, plan, policy);
//     tx.commit();
//   }

#include <cstdint>
#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "outbox/v1/sink.pb.h"
#include "relay/delivery_store.h"

namespace outbox::relay {

struct Mark {
  // kOwed: an event from the log that was not answered (or could not be
  // sent) becomes an exception, with no attempt counted.
  enum Kind { kDelivered, kRejected, kDiverged, kOwed };
  int64_t seq;
  std::string event_id;  // the row is marked only if its event is this
  std::string chain;     // OutboxChain of its aggregate
  Kind kind;
  std::string reason;  // for rejected and diverged
  EventLogFields log_fields;
  int64_t applied_seq = 0;  // diverged: the consumer's applied position
  bool from_log = false;    // of an event read from the log
  bool delivered() const { return kind == kDelivered; }
};

// A batch sent on a delivery stream and not yet answered.
struct InFlight {
  uint64_t batch_id;
  absl::Time sent_at;  // InfiniteFuture while held by the fence
  std::vector<int64_t> seqs;
  std::vector<int> partitions;
  // Of each seq: its event (aggregate, id, trace) for tracking and logs,
  // and its prev_seq as sent.
  std::vector<EventLogFields> events;
  std::vector<int64_t> prev_seqs;
  // The highest inbox number (DeliverResponse.applied_through) answered
  // before this batch was sent: the consumer numbers this batch's rows
  // above it, unless its database went back in time.
  int64_t inbox_high_at_send = 0;
  // Its claim returned as many rows as it asked for, or it reached the
  // size limit: more rows were likely ready (a backlog).
  bool full = false;
  bool from_log = false;  // read from the log (LogReader), not claimed
};

// What the consumer's answer to a batch leaves, event by event. Pure.
struct Answer {
  std::vector<Mark> marks;  // to write
  // HELD events whose predecessor the consumer lacks although it had
  // answered for it (its database lost commits, or was restored): owed
  // again at once; the held event drains when they arrive.
  std::vector<ChainRange> reowe;
  // The chains of claimed rows left unanswered (or DEFERRED behind an
  // event rejected in the same batch): they stay pending, no attempt
  // counted, and nothing is written for them.
  std::vector<std::string> unanswered;
};
// APPLIED, DUPLICATE and HELD are deliveries; REJECTED counts an attempt;
// DIVERGED waits for an operator; an event from the log left unanswered
// becomes an exception, as the events behind it will.
Answer AnswerOf(const InFlight& batch, const v1::DeliverResponse& response);

// Which statements a set of marks needs. Pure.
struct MarkPlan {
  // Delivery rows to delete, and the event each must hold, in step.
  std::vector<int64_t> delivered;
  std::vector<std::string> delivered_ids;
  // Events from the log, not delivered, that become exceptions (seq order
  // of the marks).
  std::vector<int64_t> owed;
  // Every mark is a delivery: one statement, in autocommit (or riding
  // with the next claim).
  bool only_deliveries = true;
  // Every mark is a delivery from the log: nothing to write at all.
  bool nothing() const { return only_deliveries && delivered.empty(); }
};
MarkPlan PlanMarks(const std::vector<Mark>& marks);

// What the counters count once the marks are written. Pure.
struct MarkTally {
  int64_t delivered = 0;     // answered APPLIED or DUPLICATE
  int64_t rejected = 0;      // attempts counted against events
  int64_t rows_deleted = 0;  // delivery rows the deliveries deleted
};
MarkTally TallyMarks(const std::vector<Mark>& marks);

// How a rejected event backs off (policy.h RetryDelays, jittered).
struct RejectPolicy {
  int max_attempts = 10;  // the attempt that makes it a dead letter
  absl::Duration backoff = absl::Seconds(1);
  absl::Duration backoff_max = absl::Minutes(5);
};

struct WrittenMarks {
  int64_t dead = 0;      // rejections that made dead letters
  int64_t diverged = 0;  // divergences recorded (not open already)
};

// Writes `marks` (planned by PlanMarks) in `tx`; the caller commits. Logs
// each new dead letter and divergence. Throws as libpqxx does.
WrittenMarks WriteMarks(pqxx::transaction_base& tx,
                        const std::string& subscription,
                        const std::vector<Mark>& marks, const MarkPlan& plan,
                        const RejectPolicy& policy);

// WriteMarks on `conn`, committed: deliveries alone in one statement in
// autocommit (one round trip instead of three: BEGIN, DELETE, COMMIT),
// anything else in one transaction under the session's limits. Its crash
// points are relay.before_mark_commit and relay.after_mark_commit. A
// failure is returned, nothing of it written.
absl::StatusOr<WrittenMarks> StoreMarks(pqxx::connection_base& conn,
                                        const std::string& subscription,
                                        const std::vector<Mark>& marks,
                                        const MarkPlan& plan,
                                        const RejectPolicy& policy);

}  // namespace outbox::relay
