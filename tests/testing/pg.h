#pragma once
// Test support for tests against a real PostgreSQL: each TestDatabase is a
// fresh, migrated database on the server scripts/test started, named after
// the test, dropped when the test ends.

#include <memory>
#include <pqxx/pqxx>
#include <string>
#include <vector>

#include "common/db.h"

namespace outbox::testing {

// OUTBOX_TEST_PG_URL (e.g. "postgresql://postgres@127.0.0.1:5433", no
// database); the test fails with a hint when it is missing.
std::string TestServerUrl();

class TestDatabase {
 public:
  // Creates "t_<prefix>_<random>" and applies `schemas` to it, in order.
  TestDatabase(const std::string& prefix, const std::vector<Schema>& schemas);
  ~TestDatabase();

  const std::string& url() const { return url_; }
  const std::string& name() const { return name_; }

  // Runs a query returning one integer (e.g. "SELECT count(*) FROM outbox").
  int64_t Scalar(const std::string& sql);
  pqxx::result Query(const std::string& sql);
  void Exec(const std::string& sql);

 private:
  std::string name_;
  std::string url_;
  std::unique_ptr<pqxx::connection> conn_;
};

}  // namespace outbox::testing
