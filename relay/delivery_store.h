#pragma once
// The SQL that repairs a subscription's delivery state when either
// database lost or changed history: owe events again (a chain range of an
// aggregate, or a replay), record and resolve diverged aggregates, keep the
// consumer's database identity and the heal requests. Each function runs
// in the caller's transaction (or unit: common/db.h OpenUnit) and throws
// as libpqxx does; the caller turns that into a status.
//
// The outbox has no index by aggregate: an aggregate's events are found by
// walking its chain (prev_seq) back from a known event, a primary-key
// probe per event, so the cost is that of the events walked.
//
// Example (a HELD answer showed that the consumer lacks events 11-14 of
// aggregate "a", which it had been given before):
//   ReOwed r = ReOwe(tx, "billing", {{.aggregate_id = "a", .after = 10,
//                                     .through = 14}});

#include <cstdint>
#include <map>
#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/db_identity.h"
#include "common/ids.h"
#include "common/schema.h"
#include "outbox/v1/relay.pb.h"

namespace outbox::relay {

// The chains of one outbox: (aggregate_type, aggregate_id), as a ChainKey
// without a source (common/ids.h); the relay's maps are keyed by it.
inline std::string OutboxChain(absl::string_view aggregate_type,
                               absl::string_view aggregate_id) {
  return ChainKey("", aggregate_type, aggregate_id);
}

// The part of a chain (OutboxChain) after seq `after` up to and including
// seq `through` (an event of that chain).
struct ChainRange {
  std::string chain;
  int64_t after = 0;
  int64_t through = 0;
};

struct ReOwed {
  int64_t owed = 0;  // delivery rows written (not pending already)
  // Chains (OutboxChain) whose range reaches back to events the outbox no
  // longer holds (retention deleted them, or a failover lost them): the missing
  // predecessor's seq of each. They cannot be delivered again.
  std::vector<std::pair<std::string, int64_t>> gaps;
};

// Owes the retained events of `ranges` to `subscription` again (from its
// start_seq on; pending ones stay as they are). A gap is reported only at
// or above the subscription's chain_from (below it the predecessor was
// never owed). Holds retention's deletes back until `tx` commits (a lock
// shared with PruneOutbox, taken in a statement before the reads), so
// `tx` must be a transaction, not a pqxx::nontransaction: retention then
// cannot delete an event this owes between the read and the commit.
ReOwed ReOwe(pqxx::transaction_base& tx, const std::string& subscription,
             const std::vector<ChainRange>& ranges);

// A chain's retained events, oldest first: (seq, event_id), walked back
// from its newest event (outbox_heads); with aggregate_type "", those of
// every chain of the id. Empty for an unknown aggregate.
std::vector<std::pair<int64_t, std::string>> ChainOf(
    pqxx::transaction_base& tx, const std::string& aggregate_type,
    const std::string& aggregate_id);

// The newest event of that chain that retention deleted (0: none), given
// its retained events `chain` (ChainOf, read before): the predecessor of
// the oldest retained one, or the chain's newest event when none is
// retained. Each was in this outbox's history and delivered before it
// went, so a consumer's applied events up to it are shared history (an
// operator's resolve keeps them), whatever was lost after.
int64_t DeletedThrough(
    pqxx::transaction_base& tx, const std::string& aggregate_type,
    const std::string& aggregate_id,
    const std::vector<std::pair<int64_t, std::string>>& chain);

// What a replay owes again: exactly one selector.
struct ReplaySelector {
  std::string event_id;
  std::string aggregate_id;
  std::string aggregate_type;        // with aggregate_id: that chain only
  int64_t from_seq = 0, to_seq = 0;  // inclusive; 0: open
  absl::Time since = absl::InfinitePast(), until = absl::InfiniteFuture();
  bool by_seq = false, by_time = false;
};

struct Replayed {
  int64_t matched = 0;  // retained events owed to the subscription
  int64_t owed = 0;     // of which not pending already
};

// Holds retention back as ReOwe does; `tx` must be a transaction.
Replayed Replay(pqxx::transaction_base& tx, const std::string& subscription,
                const ReplaySelector& selector);

// Records an open divergence of `aggregate_id` unless one is open already;
// true if recorded.
struct NewDivergence {
  std::string subscription, aggregate_type, aggregate_id, kind, detail;
  // Of the chain `chain` (OutboxChain).
  static NewDivergence Of(std::string subscription, const std::string& chain) {
    NewDivergence d;
    d.subscription = std::move(subscription);
    ChainId c;
    ParseChainKey(chain, &c);
    d.aggregate_type = std::move(c.type);
    d.aggregate_id = std::move(c.id);
    return d;
  }
  int64_t consumer_seq = 0;
  std::string consumer_event_id;  // "" for none
  int64_t outbox_seq = 0;
  std::string outbox_event_id;  // "" for none
};
bool RecordDivergence(pqxx::transaction_base& tx, const NewDivergence& d);
// The same for many in one statement (a heal after a failover records
// hundreds; one statement each took seconds on a busy server, while
// operators listing what diverged saw only part). Returns, for each of
// `ds`, whether it was recorded (the first of two for one chain is).
std::vector<bool> RecordDivergences(pqxx::transaction_base& tx,
                                    const std::vector<NewDivergence>& ds);

// Records, for each gap of `owed`, that the consumer lost events the outbox
// no longer retains (kind lost_beyond_retention), and logs it; `applied`
// (may be null) gives the consumer's cursor of each chain. Returns how
// many were recorded (not open already).
int64_t RecordGaps(pqxx::transaction_base& tx, const std::string& subscription,
                   const ReOwed& owed,
                   const std::map<std::string, int64_t>* applied = nullptr);

// Open (and, with `include_resolved`, resolved) divergences, oldest first.
std::vector<v1::Divergence> ListDivergences(pqxx::transaction_base& tx,
                                            const std::string& subscription,
                                            bool include_resolved, int limit);
int64_t OpenDivergences(pqxx::transaction_base& tx,
                        const std::string& subscription);

// How many events wait, and how old the oldest is (seconds, 0 when none).
struct WaitingFigures {
  int64_t events = 0;
  double oldest_seconds = 0;
};

// The pending delivery rows of `subscription` in `partitions`, by
// partition (those with none are left out). Bounded: it counts the first
// `cap` rows in seq order (the primary key) and looks up one outbox row
// per partition.
std::map<int, WaitingFigures> PendingRows(pqxx::transaction_base& tx,
                                          const std::string& subscription,
                                          const std::vector<int>& partitions,
                                          int64_t cap);

// The dead letters of `subscription`: how many, and the age of the oldest.
WaitingFigures DeadLetters(pqxx::transaction_base& tx,
                           const std::string& subscription);

// Marks the open divergence of `aggregate_id` resolved and puts its
// diverged deliveries back to pending; the divergence as it now reads, or
// nothing when none was open.
std::optional<v1::Divergence> ResolveDivergence(
    pqxx::transaction_base& tx, const std::string& subscription,
    const std::string& aggregate_type, const std::string& aggregate_id,
    const std::string& resolved_by, const std::string& resolution);

// Stores the consumer's database identity for the subscription. When it
// differs from a stored one, also requests a heal (and returns the old
// identity); the first identity ever seen requests nothing.
std::optional<DatabaseIdentity> StoreConsumerIdentity(
    pqxx::transaction_base& tx, const std::string& subscription,
    const DatabaseIdentity& seen);

// The identity last stored (unknown if none).
DatabaseIdentity ConsumerIdentity(pqxx::transaction_base& tx,
                                  const std::string& subscription);

// Asks the subscription's relays to compare the consumer's cursors with
// what was delivered (relay/heal.h), for `reason`.
void RequestHeal(pqxx::transaction_base& tx, const std::string& subscription,
                 const std::string& reason);
// In a unit of its own on `conn`, committed: records `identity` as the
// outbox database's own (common/db_identity.h RecordIdentity), then
// RequestHeal. A failure is returned, nothing of it written.
absl::Status RecordIdentityAndRequestHeal(pqxx::connection_base& conn,
                                          const DatabaseIdentity& identity,
                                          const std::string& subscription,
                                          const std::string& reason);

// Closes the request `due` (common/schema.h's DueHeal), unless a newer one
// came meanwhile.
void HealDone(pqxx::transaction_base& tx, const std::string& subscription,
              const HealDue& due);

// -- What an operator reads and asks (relay/admin_service.h) ---------------

// Whether `subscription` exists.
bool SubscriptionExists(pqxx::transaction_base& tx,
                        const std::string& subscription);

// The subscription's delivery rows: pending ones (and how long the oldest
// has waited), dead letters, and the events since its start that have
// none (delivered, or owed by the outbox log: relay/outbox_log.h
// LogOwedBy counts those).
struct DeliveryRowCounts {
  int64_t pending = 0;
  double oldest_pending_seconds = 0;
  int64_t dead = 0;
  int64_t without_row = 0;
};
DeliveryRowCounts CountDeliveryRows(pqxx::transaction_base& tx,
                                    const std::string& subscription);

// The outbox event `event_id` with its delivery state for `subscription`,
// or nothing when the outbox does not hold it.
std::optional<v1::OutboxRow> FindEvent(pqxx::transaction_base& tx,
                                       const std::string& subscription,
                                       const std::string& event_id);

// Dead letters above seq `after_seq`, oldest first, of `aggregate_id`
// ("" for any): at most `limit`, fewer when their payloads exceed
// `payload_budget` bytes; `more` when others match.
struct DeadLetterPage {
  std::vector<v1::OutboxRow> rows;
  bool more = false;
};
DeadLetterPage ReadDeadLetters(pqxx::transaction_base& tx,
                               const std::string& subscription,
                               const std::string& aggregate_id,
                               int64_t after_seq, int limit,
                               int64_t payload_budget);

// Which dead letters Requeue puts back: one event, or those of one
// aggregate, or all; narrowed by when they died (microseconds since the
// epoch, 0 for open) and by text in their last error ("" for any).
struct DeadLetterFilter {
  std::string event_id;      // "" for any
  std::string aggregate_id;  // "" for any
  int64_t died_after_us = 0, died_before_us = 0;
  std::string error_contains;
};
// Puts the matching dead letters back to pending with no attempts, and
// wakes the relays (NOTIFY); returns how many.
int64_t RequeueDeadLetters(pqxx::transaction_base& tx,
                           const std::string& subscription,
                           const DeadLetterFilter& filter);

// The aggregate types of `aggregate_id`'s open divergences (only
// `aggregate_type`'s when it is not "").
std::vector<std::string> OpenDivergenceTypes(pqxx::transaction_base& tx,
                                             const std::string& subscription,
                                             const std::string& aggregate_id,
                                             const std::string& aggregate_type);

// The detail of the last action on `subscription` (subscription_actions),
// "" for none.
std::string LastSubscriptionAction(pqxx::transaction_base& tx,
                                   const std::string& subscription);

// Wakes every relay listening (NOTIFY on the producer's channel) once `tx`
// commits: something changed that they should claim.
void WakeRelays(pqxx::transaction_base& tx);

}  // namespace outbox::relay
