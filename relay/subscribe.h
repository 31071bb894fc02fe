#pragma once
// How a relay takes up its subscription on a connection to the outbox
// database, before it delivers anything: the source name its events carry
// (outbox_source, recorded by the first relay), the subscription itself
// (made on first use with the deliveries it is owed, unless an operator
// dropped it), settled once the writes in flight when it was made have
// landed, and whether it is delivered from the outbox log.
//
// Example (the relay, on each new session):
//   absl::StatusOr<TakenUp> up = TakeUp(conn, {...}, move_onto_log,
//                                       conn.info().identity);
//   if (!up.ok()) try again later;
//   else if (!up->subscription.refused.empty()) refuse loudly, try again;
//   else deliver (from the log if up->start_tick).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <pqxx/pqxx>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/db.h"
#include "common/db_identity.h"
#include "relay/policy.h"

namespace outbox::relay {

// A subscription's name: [a-z][a-z0-9_-]{0,62} (subscriptions.name's check).
bool IsSubscriptionName(absl::string_view name);

// Where a new subscription starts.
enum class StartFrom {
  kOldest,  // every event still retained
  kNow,     // events after the newest at its creation
};

struct SubscribeOptions {
  std::string subscription;
  // The name the outbox's events must carry; "" takes what is recorded,
  // or records a default (the database's name and a random suffix).
  std::string source;
  StartFrom start_from = StartFrom::kOldest;
  // Make it anew even if an operator dropped it.
  bool resubscribe = false;
  std::string actor;  // who makes it (recorded with a resubscribe)
  // Whether to give up waiting for writers in flight (the relay stops).
  std::function<bool()> stopping = [] { return false; };
};

struct Subscribed {
  int id = 0;
  std::string source;  // the name events carry
  // Events whose prev_seq is below this are the first of their chain for
  // this subscription (their predecessor was never owed to it).
  int64_t chain_from = 0;
  bool created = false;  // by this call
  // Why the relay may not deliver it (the rest is unset), or "": an
  // operator dropped it (and not resubscribe), or `source` names another
  // than the outbox's.
  std::string refused;
};

// Reads (or records) the source and reads (or makes and settles) the
// subscription, or says why it is refused. Unavailable when not yet:
// another replica is making it, or writers in flight did not end within a
// minute, or `stopping`. Other errors are the database's. A read-only
// database does when both are there: nothing is written that is.
absl::StatusOr<Subscribed> TakeUpSubscription(pqxx::connection& conn,
                                              const SubscribeOptions& options);

// Whether `subscription` is on the outbox log (docs/log-delivery.md): its
// start tick, or nothing. With `move`, one on rows is moved onto the log
// first (outbox_log_subscribe), unless an operator moved it off the log
// since it was made (RelayAdmin.MoveSubscriptionToRows): the operator's
// word wins over a relay's flag.
absl::StatusOr<std::optional<int64_t>> EnsureLogDelivery(
    pqxx::connection& conn, const std::string& subscription, bool move);

// What a relay's new session starts from.
struct TakenUp {
  Subscribed subscription;            // when refused, nothing below is set
  std::optional<int64_t> start_tick;  // on the outbox log: its start tick
  // The outbox database's own record of its identity: compared with the
  // session's, it shows a failover or a restore while no relay watched.
  std::optional<DatabaseIdentity> recorded;
  // The consumer's database as the subscription last stored it.
  DatabaseIdentity consumer;
};

// TakeUpSubscription, EnsureLogDelivery (moving it onto the log with
// `move_onto_log`), then the identities above; and records `session` as
// the outbox database's identity unless one is recorded (not on a
// read-only server: later). Errors as TakeUpSubscription's; a refusal is
// no error.
absl::StatusOr<TakenUp> TakeUp(pqxx::connection& conn,
                               const SubscribeOptions& options,
                               bool move_onto_log,
                               const DatabaseIdentity& session);

// A relay worker's new session: its connection, and what its subscription
// starts from.
struct WorkerSession {
  std::unique_ptr<Connection> conn;
  TakenUp up;
};

// Connects to `url` as `application_name` (Connect) and takes the
// subscription up (TakeUp). On a session of its own, first: TCP keepalives
// (the server notices a vanished relay within about 25 s) and asynchronous
// commits (a mark lost in a server crash only means the event is delivered
// again, and answered DUPLICATE). Behind a transaction pooler a SET would
// stay behind for other clients' transactions (the producer's commits
// among them), so there it sets nothing. Errors as Connect's and TakeUp's;
// a refusal is no error.
absl::StatusOr<WorkerSession> OpenWorkerSession(
    const std::string& url, const std::string& application_name,
    const DbSession& session, const SubscribeOptions& options,
    bool move_onto_log);

// A relay worker's attempts at its session: after a failure, the next waits
// its step of `backoff`; each failure is logged, a refused subscription
// once until the reason changes.
//
// Example (relay.cc):
//   SessionAttempts attempts(Backoff(absl::Milliseconds(100),
//                                    absl::Seconds(5)));
//   absl::StatusOr<WorkerSession> s = attempts.Open(absl::Now(), [&] {
//     return OpenWorkerSession(url, name, session, options, true);
//   });
//
// Not thread-safe: the worker alone calls it.
class SessionAttempts {
 public:
  explicit SessionAttempts(Backoff backoff);

  // Runs `open` unless the last attempt failed and the next is not due at
  // `now`: then its failure again, `open` not run. A refusal of the
  // subscription (TakenUp::subscription.refused) is FailedPrecondition
  // with the reason; its session is closed.
  absl::StatusOr<WorkerSession> Open(
      absl::Time now,
      const std::function<absl::StatusOr<WorkerSession>()>& open);

 private:
  Backoff backoff_;
  absl::Status failed_;  // the last attempt's, while it is repeated
  std::string refused_;  // the last refusal logged
  absl::Time next_ = absl::InfinitePast();
};

}  // namespace outbox::relay
