#include "consumer/query_service.h"

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/server.h"

namespace outbox::consumer {

BillingQueryImpl::BillingQueryImpl(Database* db, Metrics* metrics,
                                   std::string handler,
                                   const CallerCheck* check,
                                   inbox::Engine* engine)
    : db_(db),
      metrics_(metrics),
      handler_(std::move(handler)),
      check_(check),
      engine_(engine) {}

grpc::Status BillingQueryImpl::GetOrderView(grpc::ServerContext* ctx,
                                            const v1::GetOrderViewRequest* req,
                                            v1::GetOrderViewResponse* resp) {
  if (grpc::Status a =
          Admit(check_, ctx, Access::kCall, "BillingQuery.GetOrderView");
      !a.ok()) {
    return a;
  }
  if (handler_ != "billing") {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        absl::StrCat("this consumer runs the ", handler_,
                                     " handler; order views are billing's"));
  }
  if (req->order_id().empty() || req->order_id().size() > 128) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "order_id: must be 1-128 characters");
  }
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::read_transaction tx(c);
    ApplyLimits(tx);
    pqxx::result r = tx.exec_params(
        "SELECT order_id, customer_id, status, total_cents, currency, last_seq "
        "FROM order_view WHERE order_id = $1",
        req->order_id());
    if (r.empty()) {
      return absl::NotFoundError(absl::StrCat("order ", req->order_id(),
                                              " has no applied events here"));
    }
    v1::OrderView* v = resp->mutable_order();
    const pqxx::row order = r[0];
    v->set_order_id(order["order_id"].as<std::string>());
    v->set_customer_id(order["customer_id"].as<std::string>());
    v1::OrderStatus status = v1::ORDER_STATUS_UNSPECIFIED;
    v1::OrderStatus_Parse("ORDER_STATUS_" + order["status"].as<std::string>(),
                          &status);
    v->set_status(status);
    v->set_total_cents(order["total_cents"].as<int64_t>());
    v->set_currency(order["currency"].as<std::string>());
    v->set_last_seq(order["last_seq"].as<int64_t>());
    for (const auto& row : tx.exec_params(
             "SELECT event_id::text AS event_id, kind, amount_cents FROM "
             "charges "
             "WHERE order_id = $1 ORDER BY created_at",
             req->order_id())) {
      v1::Charge* ch = v->add_charges();
      ch->set_event_id(row["event_id"].as<std::string>());
      ch->set_kind(row["kind"].as<std::string>());
      ch->set_amount_cents(row["amount_cents"].as<int64_t>());
    }
    return absl::OkStatus();
  });
  return ToGrpcStatus(s);
}

grpc::Status BillingQueryImpl::GetStats(grpc::ServerContext* ctx,
                                        const v1::GetConsumerStatsRequest*,
                                        v1::ConsumerStats* resp) {
  if (grpc::Status a =
          Admit(check_, ctx, Access::kCall, "BillingQuery.GetStats");
      !a.ok()) {
    return a;
  }
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::read_transaction tx(c);
    ApplyLimits(tx);
    pqxx::row r = tx.exec1(
        "SELECT (SELECT count(*) FROM inbox) AS applied, (SELECT count(*) "
        "FROM held_events) AS held, coalesce((SELECT extract(epoch FROM "
        "now() - min(received_at)) FROM held_events), 0)::float8 AS "
        "oldest_held, (SELECT count(*) FROM aggregate_cursors) AS "
        "aggregates");
    resp->set_applied(r["applied"].as<int64_t>());
    resp->set_held(r["held"].as<int64_t>());
    resp->set_oldest_held_seconds(r["oldest_held"].as<double>());
    resp->set_aggregates(r["aggregates"].as<int64_t>());
    return absl::OkStatus();
  });
  if (!s.ok()) return ToGrpcStatus(s);
  auto count = [&](const char* outcome) {
    return metrics_
        ->AddCounter(absl::StrCat("outbox_consumer_events_total{outcome=\"",
                                  outcome, "\"}"),
                     "Events answered, by outcome.")
        ->value();
  };
  resp->set_applied_by_process(count("applied"));
  resp->set_duplicates_by_process(count("duplicate"));
  resp->set_held_by_process(count("held"));
  resp->set_rejected_by_process(count("rejected"));
  return grpc::Status::OK;
}

grpc::Status BillingQueryImpl::ListHeldEvents(
    grpc::ServerContext* ctx, const v1::ListHeldEventsRequest* req,
    v1::ListHeldEventsResponse* resp) {
  if (grpc::Status a =
          Admit(check_, ctx, Access::kCall, "BillingQuery.ListHeldEvents");
      !a.ok()) {
    return a;
  }
  if (req->limit() < 0 || req->limit() > 10000) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "limit: must be 0-10000 (0 means 100)");
  }
  const int limit = req->limit() == 0 ? 100 : req->limit();
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    pqxx::read_transaction tx(c);
    ApplyLimits(tx);
    for (const auto& row : tx.exec_params(
             "SELECT h.event_id::text AS event_id, h.aggregate_id, h.seq, "
             "h.prev_seq, coalesce(c.last_seq, 0) AS cursor, "
             "(extract(epoch FROM h.received_at) * 1000000)::bigint AS "
             "received_us, h.attempts, coalesce(h.last_error, '') AS "
             "last_error, coalesce((extract(epoch FROM h.failed_at) * "
             "1000000)::bigint, 0) AS failed_us, h.aggregate_type, h.source "
             "FROM held_events h LEFT JOIN "
             "aggregate_cursors c USING (source, aggregate_type, aggregate_id) "
             "WHERE h.attempts > 0 OR NOT $2 "
             "ORDER BY h.received_at LIMIT $1",
             limit, req->failed_only())) {
      v1::HeldEvent* h = resp->add_events();
      h->set_event_id(row["event_id"].as<std::string>());
      h->set_aggregate_id(row["aggregate_id"].as<std::string>());
      h->set_aggregate_type(row["aggregate_type"].as<std::string>());
      h->set_source(row["source"].as<std::string>());
      h->set_seq(row["seq"].as<int64_t>());
      h->set_prev_seq(row["prev_seq"].as<int64_t>());
      h->set_cursor(row["cursor"].as<int64_t>());
      ToTimestamp(absl::FromUnixMicros(row["received_us"].as<int64_t>()),
                  h->mutable_received_at());
      h->set_attempts(row["attempts"].as<int>());
      h->set_last_error(row["last_error"].as<std::string>());
      if (const int64_t at = row["failed_us"].as<int64_t>(); at != 0) {
        ToTimestamp(absl::FromUnixMicros(at), h->mutable_failed_at());
      }
    }
    return absl::OkStatus();
  });
  return ToGrpcStatus(s);
}

grpc::Status BillingQueryImpl::ReleaseHeldEvent(
    grpc::ServerContext* ctx, const v1::HeldEventActionRequest* req,
    v1::HeldEventActionResponse* resp) {
  return Act(ctx, "BillingQuery.ReleaseHeldEvent", false, req, resp);
}

grpc::Status BillingQueryImpl::SkipHeldEvent(
    grpc::ServerContext* ctx, const v1::HeldEventActionRequest* req,
    v1::HeldEventActionResponse* resp) {
  return Act(ctx, "BillingQuery.SkipHeldEvent", true, req, resp);
}

grpc::Status BillingQueryImpl::Act(grpc::ServerContext* ctx,
                                   const char* method, bool skip,
                                   const v1::HeldEventActionRequest* req,
                                   v1::HeldEventActionResponse* resp) {
  if (grpc::Status a = Admit(check_, ctx, Access::kAdmin, method); !a.ok()) {
    return a;
  }
  if (engine_ == nullptr) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "this server does not apply events");
  }
  if (!IsUuid(req->event_id())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "event_id: must be a UUID");
  }
  if (grpc::Status r =
          CheckReason(req->reason(), "why; it is recorded with your identity");
      !r.ok()) {
    return r;
  }
  const std::string who = CallerName(check_, *ctx);
  auto done = skip ? engine_->SkipHeld(req->event_id(), who, req->reason())
                   : engine_->ReleaseHeld(req->event_id(), who, req->reason());
  if (!done.ok()) return ToGrpcStatus(done.status());
  resp->set_event_id(done->event_id);
  resp->set_aggregate_id(done->aggregate_id);
  resp->set_seq(done->seq);
  resp->set_cursor(done->cursor);
  resp->set_applied(done->applied);
  resp->set_drained(done->drained);
  resp->set_held_left(done->held_left);
  resp->set_last_error(done->last_error);
  return grpc::Status::OK;
}

}  // namespace outbox::consumer
