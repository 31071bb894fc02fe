#pragma once
// What a relay does beside delivering, on a thread and a database
// connection of its own so that none of it ever holds up a claim or a
// mark (behind a long history or a large backlog each step can take
// hundreds of milliseconds, or wait on a lock):
//   - the backlog figures (pending events and the age of the oldest per
//     owned partition, dead letters, divergences, every subscription of the
//     database), read every backlog_refresh and whenever the owned
//     partitions change, and the gauges that show them;
//   - retention's deletes, in small batches, by the replica that owns
//     partition 0; on a partitioned outbox, that replica drops whole
//     children instead, and every replica keeps new ones made ahead;
//   - a heal when one is due (relay/heal.h), by that replica too;
//   - a vacuum of outbox_delivery after many deletes (Deleted()).
//
// Example (the relay):
//   Housekeeping hk({.db_url = url, .subscription = "billing",
//                    .owned = [&] { return relay.State().partitions_owned; },
//                    ...}, &metrics);
//   hk.Start();
//   ... the worker: hk.Deleted(rows_it_deleted);
//   hk.Stop();  // cancels a statement in progress, joins

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/db.h"
#include "common/metrics.h"
#include "common/periodic.h"
#include "outbox/v1/sink.grpc.pb.h"
#include "relay/delivery_store.h"
#include "relay/heal.h"
#include "relay/subscriptions.h"

namespace outbox::relay {

class Housekeeping {
 public:
  struct Options {
    std::string db_url;
    std::string subscription;
    DbSession session;
    // Delivered rows older than this are deleted (zero keeps every row).
    absl::Duration retention;
    // How long retention rests once it has caught up (nothing left to
    // delete) before it looks again.
    absl::Duration retention_interval = absl::Minutes(1);
    absl::Duration backlog_refresh = absl::Seconds(15);
    // The partitions the relay owns now, ascending. Thread-safe.
    std::function<std::vector<int>()> owned;
    // The name the outbox's events carry (for heals). Thread-safe.
    std::function<std::string()> source;
    // A heal owed events again: the worker should look for them now.
    std::function<void()> wake;
    // The consumer, for heals; outlives this. Null: none (a broker).
    v1::EventSink::Stub* consumer = nullptr;
    // Counted by heals and by the worker alike; outlive this.
    Counter* redelivered_heal = nullptr;
    Counter* diverged = nullptr;
  };

  // Registers the backlog gauges and the counters of retention and heals
  // in `metrics`, which must outlive this.
  Housekeeping(Options options, Metrics* metrics);
  ~Housekeeping();  // Stop()
  Housekeeping(const Housekeeping&) = delete;
  Housekeeping& operator=(const Housekeeping&) = delete;

  // Starts the thread (runs at once, then every second); at most once.
  void Start();
  // Cancels a statement in progress (a retention delete waiting on a lock,
  // a long vacuum: what it had not done is done by the next start) and
  // joins. Idempotent.
  void Stop();

  // The worker deleted `rows` of outbox_delivery (delivered marks): after
  // enough of them the table is vacuumed. Thread-safe.
  void Deleted(int64_t rows) { deleted_since_vacuum_ += rows; }

 private:
  // The backlog as the database saw it at the last refresh (never read on
  // a scrape).
  struct Backlog {
    // Per owned partition: pending events (the scan stops at
    // kBacklogScanCap in all) and the age of the oldest.
    std::map<int, std::pair<int64_t, double>> partitions;
    int64_t dead_letters = 0;
    double oldest_dead_seconds = 0;
    int64_t diverged = 0;  // open divergences of the subscription
    // Every subscription of the database, without counts (for the gauges
    // of retention and of abandoned or paused subscriptions).
    std::vector<SubscriptionInfo> subscriptions;
    absl::Time as_of = absl::Now();  // when they were read (or none yet)
    // A refresh was due and failed: the ages are reported as grown since
    // as_of (their events assumed still there), so that an alert on them
    // still fires while the relay cannot read them.
    bool stale = false;
    // An age of `as_of`, as reported now.
    double Age(double age, bool any) const {
      return stale && any ? age + absl::ToDoubleSeconds(absl::Now() - as_of)
                          : age;
    }
  };

  void RegisterGauges(Metrics* metrics);
  // One round; true while retention has more to delete.
  bool Run();
  // Each throws on a database error.
  void RefreshBacklog(pqxx::connection& conn, const std::vector<int>& owned);
  // Deletes full batches for up to 100 ms; true: more may go. Sets
  // *held_back as PruneOutbox does, of its last step.
  bool PruneDelivered(pqxx::connection& conn, std::string* held_back);
  // Keeps the held-back gauge; warns once when it passes 5 minutes.
  void FollowHeldBack(const std::string& held_back);
  void HealIfDue(pqxx::connection& conn);
  // On a partitioned outbox: keeps children made ahead of the sequence
  // (outbox_extend_partitions) and the gauge of the seqs left in them.
  void ExtendPartitions(pqxx::connection& conn);
  // Keeps the heal gauge's start: `due`'s request time, or none.
  void SetHealDue(const std::optional<HealDue>& due);
  void VacuumDeliveries(pqxx::connection& conn);

  const Options options_;
  Counter* const pruned_;
  Counter* const heals_;

  mutable absl::Mutex backlog_mu_;
  Backlog backlog_ ABSL_GUARDED_BY(backlog_mu_);

  std::atomic<int64_t> deleted_since_vacuum_{0};
  // Since when retention is held back (Unix ms, 0: it is not).
  std::atomic<int64_t> held_back_since_ms_{0};
  // Since when the heal this replica runs has been due (Unix ms, 0: none,
  // or this replica runs none).
  std::atomic<int64_t> heal_due_since_ms_{0};
  // Seqs the writers may still draw before an insert finds no child of a
  // partitioned outbox, as this replica last made them; -1: the outbox is
  // not partitioned.
  std::atomic<int64_t> partition_seqs_left_{-1};
  std::atomic<int64_t> partition_span_{-1};  // its children's, or -1
  std::atomic<bool> stop_{false};
  std::atomic<bool> busy_{false};  // a Run is in progress
  // Stop reads the connection's pointer to cancel its statement; every
  // change of it is made under conn_mu_ (reads on the thread need none).
  absl::Mutex conn_mu_;
  std::unique_ptr<Connection> conn_;

  // The thread's own state.
  std::vector<int> backlog_owned_;  // the partitions of the last refresh
  absl::Time next_backlog_refresh_ = absl::InfinitePast();
  absl::Time next_prune_ = absl::InfinitePast();
  absl::Time next_heal_check_ = absl::InfinitePast();
  // When a failure to make children ahead may be logged again.
  absl::Time next_partitions_warning_ = absl::InfinitePast();
  std::unique_ptr<Healer> healer_;
  bool held_back_warned_ = false;  // logged once per hold

  std::unique_ptr<PeriodicTask> task_;  // last: it uses all of the above
};

}  // namespace outbox::relay
