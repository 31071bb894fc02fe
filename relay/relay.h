#pragma once
// The relay: delivers committed outbox rows to the consumer at least once and
// in per-aggregate order.
//
// One worker thread owns one database connection, on which it holds
// PostgreSQL session advisory locks for the partitions it owns, claims
// pending rows of those partitions in seq order, and marks rows after the
// consumer's answer (never before: a crash anywhere means redelivery). Rows
// stream over one long-lived EventSink.Deliver stream, bounded by a credit
// window. Replicas count each other through a membership advisory lock and
// each takes ceil(partitions / replicas); a replica that dies loses its
// locks with its session, and the others take its partitions over.
//
// A REJECTED answer counts an attempt and reschedules the row with backoff;
// after max_attempts the row is a dead letter. Later rows of that aggregate
// wait behind it (and only those). Transport failures never count.

#include <pqxx/pqxx>

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "common/db.h"
#include "common/metrics.h"
#include "common/tls.h"
#include "common/watchdog.h"
#include "outbox/v1/consumer.grpc.pb.h"
#include "outbox/v1/relay.pb.h"
#include "relay/delivery_stream.h"
#include "relay/outbox_row.h"


namespace outbox::relay {

// The claim: pending rows of partitions $1 (int[]), not in flight ($2,
// bigint[]), at most $3, in seq order. Only the earliest undelivered row of
// an aggregate is claimable: its successors wait at the relay until it is
// answered, so a row that is rejected, backing off or dead stalls its own
// aggregate only, and nothing is parked at the consumer needlessly. The
// earliest-row test is a correlated scalar subquery because that always
// runs as one index lookup per candidate, whatever the statistics; the
// equivalent anti-join was planned as a quadratic nested loop on stale
// statistics (9 s a claim behind 200k delivered rows).
// Columns: kEventColumns, then partition.
inline constexpr char kClaimSql[] =
    "SELECT seq, prev_seq, event_id::text, aggregate_type, aggregate_id, "
    "event_type, schema_version, coalesce(trace_parent, ''), payload, "
    "partition FROM outbox o WHERE o.status = 'pending' "
    "AND o.partition = ANY($1::int[]) AND o.available_at <= now() "
    "AND NOT (o.seq = ANY($2::bigint[])) "
    "AND o.seq = (SELECT min(b.seq) FROM outbox b WHERE "
    "b.aggregate_id = o.aggregate_id AND b.status <> 'delivered') "
    "ORDER BY o.seq LIMIT $3";

struct RelayOptions {
  std::string db_url;
  DbSession session;  // limits of every database session
  std::string consumer;  // host:port of EventSink
  ClientTlsFiles consumer_tls;  // none: plaintext
  int max_attempts = 5;
  int batch_size = 128;   // events per DeliverRequest
  int window = 1024;      // events in flight at most
  // Batches in flight at most. Two keep the consumer busy while an answer
  // travels back; more would only split the backlog into smaller batches
  // (one commit each) instead of letting a batch fill up.
  int pipeline_depth = 2;
  absl::Duration poll_interval = absl::Milliseconds(500);
  absl::Duration ack_timeout = absl::Seconds(15);
  absl::Duration rebalance_interval = absl::Seconds(1);
  absl::Duration retry_initial = absl::Milliseconds(100);  // transport backoff
  absl::Duration retry_max = absl::Seconds(5);
  absl::Duration reject_backoff = absl::Milliseconds(500);  // first REJECTED
  absl::Duration reject_backoff_max = absl::Seconds(60);
  // Delivered rows older than this are deleted in small batches by the
  // replica that owns partition 0, so the outbox does not grow forever.
  // Zero keeps every row.
  absl::Duration retention;
};

// A consistent copy of the relay's own state, for stats.
struct RelayState {
  std::vector<int> partitions_owned;
  int64_t in_flight = 0;
  bool stream_connected = false;
  std::string replica_id;
  int64_t delivered = 0;  // rows this process marked delivered
  int64_t rejected = 0;   // REJECTED answers this process recorded
};

class Relay {
 public:
  // `metrics` must outlive the relay; so must `watchdog` (may be null),
  // which hears whether each round of claims and marks succeeded.
  Relay(RelayOptions options, Metrics* metrics, Watchdog* watchdog = nullptr);
  ~Relay();  // Stop(0) if still running

  void Start();
  // Stops claiming, waits up to `drain` for answers to what is in flight,
  // marks what was answered, releases partitions. Unanswered rows stay
  // pending. Idempotent.
  void Stop(absl::Duration drain);

  RelayState State() const;

  // application_name of the relay's database session, unique to it.
  const std::string& session_name() const { return session_name_; }

 private:
  struct InFlight {
    uint64_t batch_id;
    absl::Time sent_at;
    std::vector<int64_t> seqs;
    std::vector<int> partitions;
  };
  struct Mark {
    int64_t seq;
    bool delivered;      // else rejected
    std::string reason;  // for rejected
  };

  void Run();
  void Listen();
  void Wake();
  // Each returns false when the database connection is lost.
  bool EnsureConnection();
  bool JoinMembership(pqxx::connection& conn);
  bool Rebalance();
  bool Claim();
  bool FlushMarks();
  bool PruneDelivered();
  void HandleResponses();
  void DropStream(const std::string& why);
  void EnsureStream();

  const RelayOptions options_;
  const std::string replica_id_;
  // application_name of the worker's session: unique to this process, so a
  // reconnect can end its own stale session (and free its locks).
  const std::string session_name_;
  Watchdog* const watchdog_;
  Counter* const delivered_;
  Counter* const rejected_;
  Counter* const dead_;
  Counter* const reconnects_;
  Counter* const batches_;
  Counter* const pruned_;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::EventSink::Stub> stub_;

  // Worker-thread state.
  std::unique_ptr<pqxx::connection> conn_;
  int member_key_;  // second key of this session's membership lock
  std::string last_db_error_;  // of the last failed step, for the watchdog
  // Statements run on the outbox table: a pass that runs none (a full
  // window, nothing to mark) tells the watchdog nothing.
  int64_t outbox_statements_ = 0;
  std::set<int> owned_;
  std::unique_ptr<DeliveryStream> stream_;
  absl::Time next_stream_attempt_ = absl::InfinitePast();
  absl::Duration stream_backoff_;
  absl::Time next_db_attempt_ = absl::InfinitePast();
  absl::Duration db_backoff_;
  absl::Time next_rebalance_ = absl::InfinitePast();
  absl::Time next_prune_ = absl::InfinitePast();
  uint64_t next_batch_id_ = 1;
  std::map<uint64_t, InFlight> in_flight_;
  std::set<int64_t> in_flight_seqs_;
  std::vector<Mark> marks_;  // answered, not yet written
  std::set<int> releasing_;  // partitions being given up: no new claims

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool woken_ = false;
  bool stopping_ = false;
  absl::Time drain_deadline_;
  RelayState state_;  // copy for State(), under mu_

  std::atomic<bool> listen_stop_{false};
  std::thread worker_;
  std::thread listener_;
};

}  // namespace outbox::relay
