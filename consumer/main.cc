// outbox-consumer: EventSink (the relay delivers here) and BillingQuery.
// The inbox engine applies each event's effect (the handler's: billing or
// audit) and its inbox record in one transaction, drops duplicates and
// holds events that arrive before their predecessor.

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/db.h"
#include "common/db_flags.h"
#include "common/fault.h"
#include "common/jetstream_flags.h"
#include "common/jetstream_subject.h"
#include "common/schema.h"
#include "common/service.h"
#include "consumer/audit.h"
#include "consumer/billing.h"
#include "consumer/query_service.h"
#include "inbox/engine.h"
#include "inbox/gauges.h"
#include "inbox/jetstream_source.h"
#include "inbox/retention.h"
#include "inbox/sink_service.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50053", "gRPC listen address.");
ABSL_FLAG(std::string, db, "postgresql://127.0.0.1:5432/outbox_billing",
          "PostgreSQL URL of the consumer's database (password from "
          "PGPASSWORD).");
ABSL_FLAG(std::string, handler, "billing",
          "What applying an event does: billing (order views and charges) "
          "or audit (records every event in audit_log).");
ABSL_FLAG(std::string, delivery_clients, "",
          "Comma-separated identities that may call EventSink.Deliver (the "
          "relay's); empty: those of --allowed_clients. Needs "
          "--tls_client_ca.");
ABSL_FLAG(int, query_db_pool_size, 2,
          "Database connections of BillingQuery, apart from delivery's.");
ABSL_FLAG(absl::Duration, inbox_retention, absl::ZeroDuration(),
          "Delete inbox rows applied longer ago than this, in small batches "
          "(0: keep them). Redeliveries of their events are still answered "
          "DUPLICATE: each aggregate's cursor records how far rows were "
          "deleted.");
ABSL_FLAG(std::string, jetstream_durable, "outbox-consumer",
          "With --jetstream: the durable pull consumer's name, shared by "
          "this consumer's replicas.");
ABSL_FLAG(int, jetstream_batch, 256,
          "With --jetstream: messages per fetch, applied in one transaction "
          "(1-1000).");
ABSL_FLAG(int64_t, jetstream_park_after, 5,
          "With --jetstream: deliveries of an event refused on each (a "
          "handler or schema that refuses it) before it is parked as a "
          "failed held event for an operator (outboxctl held --failed) and "
          "acknowledged.");
ABSL_FLAG(absl::Duration, jetstream_ack_wait, absl::Seconds(30),
          "With --jetstream: a message not acknowledged this long is "
          "delivered again.");
ABSL_FLAG(int64_t, max_held_per_aggregate, 1000,
          "Events one aggregate may hold while it waits for a predecessor; "
          "more are REJECTED.");

int main(int argc, char** argv) {
  outbox::InitProcess(argc, argv,
                      "applies delivered events exactly once, "
                      "in order.\nFlags also come from OUTBOX_<FLAG>.");
  if (absl::Status s = outbox::CheckCrashPoints(outbox::kConsumerCrashPoints);
      !s.ok()) {
    spdlog::critical("outbox-consumer: {}", std::string(s.message()));
    return 2;
  }
  const std::string url = absl::GetFlag(FLAGS_db);
  outbox::DbSession session = outbox::DbSessionFromFlags();
  outbox::Metrics metrics;
  // Every session of this process reports the database it reached: a
  // failover or a restore is logged, counted, and reported to the relays
  // with every answer (they deliver again what the database lost).
  const std::unique_ptr<outbox::IdentityWatch> identity =
      outbox::WatchDatabase("consumer: the inbox database", "inbox", &metrics);
  session.identity_watch = identity.get();
  auto security = outbox::ServerSecurityFromFlags();
  if (!security.ok()) {
    spdlog::critical("outbox-consumer: {}",
                     std::string(security.status().message()));
    return 2;
  }
  security->rules.delivery =
      outbox::ParseIdentityList(absl::GetFlag(FLAGS_delivery_clients));
  if (!security->rules.delivery.empty() && !security->files.mutual()) {
    spdlog::critical(
        "outbox-consumer: --delivery_clients: identities come "
        "from client certificates; needs --tls_client_ca");
    return 2;
  }
  outbox::CallerCheck check(security->rules);
  if (absl::GetFlag(FLAGS_max_held_per_aggregate) < 1) {
    spdlog::critical("outbox-consumer: --max_held_per_aggregate must be >= 1");
    return 2;
  }
  std::unique_ptr<outbox::inbox::Handler> handler;
  if (absl::GetFlag(FLAGS_handler) == "billing") {
    handler = std::make_unique<outbox::consumer::BillingHandler>();
  } else if (absl::GetFlag(FLAGS_handler) == "audit") {
    handler = std::make_unique<outbox::consumer::AuditHandler>();
  } else {
    spdlog::critical(
        "outbox-consumer: --handler must be billing or audit, "
        "got \"{}\"",
        absl::GetFlag(FLAGS_handler));
    return 2;
  }
  absl::StatusOr<outbox::JetStreamFlags> js = outbox::JetStreamFromFlags(
      "outbox-consumer", outbox::DefaultStreamFor(handler->name()),
      absl::StrCat("outbox.", handler->name()));
  if (!js.ok()) {
    spdlog::critical("outbox-consumer: {}", std::string(js.status().message()));
    return 2;
  }
  const std::string durable = absl::GetFlag(FLAGS_jetstream_durable);
  if (js->enabled &&
      (!outbox::jetstream::IsValidName(durable) ||
       absl::GetFlag(FLAGS_jetstream_batch) < 1 ||
       absl::GetFlag(FLAGS_jetstream_batch) > 1000 ||
       absl::GetFlag(FLAGS_jetstream_ack_wait) < absl::Seconds(1) ||
       absl::GetFlag(FLAGS_jetstream_park_after) < 1)) {
    spdlog::critical(
        "outbox-consumer: need a --jetstream_durable without . * > or "
        "whitespace, --jetstream_batch 1-1000, --jetstream_ack_wait >= 1s "
        "and --jetstream_park_after >= 1");
    return 2;
  }
  if (auto exit_code = outbox::MigrateAtStartup(
          "outbox-consumer", url,
          {outbox::InboxSchema(), {handler->name(), &handler->migrations()}},
          session)) {
    return *exit_code;
  }
  outbox::CheckDatabaseIdentity("outbox-consumer", url, session);
  // Delivery's statements (the inbox's and the handler's) are lookups by key.
  outbox::DbSession delivery_session = session;
  delivery_session.generic_plans = true;
  outbox::Database db(url, absl::GetFlag(FLAGS_db_pool_size), "outbox-consumer",
                      delivery_session);
  outbox::Watchdog watchdog("consumer apply path",
                            absl::GetFlag(FLAGS_stall_timeout));
  outbox::inbox::EngineOptions options;
  options.plan.max_held_per_aggregate =
      absl::GetFlag(FLAGS_max_held_per_aggregate);
  outbox::inbox::Engine engine(&db, handler.get(), &metrics, options,
                               &watchdog);
  outbox::inbox::InboxRepair repair(&db, handler.get());
  outbox::inbox::EventSinkImpl sink(&engine, &check, &repair);
  // From JetStream too, when asked: the same engine, handlers and inbox.
  std::unique_ptr<outbox::inbox::JetStreamSource> source;
  outbox::inbox::JetStreamSource::RegisterMetrics(&metrics);
  if (js->enabled) {
    source = std::make_unique<outbox::inbox::JetStreamSource>(
        outbox::inbox::JetStreamSourceOptions{
            .connect = js->connect,
            .stream = js->stream,
            .durable = absl::GetFlag(FLAGS_jetstream_durable),
            .filter_subject = outbox::jetstream::AllEventsUnder(js->subjects),
            .batch = absl::GetFlag(FLAGS_jetstream_batch),
            .ack_wait = absl::GetFlag(FLAGS_jetstream_ack_wait),
            .park_after = absl::GetFlag(FLAGS_jetstream_park_after)},
        &engine, &metrics);
    source->Start();
  }
  // Its own connection, so that pruning never takes one delivery needs.
  std::unique_ptr<outbox::Database> retention_db;
  std::unique_ptr<outbox::inbox::InboxRetention> retention;
  if (absl::GetFlag(FLAGS_inbox_retention) > absl::ZeroDuration()) {
    retention_db = std::make_unique<outbox::Database>(
        url, 1, "outbox-consumer-retention", session);
    retention = std::make_unique<outbox::inbox::InboxRetention>(
        retention_db.get(), absl::GetFlag(FLAGS_inbox_retention), &metrics);
  }
  // Queries have connections of their own: a flood of them never takes the
  // connections delivery needs.
  outbox::Database query_db(url, absl::GetFlag(FLAGS_query_db_pool_size),
                            "outbox-consumer-query", session);
  outbox::inbox::InboxGauges gauges(&query_db, &metrics);
  outbox::consumer::BillingQueryImpl query(&query_db, &metrics, handler->name(),
                                           &check, &engine);
  return outbox::ServeUntilSignal(
      {.name = "outbox-consumer",
       .listen = absl::GetFlag(FLAGS_listen),
       .security = &*security,
       // Delivery batches: the relay's batch cap plus one event.
       .max_receive_message_bytes = outbox::kMaxDeliverMessageBytes,
       .services = {{&sink, outbox::v1::EventSink::service_full_name()},
                    {&query, outbox::v1::BillingQuery::service_full_name()}},
       .metrics = &metrics,
       .watchdogs = {&watchdog}});
}
