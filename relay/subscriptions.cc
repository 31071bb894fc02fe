#include "relay/subscriptions.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "common/schema.h"
#include "relay/outbox_log.h"

namespace outbox::relay {

std::string SubscriptionInfo::PinDescription() const {
  if (retention_pinned_seconds <= 0) return "";
  const std::string what =
      pinned_by == "dead_letter" ? "a dead letter"
      : pinned_by == "diverged"  ? "a diverged event"
      : pinned_by == "paused"    ? "a paused subscription's event"
      : pinned_by == "abandoned" ? "an event no relay delivers"
                                 : "a pending event";
  return absl::StrCat(
      what, ", seq ", lowest_seq, ", for ",
      absl::FormatDuration(absl::Trunc(absl::Seconds(retention_pinned_seconds),
                                       absl::Seconds(1))),
      " past the retention");
}

std::vector<SubscriptionInfo> ReadSubscriptions(pqxx::transaction_base& tx,
                                                absl::Duration retention,
                                                SubscriptionDetail detail) {
  std::vector<SubscriptionInfo> out;
  const bool counts = detail == SubscriptionDetail::kCounts;
  const std::map<std::string, HealDue> heals =
      detail == SubscriptionDetail::kGauges ? std::map<std::string, HealDue>{}
                                            : DueHeals(tx);
  // The counts read every delivery row of a subscription: an admin's
  // question, bounded by the session's statement_timeout.
  const std::string count_rows =
      counts ? "CROSS JOIN LATERAL (SELECT count(*) FILTER (WHERE status = "
               "'pending') AS pending, count(*) FILTER (WHERE status = "
               "'dead') AS dead, count(*) FILTER (WHERE status = 'diverged') "
               "AS diverged FROM outbox_delivery d WHERE d.subscription = "
               "s.name) c "
             : "CROSS JOIN (SELECT 0 AS pending, 0 AS dead, 0 AS diverged) c ";
  for (const auto& row : tx.exec(
           "SELECT s.name, extract(epoch FROM s.created_at)::float8 AS "
           "created_at, s.start_seq, c.pending, c.dead, c.diverged, "
           "(SELECT count(*) FROM outbox_relay_members m WHERE "
           "m.subscription = s.name AND m.expires_at > now()) AS "
           "relays_alive, coalesce(u.seq, 0) AS lowest_seq, "
           "coalesce(u.status, '') AS lowest_status, "
           "coalesce(extract(epoch FROM now() - op.created_at), 0)::float8 "
           "AS oldest_pending, s.paused_at IS NOT NULL AS paused, "
           "coalesce(s.paused_by, '') AS paused_by, "
           "coalesce(s.paused_reason, '') AS paused_reason, "
           "coalesce(extract(epoch FROM s.paused_at), 0)::float8 AS "
           "paused_at, coalesce(extract(epoch FROM now() - o.created_at), "
           "0)::float8 AS lowest_age, "
           "s.start_tick IS NOT NULL AS on_log "
           "FROM subscriptions s " +
           count_rows +
           "LEFT JOIN LATERAL (SELECT d.seq, d.status FROM outbox_delivery d "
           "WHERE d.subscription = s.name ORDER BY d.seq LIMIT 1) u ON true "
           "LEFT JOIN outbox o ON o.seq = u.seq "
           "LEFT JOIN LATERAL (SELECT d.seq FROM outbox_delivery d WHERE "
           "d.subscription = s.name AND d.status = 'pending' ORDER BY d.seq "
           "LIMIT 1) p ON true "
           "LEFT JOIN outbox op ON op.seq = p.seq "
           "ORDER BY s.name")) {
    SubscriptionInfo s;
    s.name = row["name"].as<std::string>();
    s.created_at = absl::FromUnixMicros(
        static_cast<int64_t>(row["created_at"].as<double>() * 1e6));
    s.start_seq = row["start_seq"].as<int64_t>();
    s.pending = row["pending"].as<int64_t>();
    s.dead_letters = row["dead"].as<int64_t>();
    s.diverged = row["diverged"].as<int64_t>();
    s.relays_alive = row["relays_alive"].as<int64_t>();
    s.lowest_seq = row["lowest_seq"].as<int64_t>();
    s.lowest_status = row["lowest_status"].as<std::string>();
    s.oldest_pending_seconds =
        std::max(0.0, row["oldest_pending"].as<double>());
    s.paused = row["paused"].as<bool>();
    s.on_log = row["on_log"].as<bool>();
    s.paused_by = row["paused_by"].as<std::string>();
    s.paused_reason = row["paused_reason"].as<std::string>();
    if (s.paused) {
      s.paused_at = absl::FromUnixMicros(
          static_cast<int64_t>(row["paused_at"].as<double>() * 1e6));
    }
    if (auto h = heals.find(s.name); h != heals.end()) {
      s.heal_due = h->second.Text();
    }
    double lowest_age = row["lowest_age"].as<double>();
    if (counts && s.on_log) {
      // What the log owes besides the exceptions counted above.
      absl::StatusOr<std::map<int, LogOwed>> owed =
          LogOwedBy(tx, s.name, {}, kLogOwedCountCap);
      if (!owed.ok()) throw std::runtime_error(owed.status().ToString());
      const LogOwed log_owed = LogOwedTotal(*owed);
      s.pending += log_owed.events;
      s.oldest_pending_seconds =
          std::max(s.oldest_pending_seconds, log_owed.oldest_seconds);
      if (log_owed.lowest_seq > 0 &&
          (s.lowest_seq == 0 || log_owed.lowest_seq < s.lowest_seq)) {
        s.lowest_seq = log_owed.lowest_seq;
        s.lowest_status = "pending";
        lowest_age = log_owed.oldest_seconds;
      }
    }
    if (retention > absl::ZeroDuration() && s.lowest_seq > 0 &&
        lowest_age > absl::ToDoubleSeconds(retention)) {
      s.retention_pinned_seconds =
          lowest_age - absl::ToDoubleSeconds(retention);
      s.pinned_by = s.paused                        ? "paused"
                    : s.relays_alive == 0           ? "abandoned"
                    : s.lowest_status == "dead"     ? "dead_letter"
                    : s.lowest_status == "diverged" ? "diverged"
                                                    : "pending";
    }
    out.push_back(std::move(s));
  }
  return out;
}

absl::Status ActOnSubscription(pqxx::transaction_base& tx,
                               const std::string& name,
                               SubscriptionAction action,
                               const std::string& actor,
                               const std::string& reason, bool force) {
  const pqxx::result cur = tx.exec_params(
      "SELECT paused_at IS NOT NULL AS paused, coalesce(paused_by, '') AS "
      "paused_by, start_tick IS NOT NULL AS on_log, (SELECT count(*) FROM "
      "outbox_relay_members m WHERE m.subscription = s.name AND "
      "m.expires_at > now()) AS relays FROM subscriptions s WHERE name = $1 "
      "FOR UPDATE",
      name);
  if (cur.empty()) {
    return absl::NotFoundError(
        absl::StrCat("subscription: no subscription \"", name, "\""));
  }
  const bool paused = cur[0]["paused"].as<bool>();
  const bool on_log = cur[0]["on_log"].as<bool>();
  const int64_t relays = cur[0]["relays"].as<int64_t>();
  const char* verb = "pause";
  std::string detail;
  switch (action) {
    case SubscriptionAction::kPause:
      if (paused) {
        return absl::FailedPreconditionError(
            absl::StrCat("subscription ", name, " is paused already (by ",
                         cur[0]["paused_by"].as<std::string>(), ")"));
      }
      tx.exec_params(
          "UPDATE subscriptions SET paused_at = now(), paused_by = $2, "
          "paused_reason = $3 WHERE name = $1",
          name, actor, reason);
      break;
    case SubscriptionAction::kResume:
      verb = "resume";
      if (!paused) {
        return absl::FailedPreconditionError(
            absl::StrCat("subscription ", name, " is not paused"));
      }
      tx.exec_params(
          "UPDATE subscriptions SET paused_at = NULL, paused_by = NULL, "
          "paused_reason = NULL WHERE name = $1",
          name);
      break;
    case SubscriptionAction::kDrop: {
      verb = "drop";
      if (relays > 0 && !force) {
        return absl::FailedPreconditionError(absl::StrCat(
            relays, " relay(s) deliver subscription ", name,
            " now: stop them first (a relay of a dropped subscription "
            "refuses to make it again without --resubscribe), or force"));
      }
      // What the log owed it besides, counted before its positions go.
      absl::StatusOr<std::map<int, LogOwed>> owed =
          LogOwedBy(tx, name, {}, kLogOwedCountCap);
      if (!owed.ok()) return owed.status();
      const int64_t log_owed = LogOwedTotal(*owed).events;
      const pqxx::row gone = tx.exec_params1(
          "WITH d AS (DELETE FROM outbox_delivery WHERE subscription = $1 "
          "RETURNING status) SELECT count(*) FILTER (WHERE status = "
          "'pending'), count(*) FILTER (WHERE status = 'dead'), count(*) "
          "FILTER (WHERE status = 'diverged') FROM d",
          name);
      tx.exec_params("DELETE FROM outbox_log_positions WHERE subscription = $1",
                     name);
      tx.exec_params(
          "DELETE FROM outbox_partition_leases WHERE subscription = $1", name);
      tx.exec_params("DELETE FROM outbox_relay_members WHERE subscription = $1",
                     name);
      tx.exec_params(
          "DELETE FROM outbox_divergences WHERE subscription = $1 AND "
          "resolved_at IS NULL",
          name);
      tx.exec_params("DELETE FROM subscriptions WHERE name = $1", name);
      detail = absl::StrCat("owed then: ", gone[0].as<int64_t>() + log_owed,
                            " pending, ", gone[1].as<int64_t>(), " dead, ",
                            gone[2].as<int64_t>(), " diverged; ", relays,
                            " relay(s) alive");
      break;
    }
    case SubscriptionAction::kToLog:
      verb = "to_log";
      if (on_log) {
        return absl::FailedPreconditionError(
            absl::StrCat("subscription ", name,
                         " is delivered from the outbox log already"));
      }
      detail = absl::StrCat(
          "start tick ",
          tx.exec_params1("SELECT outbox_log_subscribe($1)", name)[0]
              .as<int64_t>());
      break;
    case SubscriptionAction::kToRows:
      verb = "to_rows";
      if (!on_log) {
        return absl::FailedPreconditionError(
            absl::StrCat("subscription ", name,
                         " is not delivered from the outbox log: it has "
                         "delivery rows already"));
      }
      detail = absl::StrCat(
          "owed as rows: ",
          tx.exec_params1("SELECT outbox_log_unsubscribe($1)", name)[0]
              .as<int64_t>(),
          " events the log had not delivered");
      break;
  }
  tx.exec_params(
      "INSERT INTO subscription_actions (subscription, action, actor, reason, "
      "detail) VALUES ($1, $2, $3, $4, $5)",
      name, verb, actor, reason, detail);
  return absl::OkStatus();
}

std::optional<SubscriptionState> ReadSubscriptionState(
    pqxx::transaction_base& tx, const std::string& name) {
  const pqxx::result r = tx.exec_params(
      "SELECT paused_at IS NOT NULL AS paused, coalesce(paused_by, '') AS "
      "paused_by, coalesce(paused_reason, '') AS paused_reason, start_tick "
      "IS NOT NULL AS on_log FROM subscriptions WHERE name = $1",
      name);
  if (r.empty()) return std::nullopt;
  SubscriptionState state{.on_log = r[0]["on_log"].as<bool>()};
  if (r[0]["paused"].as<bool>()) {
    state.paused = absl::StrCat("by ", r[0]["paused_by"].as<std::string>(),
                                ": ", r[0]["paused_reason"].as<std::string>());
  }
  return state;
}

SubscriptionWatch::SubscriptionWatch(std::string subscription,
                                     std::string replica)
    : subscription_(std::move(subscription)), replica_(std::move(replica)) {}

absl::StatusOr<SubscriptionState> SubscriptionWatch::Read(
    pqxx::transaction_base& tx) {
  std::optional<SubscriptionState> state =
      ReadSubscriptionState(tx, subscription_);
  if (!state.has_value()) {
    absl::Status gone = absl::NotFoundError(absl::StrCat(
        "subscription ", subscription_, " is gone from the database"));
    spdlog::error("relay: {}", std::string(gone.message()));
    return gone;
  }
  std::string paused;
  if (!state->paused.empty()) {
    paused =
        absl::StrCat("subscription ", subscription_, " paused ", state->paused);
  }
  if (paused != paused_) {
    if (paused.empty()) {
      spdlog::info("relay {}: subscription {} resumed: claiming again",
                   replica_, subscription_);
    } else {
      spdlog::warn("relay {}: {}; it claims nothing until resumed", replica_,
                   paused);
    }
    paused_ = std::move(paused);
  }
  return *std::move(state);
}

std::optional<std::string> LastDrop(pqxx::transaction_base& tx,
                                    const std::string& name) {
  const pqxx::result r = tx.exec_params(
      "SELECT action, actor, to_char(at, 'YYYY-MM-DD HH24:MI:SS TZ') AS at, "
      "reason "
      "FROM subscription_actions WHERE subscription = $1 AND action IN "
      "('drop', 'resubscribe') ORDER BY id DESC LIMIT 1",
      name);
  if (r.empty() || r[0]["action"].as<std::string>() != "drop") {
    return std::nullopt;
  }
  return absl::StrCat("by ", r[0]["actor"].as<std::string>(), " at ",
                      r[0]["at"].as<std::string>(), ": ",
                      r[0]["reason"].as<std::string>());
}

}  // namespace outbox::relay
