#include "relay/subscribe.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/db.h"
#include "common/schema.h"
#include "relay/delivery_store.h"
#include "relay/subscriptions.h"

namespace outbox::relay {
namespace {

// Runs `fn` in a unit of its own and commits it. Behind a transaction
// pooler a unit is a transaction, which must not stay open across waits.
template <typename Fn>
auto Once(pqxx::connection& conn, const Fn& fn) {
  auto tx = OpenUnit(conn);
  auto r = fn(*tx);
  tx->commit();
  return r;
}

// The source name events carry, recorded first if the outbox has none;
// "" with *refused saying why if `options.source` names another.
absl::StatusOr<std::string> EnsureSource(pqxx::connection& conn,
                                         const SubscribeOptions& options,
                                         std::string* refused) {
  // Read first: a read-only database (a standby behind the address) must
  // not fail on a write that is not needed.
  auto read = [&] {
    return Once(conn, [](pqxx::transaction_base& tx) {
      return tx.exec("SELECT name FROM outbox_source");
    });
  };
  pqxx::result r = read();
  if (r.empty()) {
    Once(conn, [&](pqxx::transaction_base& tx) {
      return tx.exec_params(
          "INSERT INTO outbox_source (name, recorded_by) VALUES (coalesce("
          "nullif($1, ''), left(coalesce(nullif(regexp_replace("
          "current_database(), '[^A-Za-z0-9._-]+', '-', 'g'), ''), "
          "'outbox'), 55) || '-' || substr(md5(random()::text || "
          "clock_timestamp()::text), 1, 8)), $2) ON CONFLICT DO NOTHING",
          options.source, options.actor);
    });
    r = read();
    if (r.empty()) {
      return absl::UnavailableError(
          "the outbox's source name is not recorded yet");
    }
  }
  const std::string name = r[0][0].as<std::string>();
  if (!options.source.empty() && name != options.source) {
    *refused = absl::StrCat(
        "--source=", options.source, ": this outbox's events carry source ",
        name,
        " (outbox_source); consumers name each chain by it, so it cannot "
        "change under them: start the relay with --source=",
        name, " or without --source");
    return std::string();
  }
  return name;
}

// Producers that inserted events while the subscription was being made
// may not have seen it: once every transaction older than now has ended,
// give those events to it as well (some again, maybe: the consumer answers
// DUPLICATE), and fix where its chains start if that is not known yet.
absl::Status Settle(pqxx::connection& conn, const SubscribeOptions& options,
                    int64_t start, int64_t* chain_from) {
  // Only writers of this database matter: the transactions that hold an
  // xid here now (a cluster-wide xmin would also wait for every other
  // database's long transactions). One that has no xid yet has written
  // nothing, and its next insert's trigger sees the subscription.
  const std::string writers = Once(conn, [](pqxx::transaction_base& tx) {
    return tx
        .exec(
            "SELECT coalesce(string_agg(pid::text || ':' || "
            "backend_xid::text, ','), '') FROM pg_stat_activity WHERE "
            "datname = current_database() AND backend_xid IS NOT NULL AND "
            "pid <> pg_backend_pid()")[0][0]
        .as<std::string>();
  });
  for (int i = 0; !writers.empty(); ++i) {
    // Done when none of them still runs the same transaction.
    if (Once(conn, [&](pqxx::transaction_base& tx) {
          return tx
              .exec_params(
                  "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity a JOIN "
                  "unnest(string_to_array($1, ',')) AS w(x) ON a.pid::text "
                  "|| ':' || a.backend_xid::text = w.x)",
                  writers)[0][0]
              .as<bool>();
        })) {
      break;
    }
    if (i == 600 || options.stopping()) {
      return absl::UnavailableError(
          absl::StrCat("subscription ", options.subscription,
                       " waits for the writes in flight when it was made"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  Once(conn, [&](pqxx::transaction_base& tx) {
    return tx.exec_params(
        "INSERT INTO outbox_delivery (subscription, seq, aggregate_id, "
        "partition) SELECT $1, seq, aggregate_id, partition FROM outbox "
        "WHERE seq >= $2 ON CONFLICT DO NOTHING",
        options.subscription, start);
  });
  if (*chain_from < 0) {
    // Every write that could land below the oldest retained event has
    // landed: an event whose predecessor is older than that had it deleted
    // by retention before this subscription existed.
    *chain_from = Once(conn, [&](pqxx::transaction_base& tx) {
      tx.exec_params(
          absl::StrCat("UPDATE subscriptions SET chain_from = ",
                       kMinRetainedSql, " WHERE name = $1 AND chain_from < 0"),
          options.subscription);
      return tx
          .exec_params("SELECT chain_from FROM subscriptions WHERE name = $1",
                       options.subscription)[0][0]
          .as<int64_t>();
    });
  }
  return absl::OkStatus();
}

absl::StatusOr<Subscribed> TakeUp(pqxx::connection& conn,
                                  const SubscribeOptions& options) {
  Subscribed s;
  absl::StatusOr<std::string> source = EnsureSource(conn, options, &s.refused);
  if (!source.ok()) return source.status();
  if (!s.refused.empty()) return s;
  s.source = std::move(*source);
  int64_t start = 0;
  const pqxx::result existing = Once(conn, [&](pqxx::transaction_base& tx) {
    return tx.exec_params(
        "SELECT id, start_seq, chain_from FROM subscriptions WHERE name = $1",
        options.subscription);
  });
  if (!existing.empty()) {
    s.id = existing[0]["id"].as<int>();
    start = existing[0]["start_seq"].as<int64_t>();
    s.chain_from = existing[0]["chain_from"].as<int64_t>();
    if (s.chain_from >= 0) return s;
    // Made by a replica that has not settled it yet (or died first).
    if (absl::Status settled = Settle(conn, options, start, &s.chain_from);
        !settled.ok()) {
      return settled;
    }
    return s;
  }
  // One an operator dropped is not made again behind their back.
  const std::optional<std::string> dropped =
      Once(conn, [&](pqxx::transaction_base& tx) {
        return LastDrop(tx, options.subscription);
      });
  if (dropped.has_value() && !options.resubscribe) {
    s.refused = absl::StrCat(
        "subscription ", options.subscription, " was dropped ", *dropped,
        "; this relay does not make it again (start it with --resubscribe "
        "to deliver it anew, per --start_from)");
    return s;
  }
  // A new subscription: created with the deliveries it is owed, in one
  // transaction, so that no replica ever sees it half made. From now: the
  // events after the newest, and chains start there. From the oldest:
  // every event, and chains start at the oldest retained one, known once
  // in-flight writes have landed (-1 until then: not deliverable yet).
  {
    pqxx::work tx(conn);
    ApplyLimits(tx);
    const pqxx::result r = tx.exec_params(
        "INSERT INTO subscriptions (name, start_seq, chain_from) "
        "SELECT $1, x, CASE WHEN $2 THEN x ELSE -1 END FROM (SELECT CASE "
        "WHEN $2 THEN (SELECT coalesce(max(seq), 0) + 1 FROM outbox) ELSE 0 "
        "END AS x) s "
        "ON CONFLICT DO NOTHING RETURNING id, start_seq, chain_from",
        options.subscription, options.start_from == StartFrom::kNow);
    if (r.empty()) {
      // Another replica made it meanwhile; it is visible once that commits.
      tx.abort();
      return absl::UnavailableError(absl::StrCat(
          "subscription ", options.subscription, " is being created"));
    }
    if (options.resubscribe) {
      tx.exec_params(
          "INSERT INTO subscription_actions (subscription, action, actor, "
          "reason) SELECT $1, 'resubscribe', $2, 'outbox-relay "
          "--resubscribe' WHERE EXISTS (SELECT 1 FROM subscription_actions "
          "WHERE subscription = $1)",
          options.subscription, options.actor);
    }
    s.id = r[0]["id"].as<int>();
    start = r[0]["start_seq"].as<int64_t>();
    s.chain_from = r[0]["chain_from"].as<int64_t>();
    tx.exec_params(
        "INSERT INTO outbox_delivery (subscription, seq, aggregate_id, "
        "partition) SELECT $1, seq, aggregate_id, partition FROM outbox "
        "WHERE seq >= $2 ON CONFLICT DO NOTHING",
        options.subscription, start);
    tx.commit();
  }
  s.created = true;
  spdlog::info(
      "relay: created subscription {} (from {})", options.subscription,
      options.start_from == StartFrom::kNow ? "now" : "the oldest event");
  if (absl::Status settled = Settle(conn, options, start, &s.chain_from);
      !settled.ok()) {
    return settled;
  }
  return s;
}

}  // namespace

bool IsSubscriptionName(absl::string_view name) {
  if (name.empty() || name.size() > 63 || name[0] < 'a' || name[0] > 'z') {
    return false;
  }
  for (char ch : name) {
    if (!((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_' ||
          ch == '-')) {
      return false;
    }
  }
  return true;
}

absl::StatusOr<Subscribed> TakeUpSubscription(pqxx::connection& conn,
                                              const SubscribeOptions& options) {
  try {
    return TakeUp(conn, options);
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

absl::StatusOr<std::optional<int64_t>> EnsureLogDelivery(
    pqxx::connection& conn, const std::string& subscription, bool move) {
  try {
    const pqxx::result r = Once(conn, [&](pqxx::transaction_base& tx) {
      return tx.exec_params(
          "SELECT CASE WHEN start_tick IS NULL AND $2 AND coalesce((SELECT "
          "a.action FROM subscription_actions a WHERE a.subscription = "
          "s.name AND a.at >= s.created_at AND a.action IN ('to_log', "
          "'to_rows') ORDER BY a.id DESC LIMIT 1), '') <> 'to_rows' THEN "
          "outbox_log_subscribe(name) ELSE start_tick END AS start_tick FROM "
          "subscriptions s WHERE name = $1",
          subscription, move);
    });
    if (r.empty() || r[0]["start_tick"].is_null()) return std::nullopt;
    return r[0]["start_tick"].as<int64_t>();
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

absl::StatusOr<TakenUp> TakeUp(pqxx::connection& conn,
                               const SubscribeOptions& options,
                               bool move_onto_log,
                               const DatabaseIdentity& session) {
  TakenUp up;
  absl::StatusOr<Subscribed> sub = TakeUpSubscription(conn, options);
  if (!sub.ok()) return sub.status();
  up.subscription = *std::move(sub);
  if (!up.subscription.refused.empty()) return up;
  absl::StatusOr<std::optional<int64_t>> tick =
      EnsureLogDelivery(conn, options.subscription, move_onto_log);
  if (!tick.ok()) return tick.status();
  up.start_tick = *tick;
  try {
    Once(conn, [&](pqxx::transaction_base& tx) {
      up.recorded = RecordedIdentity(tx);
      up.consumer = ConsumerIdentity(tx, options.subscription);
      return 0;
    });
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  try {
    Once(conn, [&](pqxx::transaction_base& tx) {
      return RecordIdentity(tx, session);
    });
  } catch (const pqxx::sql_error& e) {
    // A read-only database (a standby behind the address): later.
    spdlog::debug("relay: cannot record the database's identity: {}", e.what());
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  return up;
}

absl::StatusOr<WorkerSession> OpenWorkerSession(
    const std::string& url, const std::string& application_name,
    const DbSession& session, const SubscribeOptions& options,
    bool move_onto_log) {
  absl::StatusOr<std::unique_ptr<Connection>> conn =
      Connect(url, application_name, session);
  if (!conn.ok()) return conn.status();
  if (!(*conn)->info().pooled) {
    try {
      pqxx::nontransaction tx(**conn);
      tx.exec(
          "SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; "
          "SET tcp_keepalives_count = 3; SET synchronous_commit = off");
    } catch (const std::exception& e) {
      return StatusFromException(e);
    }
  }
  absl::StatusOr<TakenUp> up =
      TakeUp(**conn, options, move_onto_log, (*conn)->info().identity);
  if (!up.ok()) return up.status();
  return WorkerSession{.conn = *std::move(conn), .up = *std::move(up)};
}

SessionAttempts::SessionAttempts(Backoff backoff)
    : backoff_(std::move(backoff)) {}

absl::StatusOr<WorkerSession> SessionAttempts::Open(
    absl::Time now,
    const std::function<absl::StatusOr<WorkerSession>()>& open) {
  if (now < next_) return failed_;
  absl::StatusOr<WorkerSession> opened = open();
  if (opened.ok() && !opened->up.subscription.refused.empty()) {
    if (opened->up.subscription.refused != refused_) {
      spdlog::error("relay: {}", opened->up.subscription.refused);
    }
    refused_ = opened->up.subscription.refused;
    opened = absl::FailedPreconditionError(refused_);
  }
  if (!opened.ok()) {
    failed_ = opened.status();
    spdlog::warn("relay: connecting: {}; retrying",
                 std::string(failed_.message()));
    next_ = now + backoff_.Next();
    return failed_;
  }
  refused_.clear();
  backoff_.Reset();
  next_ = absl::InfinitePast();
  return opened;
}

}  // namespace outbox::relay
