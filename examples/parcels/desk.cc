// parcel-desk: ships --parcels parcels and delivers each, writing every
// state change and its event in one transaction of its own.
//
//   parcel-desk --db=postgresql://127.0.0.1/parcels --parcels=100

#include <cstdio>
#include <pqxx/pqxx>
#include <string>

#include "absl/flags/flag.h"
#include "common/config.h"
#include "common/db.h"
#include "common/db_flags.h"
#include "common/schema.h"
#include "parcels.pb.h"
#include "writer/writer.h"

ABSL_FLAG(std::string, db, "postgresql://127.0.0.1:5432/parcels",
          "PostgreSQL URL of the desk's database (its tables and outbox).");
ABSL_FLAG(int, parcels, 10, "Parcels to ship, then deliver.");

namespace {

const std::vector<outbox::Migration> kParcelTables = {
    {1, "parcels", R"sql(
CREATE TABLE parcels (
  parcel_id   text PRIMARY KEY,
  destination text NOT NULL,
  grams       int NOT NULL,
  status      text NOT NULL
);
)sql"},
};

}  // namespace

int main(int argc, char** argv) {
  outbox::InitProcess(argc, argv, "ships and delivers parcels.");
  const std::string url = absl::GetFlag(FLAGS_db);
  const outbox::DbSession session = outbox::DbSessionFromFlags();
  // The outbox's tables live next to the desk's own, in the same database.
  for (const outbox::Schema& s :
       {outbox::OutboxSchema(), outbox::Schema{"parcels", &kParcelTables}}) {
    if (absl::Status st = outbox::Migrate(url, s.name, *s.migrations,
                                          absl::Seconds(30), session);
        !st.ok()) {
      std::fprintf(stderr, "parcel-desk: %s\n",
                   std::string(st.message()).c_str());
      return 1;
    }
  }
  outbox::Writer writer({.notify_url = url, .session = session});
  pqxx::connection conn(url);
  for (int i = 0; i < absl::GetFlag(FLAGS_parcels); ++i) {
    const std::string id = "parcel-" + std::to_string(i);
    parcels::v1::ParcelShipped shipped;
    shipped.set_parcel_id(id);
    shipped.set_destination("Quay " + std::to_string(i % 7));
    shipped.set_grams(250 + i);
    {
      pqxx::work tx(conn);
      tx.exec_params("INSERT INTO parcels VALUES ($1, $2, $3, 'shipped')", id,
                     shipped.destination(), shipped.grams());
      auto appended =
          writer.Append(tx, outbox::NewEvent::Of("parcel", id, shipped));
      if (!appended.ok()) {  // a bad event: nothing is written
        std::fprintf(stderr, "parcel-desk: %s\n",
                     std::string(appended.status().message()).c_str());
        return 1;
      }
      tx.commit();
    }
    writer.Committed();  // wakes the relays now instead of at their next poll
    parcels::v1::ParcelDelivered delivered;
    delivered.set_parcel_id(id);
    delivered.set_signed_by("Front desk");
    {
      pqxx::work tx(conn);
      tx.exec_params(
          "UPDATE parcels SET status = 'delivered' WHERE parcel_id = $1", id);
      auto appended =
          writer.Append(tx, outbox::NewEvent::Of("parcel", id, delivered));
      if (!appended.ok()) return 1;
      tx.commit();
    }
    writer.Committed();
  }
  std::printf("parcel-desk: shipped and delivered %d parcels\n",
              absl::GetFlag(FLAGS_parcels));
  return 0;
}
