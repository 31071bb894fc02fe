#include <cstdlib>

#include <gtest/gtest.h>

#include "absl/flags/flag.h"
#include "common/config.h"
#include "common/db.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/metrics.h"

ABSL_FLAG(int, test_pool_size, 3, "A flag for the environment test.");
ABSL_FLAG(std::string, test_target, "a", "A flag for the environment test.");

namespace outbox {
namespace {

TEST(Config, EnvNameIsUpperSnake) {
  EXPECT_EQ(EnvNameForFlag("db_pool_size"), "OUTBOX_DB_POOL_SIZE");
  EXPECT_EQ(EnvNameForFlag("listen"), "OUTBOX_LISTEN");
}

TEST(Config, EnvironmentSetsFlagsAndBadValuesNameTheVariable) {
  setenv("OUTBOX_TEST_POOL_SIZE", "17", 1);
  setenv("OUTBOX_TEST_TARGET", "consumer:50053", 1);
  ASSERT_TRUE(ApplyFlagsFromEnvironment().ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_test_pool_size), 17);
  EXPECT_EQ(absl::GetFlag(FLAGS_test_target), "consumer:50053");

  setenv("OUTBOX_TEST_POOL_SIZE", "many", 1);
  absl::Status s = ApplyFlagsFromEnvironment();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("OUTBOX_TEST_POOL_SIZE"), std::string::npos) << s;
  unsetenv("OUTBOX_TEST_POOL_SIZE");
  unsetenv("OUTBOX_TEST_TARGET");
}

TEST(Ids, UuidsAreV4AndValidated) {
  std::string a = NewUuid(), b = NewUuid();
  EXPECT_NE(a, b);
  EXPECT_TRUE(IsUuid(a)) << a;
  EXPECT_EQ(a[14], '4');
  EXPECT_TRUE(IsUuid("123E4567-E89B-12D3-A456-426614174000"));
  EXPECT_FALSE(IsUuid(""));
  EXPECT_FALSE(IsUuid("123e4567e89b12d3a456426614174000"));
  EXPECT_FALSE(IsUuid("123e4567-e89b-12d3-a456-42661417400g"));
}

TEST(Ids, TraceParent) {
  EXPECT_TRUE(IsTraceParent(
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
  EXPECT_FALSE(IsTraceParent(
      "00-00000000000000000000000000000000-00f067aa0ba902b7-01"));
  EXPECT_FALSE(IsTraceParent(
      "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
  EXPECT_FALSE(IsTraceParent("garbage"));
  EXPECT_TRUE(IsTraceParent(NewTraceParent()));
}

TEST(Ids, PartitionIsStableAndInRange) {
  EXPECT_EQ(PartitionOf("order-1"), PartitionOf("order-1"));
  // Pinned: rows on disk carry it, so it must never change between builds.
  EXPECT_EQ(PartitionOf(""), static_cast<int>(2166136261u % kPartitionCount));
  std::vector<int> seen(kPartitionCount);
  for (int i = 0; i < 10000; ++i) {
    int p = PartitionOf(NewUuid());
    ASSERT_GE(p, 0);
    ASSERT_LT(p, kPartitionCount);
    ++seen[p];
  }
  for (int n : seen) EXPECT_GT(n, 150);  // roughly even: 312 expected
}

TEST(Log, JsonEscape) {
  EXPECT_EQ(JsonEscape("a\"b\\c\nd\x01"), "a\\\"b\\\\c\\nd\\u0001");
  EXPECT_FALSE(InitLogging("yaml", "info").ok());
  EXPECT_FALSE(InitLogging("text", "loud").ok());
  EXPECT_TRUE(InitLogging("json", "warn").ok());
  EXPECT_TRUE(InitLogging("text", "info").ok());
}

TEST(Db, ConnectionDefaultsAddLivenessSettingsOnce) {
  EXPECT_EQ(WithConnectionDefaults("postgresql://h/db?connect_timeout=2"),
            "postgresql://h/db?connect_timeout=2&keepalives=1&keepalives_idle="
            "10&keepalives_interval=5&keepalives_count=3&tcp_user_timeout=30000");
  EXPECT_EQ(WithConnectionDefaults("host=h dbname=d"),
            "host=h dbname=d connect_timeout=5 keepalives=1 keepalives_idle=10 "
            "keepalives_interval=5 keepalives_count=3 tcp_user_timeout=30000");
}

TEST(Db, ArrayLiteralQuotesEveryElement) {
  EXPECT_EQ(ArrayLiteral().str(), "{}");
  EXPECT_EQ(ArrayLiteral(std::vector<int>{3, 1}).str(), "{\"3\",\"1\"}");
  ArrayLiteral a;
  a.Add("plain");
  a.Add("a \"quote\", a \\ and {braces}");
  EXPECT_EQ(a.str(), "{\"plain\",\"a \\\"quote\\\", a \\\\ and {braces}\"}");
}

TEST(Db, UnreachableDatabaseIsUnavailable) {
  // Port 1 on loopback refuses at once.
  Database db("postgresql://127.0.0.1:1/x", 1, "test");
  absl::Status s = db.Run([](pqxx::connection&) { return absl::OkStatus(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST(Metrics, RendersPrometheusText) {
  Metrics m;
  m.AddCounter("x_total{k=\"a\"}", "Things.")->Add(2);
  m.AddCounter("x_total{k=\"b\"}", "Things.")->Add();
  m.AddGauge("y", "A gauge.", [] { return 1.5; });
  EXPECT_EQ(m.Render(),
            "# HELP x_total Things.\n# TYPE x_total counter\n"
            "x_total{k=\"a\"} 2\nx_total{k=\"b\"} 1\n"
            "# HELP y A gauge.\n# TYPE y gauge\ny 1.5\n");
}

}  // namespace
}  // namespace outbox
