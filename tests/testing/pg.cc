#include "tests/testing/pg.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace outbox::testing {

std::string TestServerUrl() {
  const char* url = std::getenv("OUTBOX_TEST_PG_URL");
  if (url == nullptr || *url == '\0') {
    ADD_FAILURE() << "OUTBOX_TEST_PG_URL is not set: run tests through "
                     "./scripts/test, which starts a throwaway PostgreSQL";
    std::abort();
  }
  return url;
}

TestDatabase::TestDatabase(const std::string& prefix,
                           const std::vector<Schema>& schemas) {
  std::string suffix = NewUuid().substr(0, 8);
  name_ = absl::AsciiStrToLower(absl::StrCat("t_", prefix, "_", suffix));
  const std::string server = TestServerUrl();
  {
    pqxx::connection admin(server + "/postgres");
    pqxx::nontransaction tx(admin);
    tx.exec("CREATE DATABASE " + tx.quote_name(name_));
  }
  url_ = server + "/" + name_;
  for (const Schema& schema : schemas) {
    absl::Status s = Migrate(url_, schema.name, *schema.migrations);
    if (!s.ok()) {
      ADD_FAILURE() << "migrating " << name_ << " (" << schema.name
                    << "): " << s;
    }
  }
  conn_ = std::make_unique<pqxx::connection>(url_);
}

TestDatabase::~TestDatabase() {
  conn_.reset();
  try {
    pqxx::connection admin(TestServerUrl() + "/postgres");
    pqxx::nontransaction tx(admin);
    tx.exec("DROP DATABASE IF EXISTS " + tx.quote_name(name_) +
            " WITH (FORCE)");
  } catch (const std::exception& e) {
    ADD_FAILURE() << "dropping " << name_ << ": " << e.what();
  }
}

int64_t TestDatabase::Scalar(const std::string& sql) {
  pqxx::nontransaction tx(*conn_);
  return tx.exec1(sql)[0].as<int64_t>();
}

pqxx::result TestDatabase::Query(const std::string& sql) {
  pqxx::nontransaction tx(*conn_);
  return tx.exec(sql);
}

void TestDatabase::Exec(const std::string& sql) {
  pqxx::nontransaction tx(*conn_);
  tx.exec(sql);
}

}  // namespace outbox::testing
