#pragma once
// What the consumer's answers teach about its database, beside the events
// they answer: which database it is (each answer names it), whether its
// inbox went back in time under the same identity (restored in place), and
// which events a HELD answer showed it lacks although it had answered for
// them. Observe and Lacks only keep account; Record writes what was learnt
// into the outbox database in one transaction: the identity, a heal
// request, the events owed again.
//
// Owned by the relay's worker thread; not thread-safe.
//
// Example:
//   ConsumerWatch watch("billing", &counters);
//   watch.Stored(ConsumerIdentity(tx, "billing"));         // at connect
//   batch.inbox_high_at_send = watch.inbox_high();          // at send
//   if (watch.Observe(response, batch.inbox_high_at_send)) {
//     // went back: every batch in flight was numbered on the old inbox
//   }
//   watch.Lacks(AnswerOf(batch, response).reowe);
//   if (watch.pending()) absl::StatusOr<ConsumerWatch::Recorded> r =
//       watch.Record(conn);

#include <cstdint>
#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/db_identity.h"
#include "outbox/v1/sink.pb.h"
#include "relay/delivery_store.h"
#include "relay/relay_metrics.h"

namespace outbox::relay {

class ConsumerWatch {
 public:
  // `counters` (may be null) must outlive the watch.
  ConsumerWatch(std::string subscription, const RelayCounters* counters);

  // The identity the subscription has stored (read at each connect).
  void Stored(DatabaseIdentity identity) { identity_ = std::move(identity); }

  // The highest inbox number (DeliverResponse.applied_through) answered so
  // far: the consumer numbers a batch sent now above it.
  int64_t inbox_high() const { return inbox_high_; }

  // Takes what `response` says of the consumer's database; the batch it
  // answers was sent when inbox_high() was `high_at_send`. True when it
  // shows that the inbox went back in time (it numbered an applied event
  // at or below a number it had answered for before): every batch still in
  // flight was sent with a number of the old inbox, and the caller must set
  // their high_at_send to 0. A heal is requested by the next Record.
  bool Observe(const v1::DeliverResponse& response, int64_t high_at_send);

  // The consumer lacks these events although it had answered for them
  // (relay/marks.h Answer::reowe): the next Record owes them again.
  void Lacks(const std::vector<ChainRange>& ranges);

  // Whether Record has something to write.
  bool pending() const {
    return seen_.has_value() || !reowe_.empty() || !went_back_.empty();
  }

  // Forgets the events it would owe again (the outbox database failed
  // over: a heal decides instead).
  void DropLacking() { reowe_.clear(); }

  struct Recorded {
    bool owed = false;  // events were owed again (the log has exceptions)
    // The consumer's database (DatabaseIdentity::Key), newly stored.
    std::optional<std::string> consumer_database;
  };
  // Writes what Observe and Lacks learnt since the last Record, in one
  // transaction on `conn`, logs it and counts it; on an error nothing is
  // forgotten and the next call tries again. Nothing to write: {}.
  absl::StatusOr<Recorded> Record(pqxx::connection_base& conn);

 private:
  const std::string subscription_;
  const RelayCounters* const counters_;
  DatabaseIdentity identity_;              // as stored for the subscription
  std::optional<DatabaseIdentity> seen_;   // another one answered: to store
  int64_t inbox_high_ = 0;
  std::string went_back_;                  // why the inbox went back, or ""
  std::vector<ChainRange> reowe_;
};

}  // namespace outbox::relay
