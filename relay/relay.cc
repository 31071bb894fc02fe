#include "relay/relay.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include <pqxx/pqxx>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "common/db.h"
#include "common/fault.h"
#include "common/limits.h"
#include "common/ids.h"
#include "common/schema.h"

namespace outbox::relay {
namespace {

// Advisory lock classes (first key); the second key is the member's random
// key or the partition number.
constexpr int kMemberLockClass = 0x0b0d;
constexpr int kPartitionLockClass = 0x0b0e;

absl::Duration Jittered(absl::Duration d) {
  thread_local absl::BitGen gen;
  return d * absl::Uniform(gen, 0.5, 1.0);
}

class Wakeup : public pqxx::notification_receiver {
 public:
  Wakeup(pqxx::connection_base& c, std::function<void()> wake)
      : pqxx::notification_receiver(c, kNotifyChannel), wake_(std::move(wake)) {}
  void operator()(const std::string&, int) override {
    spdlog::debug("relay: NOTIFY received");
    wake_();
  }

 private:
  std::function<void()> wake_;
};

int NewMemberKey() {
  thread_local absl::BitGen gen;
  return absl::Uniform<int>(gen, 1, 1 << 30);
}

}  // namespace

Relay::Relay(RelayOptions options, Metrics* metrics, Watchdog* watchdog)
    : options_(std::move(options)),
      replica_id_([] {
        char host[256] = {0};
        gethostname(host, sizeof(host) - 1);
        return absl::StrCat(host, "/", getpid(), "/", NewUuid().substr(0, 8));
      }()),
      session_name_(absl::StrCat("outbox-relay ",
                                 replica_id_.substr(replica_id_.size() - 8))),
      watchdog_(watchdog),
      delivered_(metrics->AddCounter("outbox_relay_delivered_total",
                                     "Rows marked delivered by this process.")),
      rejected_(metrics->AddCounter(
          "outbox_relay_rejected_total",
          "REJECTED answers (each counts an attempt of its row).")),
      dead_(metrics->AddCounter("outbox_relay_dead_letters_total",
                                "Rows that became dead letters.")),
      reconnects_(metrics->AddCounter(
          "outbox_relay_stream_failures_total",
          "Delivery streams that broke or timed out.")),
      batches_(metrics->AddCounter("outbox_relay_batches_total",
                                   "Delivery batches sent.")),
      pruned_(metrics->AddCounter("outbox_relay_pruned_total",
                                  "Delivered rows deleted by --retention.")),
      member_key_(NewMemberKey()),
      stream_backoff_(options_.retry_initial),
      db_backoff_(options_.retry_initial) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  // gRPC's own reconnect backoff decides how soon a restarted consumer is
  // seen again: keep it short (and no longer than --retry_max), or a
  // consumer that restarts every few seconds is never connected to.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::clamp<int64_t>(
                  absl::ToInt64Milliseconds(options_.retry_max), 100, 1000)));
  channel_ = grpc::CreateCustomChannel(
      options_.consumer, MakeChannelCredentials(options_.consumer_tls), args);
  stub_ = v1::EventSink::NewStub(channel_);
  metrics->AddGauge("outbox_relay_in_flight", "Events sent, not yet answered.",
                    [this] { return static_cast<double>(State().in_flight); });
  metrics->AddGauge("outbox_relay_partitions_owned",
                    "Partitions this replica streams.", [this] {
                      return static_cast<double>(
                          State().partitions_owned.size());
                    });
  metrics->AddGauge("outbox_relay_stream_connected",
                    "1 while a delivery stream is open.",
                    [this] { return State().stream_connected ? 1.0 : 0.0; });
  state_.replica_id = replica_id_;
}

Relay::~Relay() { Stop(absl::ZeroDuration()); }

void Relay::Start() {
  spdlog::info("relay {}: delivering to {}", replica_id_, options_.consumer);
  worker_ = std::thread([this] { Run(); });
  listener_ = std::thread([this] { Listen(); });
}

void Relay::Stop(absl::Duration drain) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    drain_deadline_ = absl::Now() + drain;
    woken_ = true;
    cv_.notify_all();
  }
  if (worker_.joinable()) worker_.join();
  listen_stop_ = true;
  if (listener_.joinable()) listener_.join();
}

RelayState Relay::State() const {
  std::lock_guard<std::mutex> lock(mu_);
  RelayState state = state_;
  state.delivered = delivered_->value();
  state.rejected = rejected_->value();
  return state;
}

void Relay::Wake() {
  std::lock_guard<std::mutex> lock(mu_);
  woken_ = true;
  cv_.notify_all();
}

void Relay::Listen() {
  while (!listen_stop_) {
    auto conn =
        Connect(options_.db_url, "outbox-relay-listen", options_.session);
    if (!conn.ok()) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      continue;
    }
    try {
      Wakeup wakeup(**conn, [this] { Wake(); });
      // Rows committed while we were not listening are found by the poll.
      Wake();
      while (!listen_stop_) (*conn)->await_notification(0, 200000);
    } catch (const std::exception& e) {
      spdlog::warn("relay: LISTEN connection lost ({}); polling until it is "
                   "back",
                   std::string(StatusFromException(e).message()));
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  }
}

bool Relay::JoinMembership(pqxx::connection& conn) {
  pqxx::nontransaction tx(conn);
  // A session of this process that the server still keeps (the network
  // dropped it, the server has not noticed yet) would hold our membership
  // and partition locks until its keepalive fails. End it now.
  try {
    tx.exec_params(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
        "application_name = $1 AND pid <> pg_backend_pid() AND datname = "
        "current_database()",
        session_name_);
  } catch (const pqxx::sql_error& e) {
    spdlog::debug("relay: cannot end stale sessions: {}", e.what());
  }
  // Never wait for the lock: a stale session may hold it still. A fresh key
  // is as good; the stale one drops out when its session ends.
  for (int tries = 0; tries < 8; ++tries) {
    if (tx.exec_params("SELECT pg_try_advisory_lock($1, $2)", kMemberLockClass,
                       member_key_)[0][0]
            .as<bool>()) {
      return true;
    }
    member_key_ = NewMemberKey();
  }
  return false;
}

bool Relay::EnsureConnection() {
  if (conn_ != nullptr && conn_->is_open()) return true;
  conn_.reset();
  if (absl::Now() < next_db_attempt_) return false;
  auto conn = Connect(options_.db_url, session_name_, options_.session);
  bool joined = false;
  if (conn.ok()) {
    try {
      {
        pqxx::nontransaction tx(**conn);
        // The server drops a vanished relay's session, and with it its
        // locks, within about 25 s. A mark lost in a server crash only means
        // the row is delivered again (and answered DUPLICATE): marks need
        // not wait for the WAL flush.
        tx.exec(
            "SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; "
            "SET tcp_keepalives_count = 3; SET synchronous_commit = off");
      }
      joined = JoinMembership(**conn);
      if (!joined) last_db_error_ = "no free membership lock";
    } catch (const std::exception& e) {
      last_db_error_ = std::string(StatusFromException(e).message());
    }
  } else {
    last_db_error_ = std::string(conn.status().message());
  }
  if (!joined) {
    spdlog::warn("relay: connecting: {}; retrying", last_db_error_);
    next_db_attempt_ = absl::Now() + Jittered(db_backoff_);
    db_backoff_ = std::min(db_backoff_ * 2, options_.retry_max);
    return false;
  }
  conn_ = std::move(*conn);
  db_backoff_ = options_.retry_initial;
  owned_.clear();
  releasing_.clear();
  next_rebalance_ = absl::InfinitePast();
  return true;
}

bool Relay::Rebalance() {
  const size_t before = owned_.size();
  try {
    pqxx::nontransaction tx(*conn_);
    const int members = std::max<int>(
        1, tx.exec_params(
                  "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                  "AND classid::int = $1 AND objsubid = 2 AND granted AND "
                  "database = (SELECT oid FROM pg_database WHERE datname = "
                  "current_database())",
                  kMemberLockClass)[0][0]
                .as<int>());
    const size_t target = (kPartitionCount + members - 1) / members;
    if (owned_.size() > target) {
      // Give up the highest partitions, each once nothing of it is in flight.
      size_t extra = owned_.size() - target;
      for (auto it = owned_.rbegin(); it != owned_.rend() && extra > 0;
           ++it, --extra) {
        releasing_.insert(*it);
      }
    } else {
      releasing_.clear();
    }
    for (auto it = releasing_.begin(); it != releasing_.end();) {
      bool busy = false;
      for (const auto& [id, batch] : in_flight_) {
        for (int p : batch.partitions) busy |= p == *it;
      }
      if (busy) {
        ++it;
        continue;
      }
      tx.exec_params("SELECT pg_advisory_unlock($1, $2)", kPartitionLockClass,
                     *it);
      owned_.erase(*it);
      it = releasing_.erase(it);
    }
    if (owned_.size() < target) {
      pqxx::result free = tx.exec_params(
          "SELECT p FROM generate_series(0, $2 - 1) AS p WHERE NOT EXISTS ("
          "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND "
          "classid::int = $1 AND objid::int = p AND objsubid = 2 AND granted "
          "AND database = (SELECT oid FROM pg_database WHERE datname = "
          "current_database())) ORDER BY (p + $3) % $2",
          kPartitionLockClass, kPartitionCount, member_key_ % kPartitionCount);
      for (const auto& row : free) {
        if (owned_.size() >= target) break;
        const int p = row[0].as<int>();
        if (owned_.count(p)) continue;
        if (tx.exec_params("SELECT pg_try_advisory_lock($1, $2)",
                            kPartitionLockClass, p)[0][0]
                .as<bool>()) {
          owned_.insert(p);
        }
      }
    }
    if (owned_.size() != before) {
      spdlog::info("relay {}: owns {} of {} partitions ({} replicas)",
                   replica_id_, owned_.size(), kPartitionCount, members);
    }
    return true;
  } catch (const std::exception& e) {
    last_db_error_ = std::string(StatusFromException(e).message());
    spdlog::warn("relay: rebalance: {}", last_db_error_);
    return false;
  }
}

bool Relay::Claim() {
  std::vector<int> partitions;
  for (int p : owned_) {
    if (!releasing_.count(p)) partitions.push_back(p);
  }
  if (partitions.empty()) return true;
  try {
    while (static_cast<int>(in_flight_seqs_.size()) < options_.window &&
           static_cast<int>(in_flight_.size()) < options_.pipeline_depth) {
      const int limit = std::min<int>(
          options_.batch_size, options_.window - in_flight_seqs_.size());
      std::vector<int64_t> excluded(in_flight_seqs_.begin(),
                                    in_flight_seqs_.end());
      for (const Mark& m : marks_) excluded.push_back(m.seq);
      pqxx::result rows;
      const absl::Time t0 = absl::Now();
      {
        ++outbox_statements_;
        pqxx::nontransaction tx(*conn_);
        rows = tx.exec_params(kClaimSql, ArrayLiteral(partitions).str(),
                              ArrayLiteral(excluded).str(), limit);
      }
      if (spdlog::should_log(spdlog::level::debug)) {
        spdlog::debug("relay: claimed {} rows in {}", rows.size(),
                      absl::FormatDuration(absl::Now() - t0));
      }
      if (rows.empty()) break;
      v1::DeliverRequest req;
      InFlight batch;
      batch.batch_id = next_batch_id_++;
      req.set_batch_id(batch.batch_id);
      size_t taken = 0;
      for (const auto& row : rows) {
        // Below the consumer's message limit, whatever --batch_size says;
        // the rest is claimed again next round.
        if (req.ByteSizeLong() > kMaxDeliveryBatchBytes) break;
        ++taken;
        const int64_t seq = row[0].as<int64_t>();
        if (!EventFromRow(row, req.add_events())) {
          req.mutable_events()->RemoveLast();
          marks_.push_back({seq, false, "payload: not a valid outbox.v1.Event"});
          continue;
        }
        if (const size_t size = req.events(req.events_size() - 1).ByteSizeLong();
            size > kMaxEventBytes) {
          req.mutable_events()->RemoveLast();
          marks_.push_back({seq, false,
                            absl::StrCat("payload: the event takes ", size,
                                         " bytes; at most ", kMaxEventBytes,
                                         " can be delivered")});
          continue;
        }
        batch.seqs.push_back(seq);
        batch.partitions.push_back(row[kEventColumnCount].as<int>());
        in_flight_seqs_.insert(seq);
      }
      if (!batch.seqs.empty()) {
        MaybeCrash("relay.after_claim_before_send");
        batch.sent_at = absl::Now();
        in_flight_[batch.batch_id] = std::move(batch);
        stream_->Send(std::move(req));
        batches_->Add();
      }
      if (static_cast<int>(rows.size()) < limit || taken < rows.size()) break;
    }
    return true;
  } catch (const std::exception& e) {
    last_db_error_ = std::string(StatusFromException(e).message());
    spdlog::warn("relay: claim: {}", last_db_error_);
    return false;
  }
}

void Relay::HandleResponses() {
  if (stream_ == nullptr) return;
  for (const v1::DeliverResponse& resp : stream_->TakeResponses()) {
    // The consumer answers: whatever broke the last stream is over.
    stream_backoff_ = options_.retry_initial;
    auto it = in_flight_.find(resp.batch_id());
    if (it == in_flight_.end()) {
      spdlog::warn("relay: answer for unknown batch {}", resp.batch_id());
      continue;
    }
    std::map<int64_t, const v1::EventResult*> by_seq;
    for (const auto& r : resp.results()) by_seq[r.seq()] = &r;
    for (int64_t seq : it->second.seqs) {
      in_flight_seqs_.erase(seq);
      auto r = by_seq.find(seq);
      if (r == by_seq.end()) continue;  // unanswered: stays pending
      switch (r->second->outcome()) {
        case v1::APPLIED:
        case v1::DUPLICATE:
        case v1::HELD:
          marks_.push_back({seq, true, ""});
          break;
        case v1::REJECTED:
          marks_.push_back({seq, false, r->second->reason()});
          break;
        default:
          break;
      }
    }
    in_flight_.erase(it);
  }
}

bool Relay::FlushMarks() {
  if (marks_.empty()) return true;
  // Answered by the consumer, not yet marked: redelivery must follow.
  MaybeCrash("relay.after_send_before_mark");
  std::vector<int64_t> delivered;
  for (const Mark& m : marks_) {
    if (m.delivered) delivered.push_back(m.seq);
  }
  int64_t dead = 0;
  try {
    ++outbox_statements_;
    pqxx::work tx(*conn_);
    if (!delivered.empty()) {
      tx.exec_params(
          "UPDATE outbox SET status = 'delivered', published_at = now() "
          "WHERE seq = ANY($1::bigint[]) AND status = 'pending'",
          ArrayLiteral(delivered).str());
    }
    for (const Mark& m : marks_) {
      if (m.delivered) continue;
      // Exponential backoff with jitter: reject_backoff * 2^attempts, capped.
      pqxx::result r = tx.exec_params(
          "UPDATE outbox SET attempts = attempts + 1, last_error = $2, "
          "status = CASE WHEN attempts + 1 >= $3 THEN 'dead' ELSE 'pending' "
          "END, dead_at = CASE WHEN attempts + 1 >= $3 THEN now() END, "
          "available_at = now() + make_interval(secs => least($5::float8, "
          "$4::float8 * power(2, attempts)) * (0.5 + random() / 2)) "
          "WHERE seq = $1 AND status = 'pending' RETURNING status",
          m.seq, m.reason.substr(0, 2000), options_.max_attempts,
          absl::ToDoubleSeconds(options_.reject_backoff),
          absl::ToDoubleSeconds(options_.reject_backoff_max));
      if (!r.empty() && r[0][0].as<std::string>() == "dead") {
        ++dead;
        spdlog::warn("relay: row {} is a dead letter: {}", m.seq, m.reason);
      }
    }
    MaybeCrash("relay.before_mark_commit");
    tx.commit();
    MaybeCrash("relay.after_mark_commit");
  } catch (const std::exception& e) {
    last_db_error_ = std::string(StatusFromException(e).message());
    spdlog::warn("relay: marking {} rows: {}", marks_.size(), last_db_error_);
    return false;
  }
  delivered_->Add(delivered.size());
  rejected_->Add(marks_.size() - delivered.size());
  dead_->Add(dead);
  marks_.clear();
  return true;
}

bool Relay::PruneDelivered() {
  constexpr int kBatch = 5000;
  try {
    ++outbox_statements_;
    pqxx::nontransaction tx(*conn_);
    // Small batches keep each transaction short, so vacuum is never held
    // back and claims never wait behind a long delete.
    const auto deleted = tx.exec_params(
                               "DELETE FROM outbox WHERE seq IN (SELECT seq "
                               "FROM outbox WHERE status = 'delivered' AND "
                               "published_at < now() - make_interval(secs => "
                               "$1::float8) LIMIT $2)",
                               absl::ToDoubleSeconds(options_.retention),
                               kBatch)
                             .affected_rows();
    pruned_->Add(deleted);
    next_prune_ = absl::Now() + (static_cast<int>(deleted) == kBatch
                                     ? absl::ZeroDuration()
                                     : absl::Minutes(1));
    return true;
  } catch (const std::exception& e) {
    last_db_error_ = std::string(StatusFromException(e).message());
    spdlog::warn("relay: retention: {}", last_db_error_);
    return false;
  }
}

void Relay::DropStream(const std::string& why) {
  HandleResponses();  // what was answered before the break still counts
  if (!in_flight_.empty()) {
    spdlog::warn("relay: delivery stream lost ({}); {} events in flight stay "
                 "pending and will be resent",
                 why, in_flight_seqs_.size());
  } else {
    spdlog::info("relay: delivery stream closed ({})", why);
  }
  reconnects_->Add();
  stream_->Cancel();
  stream_.reset();
  in_flight_.clear();
  in_flight_seqs_.clear();
  next_stream_attempt_ = absl::Now() + Jittered(stream_backoff_);
  stream_backoff_ = std::min(stream_backoff_ * 2, options_.retry_max);
}

void Relay::EnsureStream() {
  if (stream_ != nullptr || absl::Now() < next_stream_attempt_) return;
  // Opening a stream blocks until the channel connects; only open it on a
  // ready channel so this thread never waits on the network.
  grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/true);
  if (state == GRPC_CHANNEL_TRANSIENT_FAILURE) {
    next_stream_attempt_ = absl::Now() + Jittered(stream_backoff_);
    stream_backoff_ = std::min(stream_backoff_ * 2, options_.retry_max);
    return;
  }
  if (state != GRPC_CHANNEL_READY) return;
  stream_ = std::make_unique<DeliveryStream>(stub_.get(), [this] { Wake(); });
  // The backoff resets on the first answer, not here: a consumer that
  // accepts streams but fails every batch (its database is read-only) is
  // retried less and less often, up to --retry_max.
  spdlog::info("relay: delivery stream open to {}", options_.consumer);
}

void Relay::Run() {
  for (;;) {
    bool stopping;
    absl::Time deadline;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;
      deadline = drain_deadline_;
    }
    HandleResponses();
    if (stream_ != nullptr && stream_->broken()) DropStream(stream_->error());
    if (stream_ != nullptr && !in_flight_.empty() &&
        absl::Now() - in_flight_.begin()->second.sent_at >
            options_.ack_timeout) {
      DropStream("no answer within --ack_timeout");
    }
    const int64_t statements_before = outbox_statements_;
    bool db_ok = EnsureConnection() && FlushMarks();
    if (stopping) {
      if ((in_flight_.empty() && marks_.empty()) || absl::Now() >= deadline) {
        break;
      }
    } else if (db_ok) {
      if (absl::Now() >= next_rebalance_) {
        db_ok = Rebalance();
        next_rebalance_ = absl::Now() + options_.rebalance_interval;
      }
      EnsureStream();
      if (db_ok && stream_ != nullptr && !stream_->broken()) db_ok = Claim();
      if (db_ok && options_.retention > absl::ZeroDuration() &&
          owned_.count(0) && absl::Now() >= next_prune_) {
        db_ok = PruneDelivered();
      }
    }
    if (!db_ok && conn_ != nullptr) {
      // Lost or broken: the server releases our locks with the session.
      conn_.reset();
      owned_.clear();
      releasing_.clear();
    }
    if (watchdog_ != nullptr && !stopping) {
      if (!db_ok) {
        watchdog_->Failed(absl::UnavailableError(last_db_error_));
      } else if (outbox_statements_ != statements_before) {
        watchdog_->Done();
      }
    }
    absl::Duration wait = options_.poll_interval;
    if (stopping) wait = absl::Milliseconds(20);
    if (stream_ == nullptr || conn_ == nullptr) {
      wait = std::min(wait, absl::Milliseconds(100));
    }
    std::unique_lock<std::mutex> lock(mu_);
    state_.partitions_owned.assign(owned_.begin(), owned_.end());
    state_.in_flight = static_cast<int64_t>(in_flight_seqs_.size());
    state_.stream_connected = stream_ != nullptr && !stream_->broken();
    cv_.wait_for(lock, absl::ToChronoNanoseconds(wait),
                 [&] { return woken_; });
    woken_ = false;
  }
  // Drained (or out of time): close the stream, write the last marks, and
  // release the partitions by closing the session.
  if (stream_ != nullptr) {
    if (!in_flight_.empty()) {
      spdlog::warn("relay: {} events unanswered at shutdown stay pending",
                   in_flight_seqs_.size());
    } else {
      // Nothing in flight: half-close, so the consumer sees a clean end.
      stream_->CloseSend();
      for (int i = 0; i < 50 && !stream_->broken(); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    stream_->Cancel();
    stream_.reset();
  }
  if (conn_ != nullptr) FlushMarks();
  conn_.reset();
  std::lock_guard<std::mutex> lock(mu_);
  state_.partitions_owned.clear();
  state_.stream_connected = false;
  spdlog::info("relay {}: stopped", replica_id_);
}

}  // namespace outbox::relay
