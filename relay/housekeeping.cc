#include "relay/housekeeping.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <optional>
#include <pqxx/pqxx>
#include <stdexcept>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/schema.h"
#include "relay/delivery_store.h"
#include "relay/outbox_log.h"
#include "relay/retention.h"

namespace outbox::relay {
namespace {

// Where the backlog figures' scan stops (the gauges' help says so).
constexpr int kBacklogScanCap = 100000;

// Seconds since `since_ms` (Unix ms); 0 when it is 0 (not since anything).
double SecondsSince(const std::atomic<int64_t>& since_ms) {
  const int64_t since = since_ms.load();
  if (since == 0) return 0.0;
  return std::max(0.0, (absl::ToUnixMillis(absl::Now()) - since) / 1000.0);
}

// A gauge's one series when `value` is known (>= 0), else none.
std::vector<std::pair<Labels, double>> IfPartitioned(int64_t value) {
  std::vector<std::pair<Labels, double>> out;
  if (value >= 0) out.push_back({{}, static_cast<double>(value)});
  return out;
}

}  // namespace

Housekeeping::Housekeeping(Options options, Metrics* metrics)
    : options_(std::move(options)),
      pruned_(metrics->AddCounter("outbox_relay_pruned_total",
                                  "Delivered rows deleted by --retention.")),
      heals_(metrics->AddCounter(
          "outbox_relay_heals_total",
          "Heals run (the consumer's cursors compared with what was "
          "delivered) after a database changed identity.")) {
  RegisterGauges(metrics);
}

Housekeeping::~Housekeeping() { Stop(); }

void Housekeeping::Start() {
  task_ = std::make_unique<PeriodicTask>(
      absl::Seconds(1), [this] { return Run(); },
      // Retention works off old rows in short steps this far apart, so
      // that claims and marks keep their share of the database.
      absl::Milliseconds(250));
}

void Housekeeping::Stop() {
  // Cancelled until the run in progress ends: a statement that began just
  // after one cancel meets the next.
  stop_ = true;
  while (busy_) {
    {
      absl::MutexLock lock(&conn_mu_);
      if (conn_ != nullptr) conn_->cancel_query();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  task_.reset();
}

void Housekeeping::RegisterGauges(Metrics* metrics) {
  metrics->AddGaugeFamily(
      "outbox_relay_pending_events",
      "Undelivered events of each partition this replica owns, as of the "
      "last refresh (every 15 s; the scan stops at 100000 events).",
      [this] {
        std::vector<std::pair<Labels, double>> out;
        absl::MutexLock lock(&backlog_mu_);
        for (const auto& [p, v] : backlog_.partitions) {
          out.push_back({{{"partition", std::to_string(p)}},
                         static_cast<double>(v.first)});
        }
        return out;
      });
  metrics->AddGaugeFamily(
      "outbox_relay_oldest_pending_seconds",
      "Age of the oldest undelivered event of each partition this replica "
      "owns (0: none), as of the last refresh; while refreshes fail, grown "
      "by the time since.",
      [this] {
        std::vector<std::pair<Labels, double>> out;
        absl::MutexLock lock(&backlog_mu_);
        for (const auto& [p, v] : backlog_.partitions) {
          out.push_back({{{"partition", std::to_string(p)}},
                         backlog_.Age(v.second, v.first > 0)});
        }
        return out;
      });
  metrics->AddGauge("outbox_relay_dead_letters",
                    "Dead letters of the subscription now (not requeued).",
                    [this] {
                      absl::MutexLock lock(&backlog_mu_);
                      return static_cast<double>(backlog_.dead_letters);
                    });
  metrics->AddGauge("outbox_relay_oldest_dead_letter_seconds",
                    "Since the oldest dead letter of the subscription died "
                    "(0: none).",
                    [this] {
                      absl::MutexLock lock(&backlog_mu_);
                      return backlog_.Age(backlog_.oldest_dead_seconds,
                                          backlog_.dead_letters > 0);
                    });
  metrics->AddGauge(
      "outbox_relay_heal_due_seconds",
      "How long a heal of the subscription (the consumer compared with "
      "what was delivered, after a database changed) has been requested and "
      "not run, as the replica that runs heals (the owner of partition 0) "
      "last read it; 0 when none is due, and on the other replicas. Until "
      "it runs, what the consumer lost is not delivered again and retention "
      "deletes nothing.",
      [this] { return SecondsSince(heal_due_since_ms_); });
  metrics->AddGaugeFamily(
      "outbox_partition_seqs_left",
      "On a partitioned outbox (outboxctl partition-outbox): how many seqs "
      "the writers may still draw before an insert finds no child, as this "
      "replica last made children ahead (every replica does, every "
      "second). At 0 every append fails until a child is made; absent on a "
      "plain outbox.",
      [this] { return IfPartitioned(partition_seqs_left_.load()); });
  metrics->AddGaugeFamily(
      "outbox_partition_span_seqs",
      "On a partitioned outbox: the seqs of each child (outboxctl "
      "partition-outbox --span).",
      [this] { return IfPartitioned(partition_span_.load()); });
  metrics->AddGauge(
      "outbox_retention_held_back_seconds",
      "How long this replica's --retention has been held back, with "
      "events old enough to go, by a transaction of the outbox's database "
      "that may still commit below them (a session idle in a transaction "
      "after writing, a prepared transaction) or by a heal not yet run; 0 "
      "when it is not.",
      [this] { return SecondsSince(held_back_since_ms_); });
  // Every subscription of the database, as this replica last read them:
  // one that no relay delivers any more, or that an operator paused, shows
  // from any relay left, and so does what holds retention back.
  auto each_subscription = [this](double (*value)(const SubscriptionInfo&),
                                  bool with_kind) {
    std::vector<std::pair<Labels, double>> out;
    absl::MutexLock lock(&backlog_mu_);
    for (const SubscriptionInfo& s : backlog_.subscriptions) {
      Labels l{{"of_subscription", s.name}};
      if (with_kind) {
        l["kind"] = s.pinned_by.empty() ? "none" : s.pinned_by;
      }
      out.push_back({std::move(l), value(s)});
    }
    return out;
  };
  metrics->AddGaugeFamily(
      "outbox_subscription_relays_alive",
      "Relays delivering each subscription of the database (their "
      "membership not expired), as of the last refresh.",
      [each_subscription] {
        return each_subscription(
            [](const SubscriptionInfo& s) {
              return static_cast<double>(s.relays_alive);
            },
            false);
      });
  metrics->AddGaugeFamily(
      "outbox_subscription_paused",
      "1 while an operator has paused the subscription (outboxctl "
      "subscriptions pause).",
      [each_subscription] {
        return each_subscription(
            [](const SubscriptionInfo& s) { return s.paused ? 1.0 : 0.0; },
            false);
      });
  metrics->AddGaugeFamily(
      "outbox_retention_pinned_seconds",
      "How long past --retention the subscription's oldest undelivered "
      "event is: retention deletes nothing from there while it stays; kind "
      "says why (dead_letter, diverged, paused, abandoned, pending; none "
      "and 0 when it pins nothing).",
      [each_subscription] {
        return each_subscription(
            [](const SubscriptionInfo& s) {
              return s.retention_pinned_seconds;
            },
            true);
      });
  metrics->AddGauge(
      "outbox_relay_backlog_figures_age_seconds",
      "Since this replica last read its backlog figures (pending events, "
      "dead letters, their ages) from the database, or since it started; "
      "about the refresh interval (15 s) at most while reads succeed.",
      [this] {
        absl::MutexLock lock(&backlog_mu_);
        return absl::ToDoubleSeconds(absl::Now() - backlog_.as_of);
      });
  metrics->AddGauge(
      "outbox_relay_diverged_aggregates",
      "Aggregates of the subscription whose producer and consumer histories "
      "diverged and wait for an operator (outboxctl diverged).",
      [this] {
        absl::MutexLock lock(&backlog_mu_);
        return static_cast<double>(backlog_.diverged);
      });
}

void Housekeeping::RefreshBacklog(pqxx::connection& conn,
                                  const std::vector<int>& owned) {
  Backlog b;
  for (int p : owned) b.partitions[p] = {0, 0.0};
  auto unit = OpenUnit(conn);
  pqxx::transaction_base& tx = *unit;
  for (const auto& [partition, pending] :
       PendingRows(tx, options_.subscription, owned, kBacklogScanCap)) {
    b.partitions[partition] = {pending.events, pending.oldest_seconds};
  }
  // On the log, what it still owes (nothing for a subscription on rows).
  absl::StatusOr<std::map<int, LogOwed>> owed =
      LogOwedBy(tx, options_.subscription, owned, kBacklogScanCap);
  if (!owed.ok()) throw std::runtime_error(owed.status().ToString());
  for (const auto& [partition, o] : *owed) {
    auto& [n, age] = b.partitions[partition];
    n += o.events;
    age = std::max(age, o.oldest_seconds);
  }
  const WaitingFigures dead = DeadLetters(tx, options_.subscription);
  b.dead_letters = dead.events;
  b.oldest_dead_seconds = dead.oldest_seconds;
  b.diverged = OpenDivergences(tx, options_.subscription);
  b.subscriptions =
      ReadSubscriptions(tx, options_.retention, SubscriptionDetail::kGauges);
  unit->commit();
  b.as_of = absl::Now();
  absl::MutexLock lock(&backlog_mu_);
  backlog_ = std::move(b);
}

bool Housekeeping::Run() {
  busy_ = true;
  absl::Cleanup idle = [this] { busy_ = false; };
  if (stop_) return false;
  const std::vector<int> owned = options_.owned();
  const char* step = "housekeeping";
  // Until the figures are read: then a failure leaves them stale.
  bool refresh_due =
      owned != backlog_owned_ || absl::Now() >= next_backlog_refresh_;
  try {
    if (conn_ == nullptr || !conn_->is_open()) {
      auto conn = Connect(options_.db_url, "outbox-relay-housekeeping",
                          options_.session);
      if (!conn.ok()) throw std::runtime_error(conn.status().ToString());
      absl::MutexLock lock(&conn_mu_);
      conn_ = std::move(*conn);
    }
    Connection& conn = *conn_;
    if (stop_) return false;
    if (refresh_due) {
      step = "backlog figures";
      RefreshBacklog(conn, owned);
      refresh_due = false;
      backlog_owned_ = owned;
      next_backlog_refresh_ = absl::Now() + options_.backlog_refresh;
    }
    bool more = false;
    // By the replica that owns partition 0: one at a time, mostly (two
    // for a moment after it moves do no harm).
    if (options_.retention > absl::ZeroDuration() && !owned.empty() &&
        owned.front() == 0 && absl::Now() >= next_prune_ && !stop_) {
      step = "retention";
      std::string held_back;
      more = PruneDelivered(conn, &held_back);
      FollowHeldBack(held_back);
      // Held back by a transaction that may still commit below what is
      // old enough: it is usually over within a second.
      if (!more) {
        next_prune_ = absl::Now() + (!held_back.empty()
                                         ? std::min(options_.retention_interval,
                                                    absl::Seconds(1))
                                         : options_.retention_interval);
      }
    }
    // Every replica: children made ahead matter to every writer, and one
    // replica killed must not leave them to run out while its partitions
    // wait for their leases to lapse.
    step = "partitions";
    if (!stop_) ExtendPartitions(conn);
    if (!owned.empty() && owned.front() == 0 && !stop_) {
      step = "heal";
      HealIfDue(conn);
    } else {
      SetHealDue(std::nullopt);  // another replica runs heals
    }
    step = "vacuum";
    if (!stop_ && !conn.info().pooled) VacuumDeliveries(conn);
    return more;
  } catch (const std::exception& e) {
    if (!stop_) {
      spdlog::warn("relay: {}: {}", step,
                   std::string(StatusFromException(e).message()));
    }
    if (refresh_due) {
      absl::MutexLock lock(&backlog_mu_);
      backlog_.stale = true;
    }
    absl::MutexLock lock(&conn_mu_);
    conn_.reset();
    return false;
  }
}

void Housekeeping::SetHealDue(const std::optional<HealDue>& due) {
  heal_due_since_ms_ =
      due.has_value()
          ? absl::ToUnixMillis(absl::Now() -
                               std::max(absl::ZeroDuration(), due->age))
          : 0;
}

void Housekeeping::HealIfDue(pqxx::connection& conn) {
  if (absl::Now() < next_heal_check_) return;
  next_heal_check_ = absl::Now() + absl::Seconds(1);
  std::optional<HealDue> due;
  {
    auto tx = OpenUnit(conn);
    due = DueHeal(*tx, options_.subscription);
    tx->commit();
  }
  SetHealDue(due);
  if (!due.has_value()) return;
  if (options_.consumer == nullptr) {
    // A broker keeps no cursors to compare: its per-subject chain check
    // answers DIVERGED for another history instead, event by event. The
    // request is closed, so that verify and reconcile do not wait for a
    // heal nobody runs.
    spdlog::warn(
        "relay: heal of subscription {} requested ({}), but the sink keeps "
        "no cursors: events of another history are refused as DIVERGED "
        "when they are published",
        options_.subscription, due->reason);
    auto tx = OpenUnit(conn);
    HealDone(*tx, options_.subscription, *due);
    tx->commit();
    SetHealDue(std::nullopt);
    return;
  }
  if (healer_ == nullptr) {
    healer_ =
        std::make_unique<Healer>(options_.subscription, options_.consumer);
  }
  spdlog::warn("relay: heal of subscription {}: {}", options_.subscription,
               due->reason);
  absl::StatusOr<HealReport> report = healer_->Run(conn, options_.source());
  if (!report.ok()) {
    // The consumer or the database is away: the next round tries again.
    spdlog::warn("relay: heal of subscription {}: {}; trying again",
                 options_.subscription, std::string(report.status().message()));
    next_heal_check_ = absl::Now() + absl::Seconds(2);
    return;
  }
  heals_->Add();
  options_.redelivered_heal->Add(report->redelivered);
  options_.diverged->Add(report->diverged);
  {
    auto tx = OpenUnit(conn);
    HealDone(*tx, options_.subscription, *due);
    tx->commit();
  }
  SetHealDue(std::nullopt);  // unless a newer one came: the next check says
  if (report->redelivered > 0 || report->diverged > 0) {
    spdlog::warn("relay: heal of subscription {} done: {}",
                 options_.subscription, report->Summary());
  } else {
    spdlog::info("relay: heal of subscription {} done, nothing missing: {}",
                 options_.subscription, report->Summary());
  }
  if (report->redelivered > 0) options_.wake();
}

void Housekeeping::ExtendPartitions(pqxx::connection& conn) {
  pqxx::result result;
  try {
    auto tx = OpenUnit(conn);
    result = tx->exec(
        "SELECT outbox_extend_partitions() AS left, (SELECT span FROM "
        "outbox_rotation) AS span");
    tx->commit();
  } catch (const pqxx::sql_error& e) {
    // Refused (no CREATE on the schema, a lock not granted in time): the
    // rest of the round (figures, retention, heals) goes on, and the
    // gauge keeps what was left when it last succeeded.
    if (absl::Now() >= next_partitions_warning_) {
      next_partitions_warning_ = absl::Now() + absl::Minutes(1);
      spdlog::warn(
          "relay: partitions: cannot make the outbox's children ahead: {}",
          std::string(StatusFromException(e).message()));
    }
    return;
  }
  const pqxx::row r = result[0];
  const int64_t now = r["left"].is_null() ? -1 : r["left"].as<int64_t>();
  partition_span_ = r["span"].is_null() ? -1 : r["span"].as<int64_t>();
  if (now >= 0 && partition_seqs_left_.load() >= 0 &&
      now > partition_seqs_left_.load() + 1) {
    spdlog::info("relay: outbox children made ahead: {} seqs left", now);
  }
  partition_seqs_left_ = now;
}

void Housekeeping::FollowHeldBack(const std::string& held_back) {
  if (held_back.empty()) {
    held_back_since_ms_ = 0;
    held_back_warned_ = false;
    return;
  }
  const int64_t now = absl::ToUnixMillis(absl::Now());
  if (held_back_since_ms_.load() == 0) held_back_since_ms_ = now;
  const absl::Duration held =
      absl::Milliseconds(now - held_back_since_ms_.load());
  if (held >= absl::Minutes(5) && !held_back_warned_) {
    held_back_warned_ = true;
    spdlog::warn("relay: retention held back for {} by {}",
                 absl::FormatDuration(held), held_back);
  }
}

bool Housekeeping::PruneDelivered(pqxx::connection& conn,
                                  std::string* held_back) {
  constexpr int kBatch = 1000;
  // Full batches follow each other for this long, then the step's pause:
  // a fixed count per step capped retention at 4,000 events/s whatever
  // the machine (below the producer's rate on this one), while a budget
  // of time lets it catch up wherever the database has room.
  constexpr absl::Duration kBudget = absl::Milliseconds(100);
  const absl::Time until = absl::Now() + kBudget;
  while (true) {
    // A transaction, also when the session is not pooled: PruneOutbox holds
    // a lock over two statements. Small batches keep each transaction
    // short, so vacuum is never held back.
    pqxx::work tx(conn);
    ApplyLimits(tx);
    bool dropped_child = false;
    const int64_t deleted =
        PruneOutbox(tx, options_.retention, kBatch, held_back, &dropped_child);
    tx.commit();
    pruned_->Add(deleted);
    // A rotation drops one child a call, of any size.
    if (static_cast<int>(deleted) < kBatch && !dropped_child) return false;
    if (stop_ || absl::Now() >= until) return true;
  }
}

void Housekeeping::VacuumDeliveries(pqxx::connection& conn) {
  // Delivered rows are deleted, and a claim scans the delivery table in
  // seq order from its start: until vacuum removes their index entries,
  // every claim steps over all rows delivered since, and a large backlog
  // drains ever slower. Autovacuum may wake only once a minute; so the
  // relay vacuums the table itself after each 10000 deletes, at most once a
  // second, never waiting for another vacuum of it. Behind a long history
  // one took 300 ms.
  const int64_t deleted = deleted_since_vacuum_.load();
  if (deleted < 10000) return;
  const absl::Time t0 = absl::Now();
  pqxx::nontransaction tx(conn);
  tx.exec("VACUUM (SKIP_LOCKED) outbox_delivery");
  spdlog::debug("relay: vacuumed outbox_delivery after {} deletes in {}",
                deleted, absl::FormatDuration(absl::Now() - t0));
  deleted_since_vacuum_ -= deleted;
}

}  // namespace outbox::relay
