#pragma once
// Subscriptions as an operator sees them: for each, what it still owes
// (pending, dead, diverged), its oldest undelivered event, its live relays,
// whether an operator paused it, and whether it holds retention back; and
// the operator's actions on one (pause, resume, drop, a move onto the outbox
// log or off it), each recorded in subscription_actions with who and why.
//
// Retention deletes only events every subscription has passed, so the
// subscription whose lowest undelivered event is the oldest pins it: by a
// dead letter, a diverged event, a pending one (a slow or paused
// subscription), or a subscription nobody delivers any more.
//
// Example:
//   auto unit = OpenUnit(conn);
//   for (const SubscriptionInfo& s :
//        ReadSubscriptions(*unit, retention, SubscriptionDetail::kGauges))
//     if (s.retention_pinned_seconds > 0) ...;

#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace outbox::relay {

struct SubscriptionInfo {
  std::string name;
  absl::Time created_at;
  int64_t start_seq = 0;
  int64_t pending = 0, dead_letters = 0, diverged = 0;  // delivery rows
  int64_t relays_alive = 0;  // relays whose membership has not expired
  // Its lowest undelivered event (0: none) and that row's status.
  int64_t lowest_seq = 0;
  std::string lowest_status;
  double oldest_pending_seconds = 0;
  bool paused = false;
  bool on_log = false;  // delivered from the outbox log (docs/log-delivery.md)
  std::string paused_by, paused_reason;
  absl::Time paused_at = absl::InfinitePast();
  // It holds retention back: its lowest undelivered event is the oldest of
  // all subscriptions' and older than `retention`, for this long.
  double retention_pinned_seconds = 0;
  // Why (with retention_pinned_seconds > 0): "dead_letter", "diverged",
  // "paused", "abandoned" (no relay alive) or "pending".
  std::string pinned_by;
  std::string heal_due;  // HealDue::Text(): "" when none is due

  // "dead letter seq 42 (...)": what holds it back, for people.
  std::string PinDescription() const;
};

// What ReadSubscriptions reads besides each subscription's own row and the
// few index probes that give its lowest event and what it pins.
enum class SubscriptionDetail {
  kGauges,   // nothing more: housekeeping's backlog refresh, every 15 s
  kSummary,  // each one's due heal (one query for all): an operator's reply
  kCounts,   // that, and the pending, dead and diverged figures, which read
             // every delivery row and what the log owes: the listing
};

// Every subscription, by name. `retention` 0: nothing is pinned. Below
// kCounts the pending, dead and diverged figures stay 0; below kSummary
// heal_due stays "". Throws as libpqxx does.
std::vector<SubscriptionInfo> ReadSubscriptions(pqxx::transaction_base& tx,
                                                absl::Duration retention,
                                                SubscriptionDetail detail);

enum class SubscriptionAction { kPause, kResume, kDrop, kToLog, kToRows };

// Pauses (its relays stop claiming; what is in flight is answered), resumes,
// drops (its deliveries, leases and membership deleted; its relays then
// refuse to create it again without --resubscribe), moves onto the outbox
// log (outbox_log_subscribe: the producer's transactions owe it nothing
// from then on) or off it (outbox_log_unsubscribe: what the log still owes
// becomes pending rows; it waits for the outbox's writers and holds new
// ones until the caller commits) `name`, recording `actor` and `reason`.
// NotFound for an unknown subscription; FailedPrecondition for dropping one
// with live relays unless `force`, for pausing a paused or resuming a
// running one, and for moving one where it is already. The caller commits,
// in READ COMMITTED.
absl::Status ActOnSubscription(pqxx::transaction_base& tx,
                               const std::string& name,
                               SubscriptionAction action,
                               const std::string& actor,
                               const std::string& reason, bool force);

// What the relays of a subscription read every round.
struct SubscriptionState {
  // "by WHO: WHY" while an operator has it paused, "" when not.
  std::string paused;
  bool on_log = false;  // delivered from the outbox log
};

// The state of `name`; nullopt when it is gone (dropped). Throws as
// libpqxx does.
std::optional<SubscriptionState> ReadSubscriptionState(
    pqxx::transaction_base& tx, const std::string& name);

// What a relay's worker follows of its subscription, every rebalance round:
// whether it is gone (dropped) or paused by an operator (each logged when
// it begins and ends), and whether it is on the outbox log. Not
// thread-safe: the worker owns it.
class SubscriptionWatch {
 public:
  // `replica` names the relay in the log lines.
  SubscriptionWatch(std::string subscription, std::string replica);
  // The state in `tx`; NotFound when the subscription is gone (the next
  // session finds out how: TakeUpSubscription). Throws as libpqxx does.
  absl::StatusOr<SubscriptionState> Read(pqxx::transaction_base& tx);
  // "subscription NAME paused by WHO: WHY" while paused, as last read; "".
  const std::string& paused() const { return paused_; }

 private:
  const std::string subscription_;
  const std::string replica_;
  std::string paused_;
};

// The last drop of `name` recorded ("by WHO at WHEN: REASON"), if the
// subscription was dropped and not made again since.
std::optional<std::string> LastDrop(pqxx::transaction_base& tx,
                                    const std::string& name);

}  // namespace outbox::relay
