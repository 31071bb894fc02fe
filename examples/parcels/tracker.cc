// parcel-tracker: an EventSink that an outbox-relay delivers parcel events
// to. The inbox engine drops duplicates, holds early events and applies
// each aggregate's events in chain order; this file is only the domain's
// part: a Handler that keeps the table `tracking` up to date.
//
//   parcel-tracker --db=postgresql://127.0.0.1/tracking
//   --listen=127.0.0.1:50061
//   outbox-relay --db=postgresql://127.0.0.1/parcels --subscription=tracking \
//     --consumer=127.0.0.1:50061

#include <spdlog/spdlog.h>

#include <pqxx/pqxx>

#include "absl/flags/flag.h"
#include "common/config.h"
#include "common/db_flags.h"
#include "common/schema.h"
#include "common/service.h"
#include "inbox/engine.h"
#include "inbox/handler.h"
#include "inbox/sink_service.h"
#include "parcels.pb.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50061", "gRPC listen address.");
ABSL_FLAG(std::string, db, "postgresql://127.0.0.1:5432/tracking",
          "PostgreSQL URL of the tracker's database.");

namespace {

using outbox::v1::Event;

class TrackingHandler : public outbox::inbox::Handler {
 public:
  std::string name() const override { return "tracking"; }

  const std::vector<outbox::Migration>& migrations() const override {
    static const std::vector<outbox::Migration> kTables = {
        {1, "tracking", R"sql(
CREATE TABLE tracking (
  parcel_id   text PRIMARY KEY,
  destination text NOT NULL,
  grams       int NOT NULL,
  status      text NOT NULL,
  signed_by   text
);
)sql"},
    };
    return kTables;
  }

  // Pure checks: a type this handler knows, a payload that parses.
  absl::Status Validate(const Event& e) const override {
    if (e.payload().Is<parcels::v1::ParcelShipped>()) {
      parcels::v1::ParcelShipped m;
      if (!e.payload().UnpackTo(&m)) return Bad(e, "does not parse");
      if (m.grams() <= 0) return Bad(e, "grams must be positive");
    } else if (e.payload().Is<parcels::v1::ParcelDelivered>()) {
      parcels::v1::ParcelDelivered m;
      if (!e.payload().UnpackTo(&m)) return Bad(e, "does not parse");
    } else {
      return Bad(e, "unknown payload type " + e.payload().type_url());
    }
    return absl::OkStatus();
  }

  // Each aggregate's events arrive in chain order, each once, ever.
  std::vector<outbox::inbox::Rejection> Apply(
      pqxx::work& tx, const std::vector<const Event*>& events) override {
    std::vector<outbox::inbox::Rejection> refused;
    for (size_t i = 0; i < events.size(); ++i) {
      parcels::v1::ParcelShipped shipped;
      parcels::v1::ParcelDelivered delivered;
      if (events[i]->payload().UnpackTo(&shipped)) {
        tx.exec_params(
            "INSERT INTO tracking (parcel_id, destination, grams, status) "
            "VALUES ($1, $2, $3, 'on its way')",
            shipped.parcel_id(), shipped.destination(), shipped.grams());
      } else if (events[i]->payload().UnpackTo(&delivered)) {
        const pqxx::result r = tx.exec_params(
            "UPDATE tracking SET status = 'delivered', signed_by = $2 "
            "WHERE parcel_id = $1",
            delivered.parcel_id(), delivered.signed_by());
        if (r.affected_rows() == 0) {
          refused.push_back({i, "delivered before it was shipped"});
        }
      }
    }
    return refused;
  }

 private:
  static absl::Status Bad(const Event& e, const std::string& why) {
    return absl::InvalidArgumentError("payload of " + e.event_type() + ": " +
                                      why);
  }
};

}  // namespace

int main(int argc, char** argv) {
  outbox::InitProcess(argc, argv, "tracks parcels from their events.");
  const std::string url = absl::GetFlag(FLAGS_db);
  const outbox::DbSession session = outbox::DbSessionFromFlags();
  TrackingHandler handler;
  if (auto exit_code = outbox::MigrateAtStartup(
          "parcel-tracker", url,
          {outbox::InboxSchema(), {handler.name(), &handler.migrations()}},
          session)) {
    return *exit_code;
  }
  auto security = outbox::ServerSecurityFromFlags();
  if (!security.ok()) {
    spdlog::critical("parcel-tracker: {}",
                     std::string(security.status().message()));
    return 2;
  }
  outbox::CallerCheck check(security->rules);
  outbox::Database db(url, 4, "parcel-tracker", session);
  outbox::Metrics metrics;
  outbox::inbox::Engine engine(&db, &handler, &metrics);
  outbox::inbox::EventSinkImpl sink(&engine, &check);
  return outbox::ServeUntilSignal(
      {.name = "parcel-tracker",
       .listen = absl::GetFlag(FLAGS_listen),
       .security = &*security,
       .max_receive_message_bytes = outbox::kMaxDeliverMessageBytes,
       .services = {{&sink, outbox::v1::EventSink::service_full_name()}},
       .metrics = &metrics});
}
