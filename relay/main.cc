// outbox-relay: streams one subscription's committed outbox events to its
// consumer, at least once and in per-aggregate order; serves RelayAdmin on
// --listen.

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/db.h"
#include "common/db_flags.h"
#include "common/fault.h"
#include "common/ids.h"
#include "common/jetstream_flags.h"
#include "common/schema.h"
#include "common/service.h"
#include "relay/admin_service.h"
#include "relay/jetstream_sink.h"
#include "relay/relay.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50052",
          "gRPC listen address of the admin service.");
ABSL_FLAG(std::string, db, "postgresql://127.0.0.1:5432/outbox_orders",
          "PostgreSQL URL of the database holding the outbox (password from "
          "PGPASSWORD).");
ABSL_FLAG(std::string, consumer, "127.0.0.1:50053",
          "host:port of the consumer's EventSink.");
ABSL_FLAG(std::string, source, "",
          "The name this outbox's events carry (Event.source): a consumer "
          "that takes events from several outbox databases tells their "
          "chains apart by it. Recorded in the outbox by the first relay "
          "(empty: the database's name and a random suffix) and kept; a "
          "relay whose --source names another refuses to deliver.");
ABSL_FLAG(std::string, subscription, "billing",
          "The subscription delivered to --consumer: its own delivery "
          "progress, attempts, dead letters and partitions. Replicas of one "
          "subscription share its work; each subscription needs relays of "
          "its own.");
ABSL_FLAG(bool, log_delivery, true,
          "Move --subscription onto the outbox log if it is not yet "
          "(docs/log-delivery.md): the producer's transactions then write "
          "nothing for it, and delivery writes a position per partition "
          "instead of a row per event. A subscription on the log stays "
          "there; every relay of it delivers from the log. One that an "
          "operator moved off the log (outboxctl subscriptions rows) stays "
          "off. False: a subscription these relays make is delivered by "
          "rows, one outbox_delivery row per event.");
ABSL_FLAG(bool, resubscribe, false,
          "Make --subscription anew (per --start_from) even though an "
          "operator dropped it; without it, a dropped subscription is "
          "refused: the relay delivers nothing and reports NOT_SERVING, its "
          "log saying who dropped it and why.");
ABSL_FLAG(std::string, start_from, "oldest",
          "Where a subscription that does not exist yet starts: oldest (every "
          "retained event) or now (events written from its creation on).");
ABSL_FLAG(int, max_attempts, 5,
          "REJECTED answers after which a row becomes a dead letter.");
ABSL_FLAG(int, batch_size, 512, "Events per delivery batch (1-1000).");
ABSL_FLAG(int, window, 2048,
          "Events in flight at most per stream (credit window).");
ABSL_FLAG(int, streams, 2,
          "Delivery streams to the consumer (1-32). Under a backlog each "
          "carries its share of the partitions and the consumer applies "
          "them in parallel; otherwise the first carries them all.");
ABSL_FLAG(absl::Duration, poll_interval, absl::Milliseconds(500),
          "Fallback poll when no NOTIFY arrives.");
ABSL_FLAG(absl::Duration, ack_timeout, absl::Seconds(15),
          "A stream whose oldest batch is unanswered this long is reset.");
ABSL_FLAG(absl::Duration, reject_backoff, absl::Milliseconds(500),
          "Delay before retrying a REJECTED row; doubles per attempt.");
ABSL_FLAG(absl::Duration, retention, absl::ZeroDuration(),
          "Delete delivered rows older than this (e.g. 168h); 0 keeps all.");
ABSL_FLAG(absl::Duration, retention_interval, absl::Minutes(1),
          "Once --retention has deleted all it may, wait this long before "
          "looking again.");
ABSL_FLAG(std::string, consumer_ca, "",
          "PEM CA bundle the consumer's certificate must chain to: dial it "
          "with TLS (its name is checked against --consumer's host).");
ABSL_FLAG(std::string, client_cert, "",
          "PEM certificate the relay presents to the consumer (mutual TLS).");
ABSL_FLAG(std::string, client_key, "", "PEM private key of --client_cert.");
ABSL_FLAG(absl::Duration, retry_max, absl::Seconds(5),
          "Cap of the backoff after transport or database failures.");
ABSL_FLAG(absl::Duration, consumer_unready_after, absl::Seconds(15),
          "When the consumer has answered neither a batch nor a health "
          "check for this long, readiness turns NOT_SERVING and this relay "
          "gives its partitions to replicas that reach the consumer, until "
          "it answers again; 0 disables. At least 2s.");
ABSL_FLAG(absl::Duration, lease_ttl, absl::Seconds(5),
          "How long a partition lease lasts without renewal (each second): "
          "a relay that dies or freezes keeps its partitions this long at "
          "most (2s-5m).");
ABSL_FLAG(std::string, notify_db, "",
          "PostgreSQL URL to LISTEN for new events on, when --db goes through "
          "a transaction pooler (where LISTEN cannot work); empty: --db. "
          "Without one, behind such a pooler the relay polls every 25 ms.");
ABSL_FLAG(int, fence_standbys, 0,
          "Deliver an event only once this many standbys of the outbox "
          "database have flushed it (pg_stat_replication; the relay's role "
          "needs pg_monitor): a failover to one of them can then never leave "
          "a consumer with an event the new primary lacks. 0: no fence.");
ABSL_FLAG(std::string, fence_standby_names, "",
          "Comma-separated application_names of the standbys that count for "
          "--fence_standbys; empty: any.");

ABSL_FLAG(int, jetstream_replicas, 3,
          "With --jetstream: replicas of the stream the relay creates (1-5; "
          "3 on a 3-node cluster keeps acknowledged events through the loss "
          "of one node).");
ABSL_FLAG(bool, jetstream_create_stream, true,
          "With --jetstream: create the stream, or update it to "
          "--jetstream_replicas; false: it must exist and bind every "
          "subject under --jetstream_subjects (the relay sends nothing "
          "until it does).");
ABSL_FLAG(int64_t, jetstream_keep_per_aggregate, 0,
          "With --jetstream_create_stream: events the stream keeps per "
          "aggregate, the oldest removed first (its retention: the newest, "
          "which the chain check needs, always stays); 0: every event.");
ABSL_FLAG(absl::Duration, jetstream_duplicate_window, absl::Minutes(2),
          "With --jetstream: how long the broker drops a repeated event_id "
          "by itself (the relay's chain check covers any age).");

int main(int argc, char** argv) {
  outbox::InitProcess(argc, argv,
                      "delivers outbox events to the consumer.\n"
                      "Flags also come from OUTBOX_<FLAG>.");
  if (absl::Status s = outbox::CheckCrashPoints(outbox::kRelayCrashPoints);
      !s.ok()) {
    spdlog::critical("outbox-relay: {}", std::string(s.message()));
    return 2;
  }
  outbox::relay::RelayOptions options;
  options.db_url = absl::GetFlag(FLAGS_db);
  options.consumer = absl::GetFlag(FLAGS_consumer);
  options.subscription = absl::GetFlag(FLAGS_subscription);
  if (!outbox::relay::IsSubscriptionName(options.subscription)) {
    spdlog::critical(
        "outbox-relay: --subscription: \"{}\" is not a name "
        "(a-z first, then a-z, 0-9, _ or -; at most 63)",
        options.subscription);
    return 2;
  }
  options.source = absl::GetFlag(FLAGS_source);
  if (!options.source.empty() && !outbox::IsSourceName(options.source)) {
    spdlog::critical(
        "outbox-relay: --source: \"{}\" is not a name (1-64 of A-Z, a-z, "
        "0-9, '.', '_', '-')",
        options.source);
    return 2;
  }
  options.resubscribe = absl::GetFlag(FLAGS_resubscribe);
  options.log_delivery = absl::GetFlag(FLAGS_log_delivery);
  if (absl::GetFlag(FLAGS_start_from) == "oldest") {
    options.start_from = outbox::relay::StartFrom::kOldest;
  } else if (absl::GetFlag(FLAGS_start_from) == "now") {
    options.start_from = outbox::relay::StartFrom::kNow;
  } else {
    spdlog::critical("outbox-relay: --start_from must be oldest or now");
    return 2;
  }
  options.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  options.batch_size = absl::GetFlag(FLAGS_batch_size);
  options.window = absl::GetFlag(FLAGS_window);
  options.lanes = absl::GetFlag(FLAGS_streams);
  options.poll_interval = absl::GetFlag(FLAGS_poll_interval);
  options.ack_timeout = absl::GetFlag(FLAGS_ack_timeout);
  options.reject_backoff = absl::GetFlag(FLAGS_reject_backoff);
  options.retry_max = absl::GetFlag(FLAGS_retry_max);
  options.retention = absl::GetFlag(FLAGS_retention);
  options.retention_interval = absl::GetFlag(FLAGS_retention_interval);
  options.lease_ttl = absl::GetFlag(FLAGS_lease_ttl);
  options.consumer_unready_after = absl::GetFlag(FLAGS_consumer_unready_after);
  if (options.consumer_unready_after != absl::ZeroDuration() &&
      options.consumer_unready_after < absl::Seconds(2)) {
    spdlog::critical(
        "outbox-relay: --consumer_unready_after must be 0 (off) or at least "
        "2s, not {}",
        absl::FormatDuration(options.consumer_unready_after));
    return 2;
  }
  options.notify_url = absl::GetFlag(FLAGS_notify_db);
  options.fence.standbys = absl::GetFlag(FLAGS_fence_standbys);
  options.fence.names =
      outbox::ParseIdentityList(absl::GetFlag(FLAGS_fence_standby_names));
  if (options.lease_ttl < absl::Seconds(2) ||
      options.lease_ttl > absl::Minutes(5)) {
    spdlog::critical("outbox-relay: --lease_ttl must be 2s-5m, not {}",
                     absl::FormatDuration(options.lease_ttl));
    return 2;
  }
  if (options.fence.standbys < 0 || options.fence.standbys > 16 ||
      (!options.fence.names.empty() &&
       options.fence.standbys > static_cast<int>(options.fence.names.size()))) {
    spdlog::critical(
        "outbox-relay: --fence_standbys must be 0-16, and at most as many "
        "as --fence_standby_names lists");
    return 2;
  }
  // Not generic_plans: the claim's list of busy aggregates (up to --window
  // of them during a drain) is tested as a hash only in a custom plan, and
  // linearly per row in a generic one (6 ms per claim behind a backlog
  // instead of 3). PostgreSQL's own choice keeps the generic plan when the
  // claims are small.
  options.session = outbox::DbSessionFromFlags();
  options.consumer_tls = {absl::GetFlag(FLAGS_consumer_ca),
                          absl::GetFlag(FLAGS_client_cert),
                          absl::GetFlag(FLAGS_client_key)};
  if (absl::Status s = outbox::CheckClientTls(
          options.consumer_tls,
          {"--consumer_ca", "--client_cert", "--client_key"});
      !s.ok()) {
    spdlog::critical("outbox-relay: {}", std::string(s.message()));
    return 2;
  }
  auto security = outbox::ServerSecurityFromFlags();
  if (!security.ok()) {
    spdlog::critical("outbox-relay: {}",
                     std::string(security.status().message()));
    return 2;
  }
  outbox::CallerCheck check(security->rules);
  if (options.lanes < 1 || options.lanes > outbox::kPartitionCount ||
      options.max_attempts < 1 || options.batch_size < 1 ||
      options.batch_size > 1000 || options.window < options.batch_size ||
      options.poll_interval <= absl::ZeroDuration() ||
      options.ack_timeout <= absl::ZeroDuration()) {
    spdlog::critical(
        "outbox-relay: need --streams 1-32, --max_attempts >= 1, "
        "--batch_size 1-1000, "
        "--window >= --batch_size, positive --poll_interval and --ack_timeout");
    return 2;
  }
  if (options.retention < absl::ZeroDuration() ||
      options.retention_interval <= absl::ZeroDuration()) {
    spdlog::critical(
        "outbox-relay: need --retention >= 0 (0 keeps every row) and a "
        "positive --retention_interval");
    return 2;
  }
  absl::StatusOr<outbox::JetStreamFlags> js = outbox::JetStreamFromFlags(
      absl::StrCat("outbox-relay ", options.subscription),
      outbox::DefaultStreamFor(options.subscription),
      absl::StrCat("outbox.", options.subscription));
  if (!js.ok()) {
    spdlog::critical("outbox-relay: {}", std::string(js.status().message()));
    return 2;
  }
  if (js->enabled) {
    auto sink = outbox::relay::JetStreamSink::Create(
        {.connect = js->connect,
         .stream = js->stream,
         .subject_prefix = js->subjects,
         .ensure_stream = absl::GetFlag(FLAGS_jetstream_create_stream),
         .replicas = absl::GetFlag(FLAGS_jetstream_replicas),
         .duplicate_window = absl::GetFlag(FLAGS_jetstream_duplicate_window),
         .max_per_aggregate = absl::GetFlag(FLAGS_jetstream_keep_per_aggregate),
         .subscription = options.subscription,
         .unready_after = options.consumer_unready_after});
    if (!sink.ok()) {
      spdlog::critical(
          "outbox-relay: --jetstream_replicas or "
          "--jetstream_keep_per_aggregate: {}",
          std::string(sink.status().message()));
      return 2;
    }
    options.sink = *std::move(sink);
  }
  if (auto exit_code =
          outbox::MigrateAtStartup("outbox-relay", options.db_url,
                                   {outbox::OutboxSchema()}, options.session)) {
    return *exit_code;
  }
  outbox::Database db(options.db_url, absl::GetFlag(FLAGS_db_pool_size),
                      "outbox-relay-admin", options.session);
  outbox::Metrics metrics({{"subscription", options.subscription}});
  outbox::Watchdog watchdog("relay claim/mark loop",
                            absl::GetFlag(FLAGS_stall_timeout));
  outbox::relay::Relay relay(options, &metrics, &watchdog);
  outbox::relay::RelayAdminImpl admin(&db, &relay, &check);
  relay.Start();
  return outbox::ServeUntilSignal(
      {.name = "outbox-relay",
       .listen = absl::GetFlag(FLAGS_listen),
       .security = &*security,
       .services = {{&admin, outbox::v1::RelayAdmin::service_full_name()}},
       .metrics = &metrics,
       .watchdogs = {&watchdog},
       .readiness = {[&relay] { return relay.Unready(); }},
       .before_drain = [&] {
         relay.Stop(absl::GetFlag(FLAGS_shutdown_timeout));
       }});
}
