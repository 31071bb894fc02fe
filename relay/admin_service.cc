#include "relay/admin_service.h"

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/limits.h"
#include "common/schema.h"
#include "common/server.h"
#include "relay/delivery_store.h"
#include "relay/outbox_log.h"

namespace outbox::relay {
namespace {

// Microseconds since the epoch for a request timestamp; 0 when unset.
int64_t Micros(const google::protobuf::Timestamp& ts) {
  if (ts.seconds() == 0 && ts.nanos() == 0) return 0;
  return absl::ToUnixMicros(FromTimestamp(ts));
}

// The subscription `requested` names, the relay's own when empty;
// InvalidArgument when it cannot be a name.
absl::StatusOr<std::string> SubscriptionOf(const std::string& requested,
                                           const Relay* relay) {
  if (requested.empty()) return relay->subscription();
  if (!IsSubscriptionName(requested)) {
    return absl::InvalidArgumentError(
        "subscription: a-z first, then a-z, 0-9, _ or -; at most 63");
  }
  return requested;
}

// The `limit` of a listing: 0 (100) to 10000.
grpc::Status CheckLimit(int limit) {
  if (limit < 0 || limit > 10000) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "limit: must be 0-10000 (0 means 100)");
  }
  return grpc::Status::OK;
}

// NotFound unless `name` is a subscription.
absl::Status CheckExists(pqxx::transaction_base& tx, const std::string& name) {
  if (!SubscriptionExists(tx, name)) {
    return absl::NotFoundError(
        absl::StrCat("subscription ", name, " does not exist"));
  }
  return absl::OkStatus();
}

// Runs `body` in a transaction of type Tx (its limits applied) once
// subscription `sub` is known to exist; NotFound when it does not.
template <typename Tx, typename Body>
absl::Status OnSubscription(Database* db, const std::string& sub, Body body) {
  return db->Run([&](pqxx::connection& c) -> absl::Status {
    Tx tx(c);
    ApplyLimits(tx);
    if (absl::Status e = CheckExists(tx, sub); !e.ok()) return e;
    return body(tx);
  });
}

}  // namespace

RelayAdminImpl::RelayAdminImpl(Database* db, const Relay* relay,
                               const CallerCheck* check)
    : db_(db), relay_(relay), check_(check) {}

grpc::Status RelayAdminImpl::GetStats(grpc::ServerContext* ctx,
                                      const v1::GetRelayStatsRequest* req,
                                      v1::RelayStats* resp) {
  if (grpc::Status a = Admit(check_, ctx, Access::kCall, "RelayAdmin.GetStats");
      !a.ok()) {
    return a;
  }
  auto sub = SubscriptionOf(req->subscription(), relay_);
  if (!sub.ok()) return ToGrpcStatus(sub.status());
  absl::Status s = OnSubscription<pqxx::read_transaction>(
      db_, *sub, [&](pqxx::read_transaction& tx) -> absl::Status {
        const DeliveryRowCounts rows = CountDeliveryRows(tx, *sub);
        // On the log: what it owes besides its exceptions, counted up to
        // kLogOwedCountCap.
        absl::StatusOr<std::map<int, LogOwed>> owed =
            LogOwedBy(tx, *sub, {}, kLogOwedCountCap);
        if (!owed.ok()) return owed.status();
        const LogOwed log_owed = LogOwedTotal(*owed);
        resp->set_diverged(OpenDivergences(tx, *sub));
        resp->set_heal_due(DueHealText(tx, *sub));
        resp->set_pending(rows.pending + log_owed.events);
        resp->set_oldest_pending_seconds(
            std::max(rows.oldest_pending_seconds, log_owed.oldest_seconds));
        resp->set_dead_letters(rows.dead);
        // Every event since its start without a row, less what the log
        // still owes.
        resp->set_delivered_total(
            std::max<int64_t>(0, rows.without_row - log_owed.events));
        return absl::OkStatus();
      });
  if (!s.ok()) return ToGrpcStatus(s);
  resp->set_subscription(*sub);
  resp->set_partitions_total(kPartitionCount);
  if (*sub != relay_->subscription()) return grpc::Status::OK;
  RelayState state = relay_->State();
  for (int p : state.partitions_owned) resp->add_partitions_owned(p);
  resp->set_in_flight(state.in_flight);
  resp->set_stream_connected(state.stream_connected);
  resp->set_replica_id(state.replica_id);
  resp->set_delivered_by_process(state.delivered);
  resp->set_rejected_by_process(state.rejected);
  resp->set_paused_reason(state.consumer_unreachable.empty()
                              ? state.paused_reason
                              : state.consumer_unreachable);
  resp->set_consumer_database(state.consumer_database);
  return grpc::Status::OK;
}

grpc::Status RelayAdminImpl::ListDeadLetters(
    grpc::ServerContext* ctx, const v1::ListDeadLettersRequest* req,
    v1::ListDeadLettersResponse* resp) {
  if (grpc::Status a =
          Admit(check_, ctx, Access::kCall, "RelayAdmin.ListDeadLetters");
      !a.ok()) {
    return a;
  }
  if (grpc::Status bad = CheckLimit(req->limit()); !bad.ok()) return bad;
  auto sub = SubscriptionOf(req->subscription(), relay_);
  if (!sub.ok()) return ToGrpcStatus(sub.status());
  absl::Status s = OnSubscription<pqxx::read_transaction>(
      db_, *sub, [&](pqxx::read_transaction& tx) -> absl::Status {
        DeadLetterPage page = ReadDeadLetters(
            tx, *sub, req->aggregate_id(), req->after_seq(),
            req->limit() == 0 ? 100 : req->limit(), kMaxListingPayloadBytes);
        for (v1::OutboxRow& row : page.rows) {
          *resp->add_rows() = std::move(row);
        }
        resp->set_more(page.more);
        return absl::OkStatus();
      });
  return ToGrpcStatus(s);
}

grpc::Status RelayAdminImpl::Requeue(grpc::ServerContext* ctx,
                                     const v1::RequeueRequest* req,
                                     v1::RequeueResponse* resp) {
  if (grpc::Status a = Admit(check_, ctx, Access::kAdmin, "RelayAdmin.Requeue");
      !a.ok()) {
    return a;
  }
  const int modes =
      !req->event_id().empty() + !req->aggregate_id().empty() + req->all_dead();
  if (modes != 1) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "event_id, aggregate_id or all_dead: give exactly one");
  }
  if (!req->event_id().empty() && !IsUuid(req->event_id())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "event_id: must be a UUID");
  }
  const bool filtered = req->has_died_after() || req->has_died_before() ||
                        !req->error_contains().empty();
  if (!req->event_id().empty() && filtered) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "died_after, died_before, error_contains: filters "
                        "narrow aggregate_id or all_dead, not event_id");
  }
  if (req->error_contains().size() > 1000) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "error_contains: at most 1000 bytes");
  }
  auto sub = SubscriptionOf(req->subscription(), relay_);
  if (!sub.ok()) return ToGrpcStatus(sub.status());
  const int64_t after = Micros(req->died_after());
  const int64_t before = Micros(req->died_before());
  if (after != 0 && before != 0 && after >= before) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "died_after: must be earlier than died_before");
  }
  absl::Status s = OnSubscription<pqxx::work>(
      db_, *sub, [&](pqxx::work& tx) -> absl::Status {
        const int64_t requeued =
            RequeueDeadLetters(tx, *sub,
                               {.event_id = req->event_id(),
                                .aggregate_id = req->aggregate_id(),
                                .died_after_us = after,
                                .died_before_us = before,
                                .error_contains = req->error_contains()});
        tx.commit();
        resp->set_requeued(requeued);
        if (resp->requeued() == 0 && !req->all_dead()) {
          return absl::NotFoundError(
              req->event_id().empty()
                  ? absl::StrCat("aggregate ", req->aggregate_id(),
                                 " has no dead letters",
                                 filtered ? " matching the filters" : "")
                  : absl::StrCat("event ", req->event_id(),
                                 " is not a dead letter"));
        }
        spdlog::info("relay: requeued {} dead letters of {} ({})",
                     resp->requeued(), *sub,
                     req->all_dead() ? "all matching"
                                     : req->event_id() + req->aggregate_id());
        return absl::OkStatus();
      });
  return ToGrpcStatus(s);
}

grpc::Status RelayAdminImpl::GetEvent(grpc::ServerContext* ctx,
                                      const v1::GetEventRequest* req,
                                      v1::OutboxRow* resp) {
  if (grpc::Status a = Admit(check_, ctx, Access::kCall, "RelayAdmin.GetEvent");
      !a.ok()) {
    return a;
  }
  if (!IsUuid(req->event_id())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "event_id: must be a UUID");
  }
  auto sub = SubscriptionOf(req->subscription(), relay_);
  if (!sub.ok()) return ToGrpcStatus(sub.status());
  absl::Status s = OnSubscription<pqxx::read_transaction>(
      db_, *sub, [&](pqxx::read_transaction& tx) -> absl::Status {
        std::optional<v1::OutboxRow> row = FindEvent(tx, *sub, req->event_id());
        if (!row.has_value()) {
          return absl::NotFoundError(
              absl::StrCat("event ", req->event_id(), " is not in the outbox"));
        }
        *resp = *std::move(row);
        return absl::OkStatus();
      });
  return ToGrpcStatus(s);
}

grpc::Status RelayAdminImpl::Replay(grpc::ServerContext* ctx,
                                    const v1::ReplayRequest* req,
                                    v1::ReplayResponse* resp) {
  if (grpc::Status a = Admit(check_, ctx, Access::kAdmin, "RelayAdmin.Replay");
      !a.ok()) {
    return a;
  }
  ReplaySelector sel;
  sel.event_id = req->event_id();
  sel.aggregate_id = req->aggregate_id();
  sel.aggregate_type = req->aggregate_type();
  sel.by_seq = req->from_seq() != 0 || req->to_seq() != 0;
  sel.by_time = req->has_since() || req->has_until();
  const int selectors = !sel.event_id.empty() + !sel.aggregate_id.empty() +
                        sel.by_seq + sel.by_time;
  if (selectors != 1) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        "event_id, aggregate_id, from_seq/to_seq or since/until: give "
        "exactly one");
  }
  if (!sel.event_id.empty() && !IsUuid(sel.event_id)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "event_id: must be a UUID");
  }
  if (sel.aggregate_id.size() > 128) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "aggregate_id: at most 128 bytes");
  }
  if (req->from_seq() < 0 || req->to_seq() < 0 ||
      (req->to_seq() != 0 && req->to_seq() < req->from_seq())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "from_seq, to_seq: must be >= 0, and to_seq >= "
                        "from_seq when given");
  }
  if (req->has_since()) sel.since = FromTimestamp(req->since());
  if (req->has_until()) sel.until = FromTimestamp(req->until());
  if (sel.since >= sel.until) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "since: must be earlier than until");
  }
  sel.from_seq = req->from_seq();
  sel.to_seq = req->to_seq();
  auto sub = SubscriptionOf(req->subscription(), relay_);
  if (!sub.ok()) return ToGrpcStatus(sub.status());
  Replayed done;
  absl::Status s = OnSubscription<pqxx::work>(
      db_, *sub, [&](pqxx::work& tx) -> absl::Status {
        done = outbox::relay::Replay(tx, *sub, sel);
        tx.commit();
        return absl::OkStatus();
      });
  if (!s.ok()) return ToGrpcStatus(s);
  resp->set_matched(done.matched);
  resp->set_owed(done.owed);
  spdlog::info(
      "relay: replay of {} by {}: {} retained events matched, {} owed again",
      *sub, CallerName(check_, *ctx), done.matched, done.owed);
  return grpc::Status::OK;
}

grpc::Status RelayAdminImpl::ListDivergences(
    grpc::ServerContext* ctx, const v1::ListDivergencesRequest* req,
    v1::ListDivergencesResponse* resp) {
  if (grpc::Status a =
          Admit(check_, ctx, Access::kCall, "RelayAdmin.ListDivergences");
      !a.ok()) {
    return a;
  }
  if (grpc::Status bad = CheckLimit(req->limit()); !bad.ok()) return bad;
  auto sub = SubscriptionOf(req->subscription(), relay_);
  if (!sub.ok()) return ToGrpcStatus(sub.status());
  absl::Status s = OnSubscription<pqxx::read_transaction>(
      db_, *sub, [&](pqxx::read_transaction& tx) -> absl::Status {
        for (v1::Divergence& d : outbox::relay::ListDivergences(
                 tx, *sub, req->include_resolved(),
                 req->limit() == 0 ? 100 : req->limit())) {
          *resp->add_divergences() = std::move(d);
        }
        return absl::OkStatus();
      });
  return ToGrpcStatus(s);
}

grpc::Status RelayAdminImpl::ResolveDivergence(
    grpc::ServerContext* ctx, const v1::ResolveDivergenceRequest* req,
    v1::Divergence* resp) {
  if (grpc::Status a =
          Admit(check_, ctx, Access::kAdmin, "RelayAdmin.ResolveDivergence");
      !a.ok()) {
    return a;
  }
  if (req->aggregate_id().empty() || req->aggregate_id().size() > 128) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "aggregate_id: must be 1-128 bytes");
  }
  if (grpc::Status r =
          CheckReason(req->reason(), "why the producer's history is adopted");
      !r.ok()) {
    return r;
  }
  auto sub = SubscriptionOf(req->subscription(), relay_);
  if (!sub.ok()) return ToGrpcStatus(sub.status());
  if (*sub != relay_->subscription()) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("subscription: this relay delivers ",
                     relay_->subscription(), "; ask a relay of ", *sub));
  }
  v1::EventSink::Stub* consumer = relay_->consumer_stub();
  if (consumer == nullptr) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        "this relay publishes to a broker, which keeps the history it was "
        "given: purge the aggregate's subject from the stream, then requeue "
        "its events");
  }
  const std::string who = CallerName(check_, *ctx);
  // 1. The producer's history of the chain, as the outbox holds it, and
  // how far retention deleted it.
  std::vector<std::pair<int64_t, std::string>> chain;
  int64_t deleted_through = 0;
  std::string type = req->aggregate_type();
  absl::Status s = OnSubscription<pqxx::read_transaction>(
      db_, *sub, [&](pqxx::read_transaction& tx) -> absl::Status {
        const std::vector<std::string> open = OpenDivergenceTypes(
            tx, *sub, req->aggregate_id(), req->aggregate_type());
        if (open.empty()) {
          return absl::NotFoundError(
              absl::StrCat("aggregate ", req->aggregate_id(),
                           " has no open divergence in ", *sub));
        }
        if (open.size() > 1) {
          return absl::FailedPreconditionError(
              absl::StrCat("aggregate_type: ", open.size(),
                           " chains of aggregate ", req->aggregate_id(),
                           " diverged; name the type of the one "
                           "to resolve"));
        }
        type = open[0];
        chain = ChainOf(tx, type, req->aggregate_id());
        deleted_through = DeletedThrough(tx, type, req->aggregate_id(), chain);
        return absl::OkStatus();
      });
  if (!s.ok()) return ToGrpcStatus(s);
  const std::string name = ChainLabel(OutboxChain(type, req->aggregate_id()));
  // 2. The consumer keeps what both share and records what it supersedes.
  v1::RewindRequest rewind;
  rewind.set_aggregate_id(req->aggregate_id());
  rewind.set_aggregate_type(type);
  rewind.set_source(relay_->source());
  for (const auto& [seq, id] : chain) rewind.add_keep_event_ids(id);
  rewind.set_shared_through_seq(deleted_through);
  rewind.set_reason(req->reason());
  rewind.set_operator_(who);
  v1::RewindResponse rewound;
  {
    grpc::ClientContext cctx;
    cctx.set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(30));
    grpc::Status r = consumer->Rewind(&cctx, rewind, &rewound);
    if (!r.ok()) {
      return grpc::Status(
          r.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                  r.error_code() == grpc::StatusCode::FAILED_PRECONDITION
              ? r.error_code()
              : grpc::StatusCode::UNAVAILABLE,
          absl::StrCat("the consumer could not rewind aggregate ", name, ": ",
                       r.error_message()));
    }
  }
  // 3. The producer's events after the shared history are owed again, the
  // parked ones pending again, the divergence closed with what happened.
  std::string resolution = absl::StrCat(
      "adopted the producer's history (", chain.size(),
      " retained events) from seq ", rewound.applied_seq(), "; ",
      rewound.superseded_size(),
      " events the consumer had applied are superseded (effects kept, "
      "recorded in its inbox_superseded)");
  for (const v1::SupersededEvent& e : rewound.superseded()) {
    absl::StrAppend(&resolution, resolution.size() < 90000 ? "; " : "",
                    resolution.size() < 90000
                        ? absl::StrCat(e.event_type(), " ", e.event_id(),
                                       " (seq ", e.seq(), ")")
                        : "");
  }
  if (rewound.held_dropped() > 0) {
    absl::StrAppend(&resolution, "; ", rewound.held_dropped(),
                    " held events dropped (delivered again)");
  }
  absl::StrAppend(&resolution, "; reason: ", req->reason());
  std::optional<v1::Divergence> closed;
  int64_t owed = 0;
  s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::work tx(c);
    ApplyLimits(tx);
    closed = outbox::relay::ResolveDivergence(
        tx, *sub, type, req->aggregate_id(), who, resolution);
    if (!closed.has_value()) {
      return absl::NotFoundError(absl::StrCat(
          "aggregate ", name, "'s divergence was resolved meanwhile"));
    }
    if (!chain.empty() && chain.back().first > rewound.applied_seq()) {
      owed = ReOwe(tx, *sub,
                   {{OutboxChain(type, req->aggregate_id()),
                     rewound.applied_seq(), chain.back().first}})
                 .owed;
    }
    WakeRelays(tx);
    tx.commit();
    return absl::OkStatus();
  });
  if (!s.ok()) return ToGrpcStatus(s);
  spdlog::warn(
      "relay: divergence of aggregate {} in {} resolved by {}: {}; "
      "{} events owed again",
      name, *sub, who, resolution, owed);
  *resp = std::move(*closed);
  return grpc::Status::OK;
}

namespace {

void ToProto(const SubscriptionInfo& s, v1::Subscription* p) {
  p->set_name(s.name);
  ToTimestamp(s.created_at, p->mutable_created_at());
  p->set_start_seq(s.start_seq);
  p->set_pending(s.pending);
  p->set_dead_letters(s.dead_letters);
  p->set_diverged(s.diverged);
  p->set_oldest_pending_seconds(s.oldest_pending_seconds);
  p->set_relays_alive(s.relays_alive);
  p->set_lowest_undelivered_seq(s.lowest_seq);
  p->set_lowest_undelivered_status(s.lowest_status);
  p->set_paused(s.paused);
  p->set_paused_by(s.paused_by);
  p->set_paused_reason(s.paused_reason);
  if (s.paused) ToTimestamp(s.paused_at, p->mutable_paused_at());
  p->set_retention_pinned_seconds(s.retention_pinned_seconds);
  p->set_pinned_by(s.pinned_by);
  p->set_pins(s.PinDescription());
  p->set_delivery(s.on_log ? "log" : "rows");
  p->set_heal_due(s.heal_due);
}

}  // namespace

grpc::Status RelayAdminImpl::ListSubscriptions(
    grpc::ServerContext* ctx, const v1::ListSubscriptionsRequest*,
    v1::ListSubscriptionsResponse* resp) {
  if (grpc::Status a =
          Admit(check_, ctx, Access::kCall, "RelayAdmin.ListSubscriptions");
      !a.ok()) {
    return a;
  }
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::read_transaction tx(c);
    ApplyLimits(tx);
    for (const SubscriptionInfo& info : ReadSubscriptions(
             tx, relay_->retention(), SubscriptionDetail::kCounts)) {
      ToProto(info, resp->add_subscriptions());
    }
    return absl::OkStatus();
  });
  resp->set_retention(absl::FormatDuration(relay_->retention()));
  return ToGrpcStatus(s);
}

grpc::Status RelayAdminImpl::PauseSubscription(
    grpc::ServerContext* ctx, const v1::SubscriptionActionRequest* req,
    v1::Subscription* resp) {
  return Act(ctx, "RelayAdmin.PauseSubscription", SubscriptionAction::kPause,
             req, resp, nullptr);
}

grpc::Status RelayAdminImpl::ResumeSubscription(
    grpc::ServerContext* ctx, const v1::SubscriptionActionRequest* req,
    v1::Subscription* resp) {
  return Act(ctx, "RelayAdmin.ResumeSubscription", SubscriptionAction::kResume,
             req, resp, nullptr);
}

grpc::Status RelayAdminImpl::DropSubscription(
    grpc::ServerContext* ctx, const v1::SubscriptionActionRequest* req,
    v1::DropSubscriptionResponse* resp) {
  return Act(ctx, "RelayAdmin.DropSubscription", SubscriptionAction::kDrop, req,
             nullptr, resp->mutable_detail());
}

grpc::Status RelayAdminImpl::MoveSubscriptionToLog(
    grpc::ServerContext* ctx, const v1::SubscriptionActionRequest* req,
    v1::Subscription* resp) {
  std::string detail;
  return Act(ctx, "RelayAdmin.MoveSubscriptionToLog",
             SubscriptionAction::kToLog, req, resp, &detail);
}

grpc::Status RelayAdminImpl::MoveSubscriptionToRows(
    grpc::ServerContext* ctx, const v1::SubscriptionActionRequest* req,
    v1::Subscription* resp) {
  std::string detail;
  return Act(ctx, "RelayAdmin.MoveSubscriptionToRows",
             SubscriptionAction::kToRows, req, resp, &detail);
}

grpc::Status RelayAdminImpl::Act(grpc::ServerContext* ctx, const char* method,
                                 SubscriptionAction action,
                                 const v1::SubscriptionActionRequest* req,
                                 v1::Subscription* info, std::string* detail) {
  if (grpc::Status a = Admit(check_, ctx, Access::kAdmin, method); !a.ok()) {
    return a;
  }
  if (!IsSubscriptionName(req->subscription())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "subscription: required (no default for an action); "
                        "a-z first, then a-z, 0-9, _ or -; at most 63");
  }
  if (grpc::Status r =
          CheckReason(req->reason(), "why; it is recorded with your identity");
      !r.ok()) {
    return r;
  }
  if (req->force() && action != SubscriptionAction::kDrop) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "force: only a drop can be forced");
  }
  const std::string who = CallerName(check_, *ctx);
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::work tx(c);
    ApplyLimits(tx);
    if (absl::Status a = ActOnSubscription(tx, req->subscription(), action, who,
                                           req->reason(), req->force());
        !a.ok()) {
      return a;
    }
    if (detail != nullptr) {
      *detail = LastSubscriptionAction(tx, req->subscription());
    }
    if (info != nullptr) {
      for (const SubscriptionInfo& i : ReadSubscriptions(
               tx, relay_->retention(), SubscriptionDetail::kSummary)) {
        if (i.name == req->subscription()) ToProto(i, info);
      }
      if (detail != nullptr) info->set_action_detail(*detail);
    }
    tx.commit();
    return absl::OkStatus();
  });
  if (!s.ok()) return ToGrpcStatus(s);
  spdlog::warn("relay: {} by {}: subscription {} ({}){}", method, who,
               req->subscription(), req->reason(),
               detail != nullptr ? absl::StrCat("; ", *detail) : "");
  return grpc::Status::OK;
}

}  // namespace outbox::relay
