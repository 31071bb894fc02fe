// outbox-producer: the OrderService. Each order change and its outbox event
// commit in one transaction in the orders database.

#include <cstdio>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/db.h"
#include "common/db_flags.h"
#include "common/fault.h"
#include "common/log.h"
#include "common/schema.h"
#include "common/service.h"
#include "common/worker_pool.h"
#include "producer/order_schema.h"
#include "producer/order_service.h"
#include "producer/order_store.h"
#include "writer/writer.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "gRPC listen address.");
ABSL_FLAG(std::string, db, "postgresql://127.0.0.1:5432/outbox_orders",
          "PostgreSQL URL of the orders database (password from PGPASSWORD).");
ABSL_FLAG(int, commit_writers, 1,
          "Calls in flight are written in groups: CreateOrder calls in one "
          "statement each, PayOrder/CancelOrder calls apart in a read and "
          "a write each; at most "
          "this many groups of each at once (1 to (--db_pool_size - 1) / 2). "
          "Fewer make larger groups.");
ABSL_FLAG(int, commit_queue, 256,
          "CreateOrder calls waiting for their group write, at most, and as "
          "many PayOrder/CancelOrder calls apart: when the database hangs or "
          "falls behind, a call beyond them is refused at once with "
          "RESOURCE_EXHAUSTED (after those whose deadline passed or that were "
          "cancelled are dropped, unwritten). Bounds the memory a hung "
          "database costs.");
ABSL_FLAG(bool, notify, true,
          "NOTIFY relays from each commit that writes events, so delivery "
          "does not wait for their poll.");
ABSL_FLAG(bool, print_statements, false,
          "Print the statements the producer prepares, as one JSON object "
          "of name: SQL, and exit (for baselines that run them without the "
          "service, such as scripts/bench's).");

int main(int argc, char** argv) {
  outbox::InitProcess(
      argc, argv,
      "the order service with a "
      "transactional outbox.\nFlags also come from OUTBOX_<FLAG>.");
  if (absl::GetFlag(FLAGS_print_statements)) {
    std::string json = "{";
    for (const auto& st : outbox::producer::OrderStore::Statements()) {
      absl::StrAppend(&json, json.size() > 1 ? ", " : "", "\"", st.name,
                      "\": \"", outbox::JsonEscape(st.sql), "\"");
    }
    std::printf("%s}\n", json.c_str());
    return 0;
  }
  if (absl::Status s = outbox::CheckCrashPoints(outbox::kProducerCrashPoints);
      !s.ok()) {
    spdlog::critical("outbox-producer: {}", std::string(s.message()));
    return 2;
  }
  const std::string url = absl::GetFlag(FLAGS_db);
  outbox::DbSession session = outbox::DbSessionFromFlags();
  outbox::Metrics metrics;
  // Every session reports the database it reached: a failover or a restore
  // of the orders database is logged and counted.
  const std::unique_ptr<outbox::IdentityWatch> identity =
      outbox::WatchDatabase("producer: the orders database", "outbox",
                            &metrics);
  session.identity_watch = identity.get();
  if (absl::GetFlag(FLAGS_commit_writers) < 1 ||
      2 * absl::GetFlag(FLAGS_commit_writers) >=
          absl::GetFlag(FLAGS_db_pool_size)) {
    spdlog::critical(
        "outbox-producer: --commit_writers must be 1 to "
        "(--db_pool_size - 1) / 2");
    return 2;
  }
  const int commit_queue = absl::GetFlag(FLAGS_commit_queue);
  if (commit_queue < 1) {
    spdlog::critical(
        "outbox-producer: --commit_queue must be at least 1, not {}",
        commit_queue);
    return 2;
  }
  auto security = outbox::ServerSecurityFromFlags();
  if (!security.ok()) {
    spdlog::critical("outbox-producer: {}",
                     std::string(security.status().message()));
    return 2;
  }
  outbox::CallerCheck check(security->rules);
  if (auto exit_code = outbox::MigrateAtStartup(
          "outbox-producer", url, outbox::producer::OrdersSchemas(), session)) {
    return *exit_code;
  }
  outbox::CheckDatabaseIdentity("outbox-producer", url, session);
  outbox::DbSession store_session = session;
  store_session.generic_plans = true;  // each statement a lookup by key
  outbox::Database db(url, absl::GetFlag(FLAGS_db_pool_size), "outbox-producer",
                      store_session);
  // The store's statements NOTIFY the relays themselves, at their commits.
  outbox::Writer writer({.session = session});
  outbox::Watchdog watchdog("producer database writes",
                            absl::GetFlag(FLAGS_stall_timeout));
  outbox::producer::OrderStoreOptions store_options;
  store_options.create_groups.writers = absl::GetFlag(FLAGS_commit_writers);
  store_options.change_groups.writers = absl::GetFlag(FLAGS_commit_writers);
  store_options.create_groups.max_queued = commit_queue;
  store_options.change_groups.max_queued = commit_queue;
  if (absl::GetFlag(FLAGS_notify)) {
    store_options.notify_channel = outbox::kNotifyChannel;
  }
  outbox::producer::OrderStore store(&db, &writer, store_options, &metrics);
  // GetOrder waits on the database here, on the connections the group
  // commits leave.
  outbox::WorkerPool workers(absl::GetFlag(FLAGS_db_pool_size) -
                                 2 * absl::GetFlag(FLAGS_commit_writers),
                             1024);
  outbox::producer::OrderServiceImpl service(&store, &metrics, &workers,
                                             &watchdog, &check);
  return outbox::ServeUntilSignal(
      {.name = "outbox-producer",
       .listen = absl::GetFlag(FLAGS_listen),
       .security = &*security,
       .services = {{&service, outbox::v1::OrderService::service_full_name()}},
       .metrics = &metrics,
       .watchdogs = {&watchdog}});
}
