#pragma once
// A heal: after either database of a subscription failed over, was restored
// or lost commits, compare what the consumer applied (its cursors, over
// EventSink.GetCursors) with what the outbox says was delivered, and
//  - deliver again what the consumer lost: an aggregate whose cursor is
//    behind its delivered events gets the events after the cursor owed
//    again (the consumer answers DUPLICATE for any it has after all);
//  - record as diverged (outbox_divergences, for an operator) an
//    aggregate whose applied event the outbox does not hold (a failover of
//    the outbox database lost it after the consumer applied it), and one
//    whose lost events the outbox no longer retains.
// A relay runs it when a heal is due (delivery_store.h RequestHeal), on its
// housekeeping connection; its cost is a page of cursors and a few
// statements per thousand aggregates.
//
// Example:
//   Healer healer("billing", stub);
//   absl::StatusOr<HealReport> r = healer.Run(conn, relay_source);

#include <cstdint>
#include <pqxx/pqxx>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "outbox/v1/sink.grpc.pb.h"

namespace outbox::relay {

struct HealReport {
  int64_t consumer_aggregates = 0;  // cursors the consumer listed
  int64_t outbox_aggregates = 0;    // aggregates the outbox holds
  int64_t redelivered = 0;          // events owed again
  int64_t redelivered_aggregates = 0;
  int64_t diverged = 0;  // aggregates newly recorded as diverged
  absl::Duration took;
  std::string Summary() const;
};

class Healer {
 public:
  // `stub` (the relay's channel to the consumer, with its identity) must
  // outlive the healer.
  // `page`: cursors asked of the consumer, and heads read, at a time.
  Healer(std::string subscription, v1::EventSink::Stub* stub,
         absl::Duration rpc_timeout = absl::Seconds(15), int page = 1000);

  // One full comparison. Unavailable when the consumer or the database
  // cannot be reached (try again later); nothing half done matters, as
  // owing an event twice costs a DUPLICATE.
  absl::StatusOr<HealReport> Run(pqxx::connection& conn,
                                 const std::string& source);

 private:
  const std::string subscription_;
  v1::EventSink::Stub* const stub_;
  const absl::Duration rpc_timeout_;
  const int page_;
};

}  // namespace outbox::relay
