#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/db.h"
#include "common/fault.h"
#include "common/group_commit.h"
#include "common/identity.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/server.h"
#include "common/sql_state.h"
#include "common/text.h"
#include "common/tls.h"
#include "common/watchdog.h"

ABSL_FLAG(int, test_pool_size, 3, "A flag for the environment test.");
ABSL_FLAG(std::string, test_target, "a", "A flag for the environment test.");
ABSL_FLAG(bool, test_bool, false, "A flag for the command line test.");

namespace outbox {
namespace {

TEST(ChainKey, NamesEachChainOnceAndReadsBack) {
  // Different chains never share a key, whatever bytes their parts hold.
  const std::vector<ChainId> chains = {
      {"", "", "x"},       {"", "order", "x"},   {"a", "order", "x"},
      {"a", "orde", "rx"}, {"a:", "order", "x"}, {"", "5:order", "x"},
      {"a", "order", ""},  {"a1", "2:b", "c"},   {"a", "12:b", "c"}};
  std::set<std::string> keys;
  for (const ChainId& c : chains) {
    const std::string key = ChainKey(c);
    EXPECT_TRUE(keys.insert(key).second) << key;
    ChainId back;
    ASSERT_TRUE(ParseChainKey(key, &back)) << key;
    EXPECT_EQ(back.source, c.source);
    EXPECT_EQ(back.type, c.type);
    EXPECT_EQ(back.id, c.id);
    EXPECT_EQ(ChainIdOf(key), c.id);
  }
  ChainId ignored;
  EXPECT_FALSE(ParseChainKey("9:short", &ignored));
  EXPECT_FALSE(ParseChainKey("x:1:ab", &ignored));
  EXPECT_EQ(ChainIdOf("no key"), "no key");
  EXPECT_EQ(ChainLabel(ChainKey("", "order", "7")), "order 7");
  EXPECT_EQ(ChainLabel(ChainKey("s", "order", "7")), "order 7 of source s");
  EXPECT_TRUE(IsSourceName("shard-1.eu_west"));
  EXPECT_FALSE(IsSourceName(""));
  EXPECT_FALSE(IsSourceName("with space"));
  EXPECT_FALSE(IsSourceName(std::string(65, 'a')));
}

TEST(Text, DecodesUtf8AndRefusesWhatPostgresWouldRefuse) {
  EXPECT_EQ(DecodeUtf8("a", 0)->code_point, 0x61u);
  EXPECT_EQ(DecodeUtf8("\xC3\xA9", 0)->length, 2);                // é
  EXPECT_EQ(DecodeUtf8("\xE2\x82\xAC", 0)->code_point, 0x20ACu);  // €
  EXPECT_EQ(DecodeUtf8("\xF0\x9F\x98\x80", 0)->length, 4);
  EXPECT_FALSE(DecodeUtf8("\xA9", 0).has_value());              // continuation
  EXPECT_FALSE(DecodeUtf8("\xC3", 0).has_value());              // cut short
  EXPECT_FALSE(DecodeUtf8("\xC0\xAF", 0).has_value());          // overlong
  EXPECT_FALSE(DecodeUtf8("\xED\xA0\x80", 0).has_value());      // surrogate
  EXPECT_FALSE(DecodeUtf8("\xF4\x90\x80\x80", 0).has_value());  // > U+10FFFF
  EXPECT_FALSE(DecodeUtf8("\xFF", 0).has_value());
  EXPECT_FALSE(DecodeUtf8("", 0).has_value());
}

TEST(Text, StorableTextIsValidUtf8WithoutNulCutAtACharacter) {
  EXPECT_EQ(StorableText("amount: must be positive", 2000),
            "amount: must be positive");
  // A NUL and bytes that are no character become U+FFFD, one each.
  EXPECT_EQ(StorableText(std::string("a\0b\xFF\xC3", 5), 100),
            "a\xEF\xBF\xBD"
            "b\xEF\xBF\xBD\xEF\xBF\xBD");
  // Cut before a character that would not fit whole.
  const std::string e_acute = "\xC3\xA9";
  std::string many;
  for (int i = 0; i < 1500; ++i) many += e_acute;  // 3000 bytes
  const std::string cut = StorableText(many, 2001);
  EXPECT_EQ(cut.size(), 2000u);
  EXPECT_EQ(cut, many.substr(0, 2000));
  EXPECT_EQ(StorableText("abc", 0), "");
  EXPECT_EQ(StorableText(std::string(10, '\0'), 6), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

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

// CheckFlagArguments on a command line given as words.
absl::Status CheckArgs(std::vector<std::string> words) {
  words.insert(words.begin(), "binary");
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  return CheckFlagArguments(static_cast<int>(argv.size()), argv.data());
}

TEST(Config, FlagArgumentsAreCheckedAsAbseilReadsThem) {
  EXPECT_TRUE(CheckArgs({}).ok());
  EXPECT_TRUE(CheckArgs({"--test_pool_size=4", "-test_target", "x:1",
                         "positional", "-", "--log_level", "debug"})
                  .ok());
  // What follows "--" is positional; abseil's own flags are abseil's.
  EXPECT_TRUE(CheckArgs({"--", "--no_such_flag"}).ok());
  EXPECT_TRUE(CheckArgs({"--helpfull"}).ok());
  EXPECT_TRUE(CheckArgs({"--flagfile=/dev/null", "--no_such_flag"}).ok());

  absl::Status s = CheckArgs({"--test_pool_size=4", "--test_poolsize=5"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "unknown flag --test_poolsize (--helpfull lists them)");
  s = CheckArgs({"--test_pool_size", "many"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--test_pool_size=\"many\""), std::string::npos)
      << s;
  s = CheckArgs({"--test_target"});
  EXPECT_EQ(s.message(), "--test_target needs a value");
  // A bool flag takes no value after it, and its negation exists only for
  // a bool.
  EXPECT_EQ(CheckArgs({"--nono_such_flag"}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckArgs({"--test_bool", "positional", "--notest_bool"}).ok());
  EXPECT_EQ(CheckArgs({"--notest_pool_size"}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckArgs({"--test_bool=perhaps"}).code(),
            absl::StatusCode::kInvalidArgument);
  // Checking set the flags to what they will be parsed as, nothing else.
  EXPECT_EQ(absl::GetFlag(FLAGS_test_pool_size), 4);
  EXPECT_EQ(absl::GetFlag(FLAGS_test_target), "x:1");
  absl::SetFlag(&FLAGS_test_pool_size, 3);
  absl::SetFlag(&FLAGS_test_target, "a");
  absl::SetFlag(&FLAGS_test_bool, false);
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

TEST(Ids, TimeOrderedUuidsAreV7AndSortByTime) {
  const int64_t before = absl::ToUnixMillis(absl::Now());
  std::string a = NewTimeOrderedUuid();
  EXPECT_TRUE(IsUuid(a)) << a;
  EXPECT_EQ(a[14], '7') << a;
  EXPECT_NE(std::string("89ab").find(a[19]), std::string::npos) << a;
  // The first 48 bits are the Unix time in milliseconds.
  const int64_t ms = std::stoll(a.substr(0, 8) + a.substr(9, 4), nullptr, 16);
  EXPECT_GE(ms, before);
  EXPECT_LE(ms, absl::ToUnixMillis(absl::Now()));
  absl::SleepFor(absl::Milliseconds(2));
  std::string b = NewTimeOrderedUuid();
  EXPECT_LT(a, b);  // a later millisecond sorts after (text and uuid order)
  std::set<std::string> many;
  for (int i = 0; i < 10000; ++i) many.insert(NewTimeOrderedUuid());
  EXPECT_EQ(many.size(), 10000u);  // 74 random bits within a millisecond
}

TEST(Ids, TraceParent) {
  EXPECT_TRUE(
      IsTraceParent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
  EXPECT_FALSE(
      IsTraceParent("00-00000000000000000000000000000000-00f067aa0ba902b7-01"));
  EXPECT_FALSE(
      IsTraceParent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
  EXPECT_FALSE(IsTraceParent("garbage"));
  EXPECT_TRUE(IsTraceParent(NewTraceParent()));
  // W3C: lower-case hex only; version ff is never valid; all-zero ids are.
  EXPECT_FALSE(
      IsTraceParent("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"));
  EXPECT_FALSE(
      IsTraceParent("00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01"));
  EXPECT_FALSE(
      IsTraceParent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A"));
  EXPECT_FALSE(
      IsTraceParent("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
  EXPECT_FALSE(
      IsTraceParent("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"));
}

// What the producer accepts and stores is exactly what the logs carry:
// one traceparent never valid for one and invalid for the other.
TEST(Ids, TraceIdOfAgreesWithIsTraceParent) {
  for (const std::string& s : std::vector<std::string>{
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
           "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
           "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
           "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
           "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
           "00-4bf92f3577b34da6a3ce929d0e0e4736+00f067aa0ba902b7-01",
           NewTraceParent()}) {
    EXPECT_EQ(TraceIdOf(s), IsTraceParent(s) ? s.substr(3, 32) : "") << s;
  }
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

TEST(Log, TraceIdComesFromAW3CTraceparentOnly) {
  EXPECT_EQ(
      TraceIdOf("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
      "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(TraceIdOf(""), "");
  EXPECT_EQ(
      TraceIdOf("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
      "");  // upper case is not W3C
  EXPECT_EQ(
      TraceIdOf("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
      "");  // the all-zero id is invalid
  EXPECT_EQ(TraceIdOf("garbage that is long enough to pass the length check.."),
            "");
}

// Every line logged while a scope lives carries the event's fields, as
// JSON fields or as key=value in text; none after it ends.
TEST(Log, LinesAboutAnEventCarryItsFields) {
  v1::Event e;
  e.set_event_id("6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e");
  e.set_aggregate_id("order \"7\"");
  e.set_seq(42);
  e.set_trace_parent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
  ASSERT_TRUE(InitLogging("json", "info").ok());
  ::testing::internal::CaptureStderr();
  {
    LogEventScope scope(FieldsOf(e));
    spdlog::warn("about the event");
  }
  spdlog::warn("about nothing");
  std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(
      out.find(
          R"("msg":"about the event","event_id":"6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e","aggregate_id":"order \"7\"","seq":42,"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736"})"),
      std::string::npos)
      << out;
  EXPECT_NE(out.find(R"("msg":"about nothing"})"), std::string::npos) << out;
  ASSERT_TRUE(InitLogging("text", "info").ok());
  ::testing::internal::CaptureStderr();
  {
    LogEventScope scope(FieldsOf(e));
    spdlog::warn("in text");
  }
  out = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(out.find("in text [event_id=6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e "
                     "aggregate_id=order \"7\" seq=42 "
                     "trace_id=4bf92f3577b34da6a3ce929d0e0e4736]"),
            std::string::npos)
      << out;
}

TEST(Log, JsonEscape) {
  EXPECT_EQ(JsonEscape("a\"b\\c\nd\x01"), "a\\\"b\\\\c\\nd\\u0001");
  EXPECT_FALSE(InitLogging("yaml", "info").ok());
  EXPECT_FALSE(InitLogging("text", "loud").ok());
  EXPECT_TRUE(InitLogging("json", "warn").ok());
  EXPECT_TRUE(InitLogging("text", "info").ok());
}

TEST(Db, ConnectionDefaultsAddLivenessSettingsOnce) {
  unsetenv("PGCONNECT_TIMEOUT");
  EXPECT_EQ(
      WithConnectionDefaults("postgresql://h/db?connect_timeout=2"),
      "postgresql://h/db?connect_timeout=2&keepalives=1&keepalives_idle="
      "10&keepalives_interval=5&keepalives_count=3&tcp_user_timeout=30000");
  EXPECT_EQ(WithConnectionDefaults("host=h dbname=d"),
            "host=h dbname=d connect_timeout=5 keepalives=1 keepalives_idle=10 "
            "keepalives_interval=5 keepalives_count=3 tcp_user_timeout=30000");
  // A value that contains a setting's name sets nothing.
  EXPECT_EQ(WithConnectionDefaults(
                "host=h password='connect_timeout=1 keepalives=0'"),
            "host=h password='connect_timeout=1 keepalives=0' "
            "connect_timeout=5 keepalives=1 keepalives_idle=10 "
            "keepalives_interval=5 keepalives_count=3 tcp_user_timeout=30000");
  EXPECT_EQ(WithConnectionDefaults("postgresql://h/db?password=keepalives%3D0&"
                                   "keepalives=0&tcp_user_timeout=0"),
            "postgresql://h/db?password=keepalives%3D0&keepalives=0&"
            "tcp_user_timeout=0&connect_timeout=5&keepalives_idle=10&"
            "keepalives_interval=5&keepalives_count=3");
  // What libpq cannot parse is left for the connect to report.
  EXPECT_EQ(WithConnectionDefaults("host='h"), "host='h");
  // libpq's connect timeout from the environment is not overridden.
  setenv("PGCONNECT_TIMEOUT", "30", 1);
  EXPECT_EQ(WithConnectionDefaults("host=h"),
            "host=h keepalives=1 keepalives_idle=10 keepalives_interval=5 "
            "keepalives_count=3 tcp_user_timeout=30000");
  unsetenv("PGCONNECT_TIMEOUT");
}

// The password as libpq itself reads it from `conninfo` ("" if none).
std::string PasswordLibpqReads(const std::string& conninfo) {
  char* error = nullptr;
  PQconninfoOption* opts = PQconninfoParse(conninfo.c_str(), &error);
  if (opts == nullptr) {
    std::string e = error ? error : "?";
    PQfreemem(error);
    return "unparsable: " + e;
  }
  std::string password;
  for (PQconninfoOption* o = opts; o->keyword != nullptr; ++o) {
    if (std::string(o->keyword) == "password" && o->val != nullptr) {
      password = o->val;
    }
  }
  PQconninfoFree(opts);
  return password;
}

TEST(Db, WithPasswordSetsThePasswordLibpqReads) {
  const std::string odd = "p@ss w/rd?&='\\\"%#:é";
  for (const std::string& url :
       {std::string("postgresql://u@h:5432/db"),
        std::string("postgresql://u:old@h/db?sslmode=require"),
        std::string("postgres://h/db"), std::string("host=h dbname=d"),
        std::string("host=h password=old dbname=d")}) {
    for (const std::string& pw : {std::string("simple"), odd}) {
      const std::string with = WithPassword(url, pw);
      EXPECT_EQ(PasswordLibpqReads(with), pw) << with;
      // The other settings stay, and the defaults still go on.
      EXPECT_EQ(PasswordLibpqReads(WithConnectionDefaults(with)), pw) << with;
    }
    EXPECT_EQ(WithPassword(url, ""), url);
  }
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
  EXPECT_EQ(m.AddCounter("x_total{k=\"a\"}", "Things.")->value(), 2);
  m.AddGauge("y", "A gauge.", [] { return 1.5; });
  m.AddGaugeFamily("z", "Per part.", [] {
    return std::vector<std::pair<Labels, double>>{{{{"part", "1"}}, 3}};
  });
  m.AddHistogram("h_seconds", "Latency.", {0.1, 1})->Observe(0.5);
  const std::string text = m.Render();
  for (const char* want :
       {"# TYPE x_total counter\n", "x_total{k=\"a\"} 2\n",
        "x_total{k=\"b\"} 1\n", "# TYPE y gauge\ny 1.5\n", "z{part=\"1\"} 3\n",
        "h_seconds_bucket{le=\"1\"} 1\n", "h_seconds_count 1\n",
        "# TYPE process_cpu_seconds_total counter\n",
        "process_resident_memory_bytes ", "process_open_fds "}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << " in\n" << text;
  }
}

TEST(Metrics, NamesCarryTheirLabels) {
  auto [family, labels] =
      ParseMetricName("x_total{method=\"Pay\",code=\"OK\"}");
  EXPECT_EQ(family, "x_total");
  EXPECT_EQ(labels, (Labels{{"method", "Pay"}, {"code", "OK"}}));
  EXPECT_EQ(ParseMetricName("plain").first, "plain");
}

TEST(Metrics, ASlowClientDoesNotBlockScrapes) {
  Metrics m;
  m.AddGauge("y", "A gauge.", [] { return 1; });
  auto server = MetricsHttpServer::Start("127.0.0.1:0", &m);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  auto connect = [&] {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    return fd;
  };
  // Two clients that send half a request line and then nothing.
  int slow1 = connect(), slow2 = connect();
  ASSERT_GT(send(slow1, "GET /met", 8, 0), 0);
  ASSERT_GT(send(slow2, "GE", 2, 0), 0);
  int fd = connect();
  const char req[] =
      "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  ASSERT_GT(send(fd, req, sizeof(req) - 1, 0), 0);
  std::string got;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) got.append(buf, n);
  EXPECT_NE(got.find("y 1"), std::string::npos) << got;
  // Served while both slow clients were still connected, not after the
  // server gave up on them: their sockets are open, with nothing to read.
  for (int slow : {slow1, slow2}) {
    errno = 0;
    EXPECT_EQ(recv(slow, buf, 1, MSG_DONTWAIT), -1);
    EXPECT_EQ(errno, EAGAIN);
  }
  close(fd);
  close(slow1);
  close(slow2);
}

// The rule of common/sql_state.h, one SQLSTATE class at a time: only data
// classes may be blamed on an event; a conflict is retried at once;
// everything else is the world's fault and costs a retry, never an event.
struct SqlStateCase {
  const char* state;
  ErrorOrigin origin;
  absl::StatusCode code;
  const char* what;
};

class SqlStateRule : public ::testing::TestWithParam<SqlStateCase> {};

TEST_P(SqlStateRule, ClassDecidesOriginAndCode) {
  const SqlStateCase& c = GetParam();
  EXPECT_EQ(OriginOfSqlState(c.state), c.origin)
      << c.state << " (" << c.what << ")";
  EXPECT_EQ(CodeForSqlState(c.state), c.code)
      << c.state << " (" << c.what << ")";
}

constexpr auto kData = ErrorOrigin::kData;
constexpr auto kConflict = ErrorOrigin::kConflict;
constexpr auto kWorld = ErrorOrigin::kWorld;
using Code = absl::StatusCode;

INSTANTIATE_TEST_SUITE_P(
    EveryClass, SqlStateRule,
    ::testing::Values(
        SqlStateCase{"22001", kData, Code::kInvalidArgument, "string too long"},
        SqlStateCase{"22P02", kData, Code::kInvalidArgument, "bad text value"},
        SqlStateCase{"22021", kData, Code::kInvalidArgument, "bad encoding"},
        SqlStateCase{"23505", kData, Code::kAlreadyExists, "unique violation"},
        SqlStateCase{"23514", kData, Code::kFailedPrecondition,
                     "check violation"},
        SqlStateCase{"54000", kData, Code::kInvalidArgument, "program limit"},
        SqlStateCase{"40001", kConflict, Code::kAborted,
                     "serialization failure"},
        SqlStateCase{"40P01", kConflict, Code::kAborted, "deadlock"},
        SqlStateCase{"08006", kWorld, Code::kUnavailable, "connection failure"},
        SqlStateCase{"25006", kWorld, Code::kUnavailable,
                     "read-only transaction"},
        SqlStateCase{"25P03", kWorld, Code::kUnavailable,
                     "idle in transaction timeout"},
        SqlStateCase{"28P01", kWorld, Code::kUnavailable, "bad password"},
        SqlStateCase{"3D000", kWorld, Code::kUnavailable, "no such database"},
        SqlStateCase{"42501", kWorld, Code::kUnavailable,
                     "insufficient privilege"},
        SqlStateCase{"42P01", kWorld, Code::kUnavailable, "no such table"},
        SqlStateCase{"53100", kWorld, Code::kUnavailable, "disk full"},
        SqlStateCase{"53200", kWorld, Code::kUnavailable, "out of memory"},
        SqlStateCase{"53300", kWorld, Code::kUnavailable,
                     "too many connections"},
        SqlStateCase{"55P03", kWorld, Code::kUnavailable, "lock timeout"},
        SqlStateCase{"55000", kWorld, Code::kUnavailable,
                     "not accepting connections"},
        SqlStateCase{"57014", kWorld, Code::kUnavailable, "statement timeout"},
        SqlStateCase{"57P01", kWorld, Code::kUnavailable, "admin shutdown"},
        SqlStateCase{"57P02", kWorld, Code::kUnavailable, "crash shutdown"},
        SqlStateCase{"57P03", kWorld, Code::kUnavailable, "cannot connect now"},
        SqlStateCase{"58030", kWorld, Code::kUnavailable, "I/O error"},
        SqlStateCase{"XX001", kWorld, Code::kUnavailable, "data corrupted"},
        SqlStateCase{"P0001", kWorld, Code::kUnavailable,
                     "raised by a trigger"},
        SqlStateCase{"0A000", kWorld, Code::kUnavailable, "not supported"},
        SqlStateCase{"", kWorld, Code::kUnavailable, "no SQLSTATE"},
        SqlStateCase{"ZZ999", kWorld, Code::kUnavailable, "unknown class"}));

TEST(SqlState, OriginOfAStatusComesFromItsSqlState) {
  // A server error as libpqxx throws it keeps its SQLSTATE.
  pqxx::sql_error read_only("cannot execute INSERT in a read-only transaction",
                            "INSERT ...", "25006");
  absl::Status s = StatusFromException(read_only);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(SqlStateOf(s), "25006");
  EXPECT_EQ(OriginOf(s), ErrorOrigin::kWorld);
  EXPECT_NE(s.message().find("[SQLSTATE 25006]"), std::string::npos) << s;

  pqxx::sql_error bad_value("value too long", "INSERT ...", "22001");
  EXPECT_EQ(OriginOf(StatusFromException(bad_value)), ErrorOrigin::kData);

  // libpqxx 6.4 throws these as types without the SQLSTATE: it is recovered.
  EXPECT_EQ(SqlStateOf(StatusFromException(pqxx::serialization_failure("x"))),
            "40001");
  EXPECT_EQ(StatusFromException(pqxx::deadlock_detected("x")).code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(SqlStateOf(StatusFromException(pqxx::insufficient_privilege("x"))),
            "42501");
  EXPECT_EQ(SqlStateOf(StatusFromException(pqxx::too_many_connections("x"))),
            "53300");

  // Without one: a lost connection, or any other status, is the world's.
  EXPECT_EQ(OriginOf(StatusFromException(pqxx::broken_connection("gone"))),
            ErrorOrigin::kWorld);
  EXPECT_EQ(OriginOf(absl::DataLossError("x")), ErrorOrigin::kWorld);
}

TEST(DbSession, SettingsNameEveryTimeoutInMilliseconds) {
  DbSession s;
  s.statement_timeout = absl::Seconds(3);
  s.lock_timeout = absl::Milliseconds(250);
  s.idle_in_transaction_timeout = absl::ZeroDuration();
  EXPECT_EQ(SessionSettingsSql(s),
            "SET synchronous_commit = on; SET statement_timeout = 3000; "
            "SET lock_timeout = 250; "
            "SET idle_in_transaction_session_timeout = 0; SET jit = off; "
            "SET default_transaction_isolation = 'read committed'");
  s.generic_plans = true;
  EXPECT_EQ(SessionSettingsSql(s),
            "SET synchronous_commit = on; SET statement_timeout = 3000; "
            "SET lock_timeout = 250; "
            "SET idle_in_transaction_session_timeout = 0; SET jit = off; "
            "SET default_transaction_isolation = 'read committed'; "
            "SET plan_cache_mode = force_generic_plan");
  // For one transaction (behind a transaction pooler): SET LOCAL, and no
  // plan setting, which only matters to a session's prepared statements.
  EXPECT_EQ(SessionSettingsSql(s, /*local=*/true),
            "SET LOCAL synchronous_commit = on; SET LOCAL statement_timeout = "
            "3000; SET LOCAL lock_timeout = 250; "
            "SET LOCAL idle_in_transaction_session_timeout = 0; SET LOCAL jit = "
            "off");
  // A server that waits longer already (remote_apply for a synchronous
  // standby) keeps its setting.
  EXPECT_EQ(SessionSettingsSql(s, /*local=*/false, /*durable_already=*/true)
                .find("synchronous_commit"),
            std::string::npos);
}

TEST(DatabaseIdentity, KeysRoundTripAndUnknownIsEmpty) {
  DatabaseIdentity id{7714441403134788341u, 2, 16384};
  EXPECT_EQ(id.Key(), "7714441403134788341/2/16384");
  ASSERT_TRUE(DatabaseIdentity::FromKey(id.Key()).has_value());
  EXPECT_EQ(*DatabaseIdentity::FromKey(id.Key()), id);
  EXPECT_EQ(DatabaseIdentity{}.Key(), "");
  EXPECT_FALSE(DatabaseIdentity::FromKey("").has_value());
  EXPECT_FALSE(DatabaseIdentity::FromKey("1/2").has_value());
  EXPECT_FALSE(DatabaseIdentity::FromKey("0/1/2").has_value());
  EXPECT_FALSE(DatabaseIdentity::FromKey("x/1/2").has_value());
}

TEST(DatabaseIdentity, AChangeIsAFailoverAnotherServerOrARecreatedDatabase) {
  const DatabaseIdentity a{77, 1, 16384};
  EXPECT_EQ(CompareIdentity(a, a).kind, IdentityChange::kSame);
  EXPECT_EQ(CompareIdentity({}, a).kind, IdentityChange::kSame);
  EXPECT_EQ(CompareIdentity(a, {}).kind, IdentityChange::kSame);
  const IdentityChange promoted = CompareIdentity(a, {77, 2, 16384});
  EXPECT_EQ(promoted.kind, IdentityChange::kFailover);
  // What operators and alerts search for: the word and both timelines.
  EXPECT_NE(promoted.Describe().find("failover"), std::string::npos);
  EXPECT_NE(promoted.Describe().find("timeline 1 -> 2"), std::string::npos)
      << promoted.Describe();
  EXPECT_EQ(CompareIdentity(a, {78, 1, 16384}).kind,
            IdentityChange::kNewServer);
  const IdentityChange restored = CompareIdentity(a, {77, 1, 20000});
  EXPECT_EQ(restored.kind, IdentityChange::kRecreated);
  EXPECT_NE(restored.Describe().find("failover"), std::string::npos);
  EXPECT_NE(restored.Describe().find("timeline 1 -> 1"), std::string::npos);
}

TEST(IdentityWatch, ReportsEachChangeOnceAndARecordedOneBeforeAny) {
  std::vector<IdentityChange::Kind> heard;
  IdentityWatch watch(
      "db", [&](const IdentityChange& c) { heard.push_back(c.kind); });
  EXPECT_FALSE(watch.Observe({77, 1, 5}).changed());  // the first
  EXPECT_FALSE(watch.Observe({77, 1, 5}).changed());
  // What the database recorded before this process ran: a promotion then.
  EXPECT_EQ(watch.ObserveRecorded({77, 0, 5}).kind, IdentityChange::kFailover);
  EXPECT_FALSE(watch.ObserveRecorded({76, 0, 5}).changed());  // once only
  EXPECT_EQ(watch.Observe({77, 2, 5}).kind, IdentityChange::kFailover);
  EXPECT_FALSE(watch.Observe({}).changed());  // unknown: no news
  EXPECT_EQ(watch.current(), (DatabaseIdentity{77, 2, 5}));
  EXPECT_EQ(watch.changes(), 2);
  EXPECT_EQ(heard, (std::vector<IdentityChange::Kind>{
                       IdentityChange::kFailover, IdentityChange::kFailover}));
  // A recorded identity only counts before the process saw any change.
  IdentityWatch later("db");
  later.Observe({77, 1, 5});
  later.Observe({77, 2, 5});
  EXPECT_FALSE(later.ObserveRecorded({77, 1, 5}).changed());
}

TEST(Pooler, ParsesItsFlagValues) {
  EXPECT_EQ(*ParsePooler("auto"), Pooler::kAuto);
  EXPECT_EQ(*ParsePooler("none"), Pooler::kNone);
  EXPECT_EQ(*ParsePooler("session"), Pooler::kSession);
  EXPECT_EQ(*ParsePooler("transaction"), Pooler::kTransaction);
  EXPECT_FALSE(ParsePooler("statement").ok());
  EXPECT_FALSE(ParsePooler("").ok());
}

TEST(Watchdog, StallsOnlyWhileItHasWorkWithoutProgress) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  Watchdog w("apply path", absl::Seconds(30));
  EXPECT_FALSE(w.Stalled(t0 + absl::Hours(1)));  // idle is healthy

  w.Working(t0);
  EXPECT_FALSE(w.Stalled(t0 + absl::Seconds(30)));
  w.Failed(absl::UnavailableError("read-only"), t0 + absl::Seconds(10));
  auto why = w.Stalled(t0 + absl::Seconds(31));
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("apply path made no progress for 31s"), std::string::npos)
      << *why;
  EXPECT_NE(why->find("last error: read-only"), std::string::npos) << *why;

  w.Progress(t0 + absl::Seconds(40));  // moves, still busy
  EXPECT_FALSE(w.Stalled(t0 + absl::Seconds(60)));
  EXPECT_TRUE(w.Stalled(t0 + absl::Seconds(71)));

  w.Done(t0 + absl::Seconds(80));
  EXPECT_FALSE(w.Stalled(t0 + absl::Hours(2)));
  w.Working(t0 + absl::Hours(2));  // the clock starts anew
  EXPECT_FALSE(w.Stalled(t0 + absl::Hours(2) + absl::Seconds(29)));

  Watchdog off("x", absl::ZeroDuration());
  off.Working(t0);
  EXPECT_FALSE(off.Stalled(t0 + absl::Hours(9)));
}

// -- Who may call what (common/identity.h), one rule at a time. ------------

PeerCertificate Cert(std::vector<std::string> uris,
                     std::vector<std::string> dns, std::string cn) {
  return {std::move(uris), std::move(dns), std::move(cn)};
}

TEST(Identity, UriSansComeFirstThenDnsSansThenTheCommonNameIfAllowed) {
  using S = std::vector<std::string>;
  for (bool cn : {false, true}) {
    EXPECT_EQ(IdentitiesOf(
                  Cert({"spiffe://outbox/relay"}, {"relay.svc"}, "relay"), cn),
              (S{"spiffe://outbox/relay"}));
    EXPECT_EQ(IdentitiesOf(Cert({}, {"relay.svc", "localhost"}, "relay"), cn),
              (S{"relay.svc", "localhost"}));
    EXPECT_TRUE(IdentitiesOf(Cert({}, {}, ""), cn).empty());
  }
  EXPECT_EQ(IdentitiesOf(Cert({}, {}, "relay"), true), (S{"relay"}));
  EXPECT_TRUE(IdentitiesOf(Cert({}, {}, "relay"), false).empty());
}

AccessRules MutualTls(std::set<std::string> allowed,
                      std::set<std::string> admin) {
  AccessRules r;
  r.require_identity = true;
  r.tls = true;
  r.allowed = std::move(allowed);
  r.admin = std::move(admin);
  return r;
}

TEST(Identity, PlaintextAdmitsEveryCallerForEverything) {
  AccessRules open;
  EXPECT_TRUE(open.Decide(std::nullopt, Access::kCall).ok());
  EXPECT_TRUE(open.Decide(std::nullopt, Access::kAdmin).ok());
}

TEST(Identity, TlsWithoutClientCertificatesAdmitsCallsButNoDeliveryOrAdmin) {
  AccessRules tls_only;
  tls_only.tls = true;
  EXPECT_TRUE(tls_only.Decide(std::nullopt, Access::kCall).ok());
  for (Access a : {Access::kDeliver, Access::kAdmin}) {
    absl::Status s = tls_only.Decide(std::nullopt, a);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
    EXPECT_NE(s.message().find("--tls_client_ca"), std::string::npos) << s;
  }
}

TEST(Identity, MutualTlsWithoutACertificateIsUnauthenticated) {
  absl::Status s = MutualTls({}, {}).Decide(std::nullopt, Access::kCall);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
}

TEST(Identity, AnEmptyAllowListAdmitsEveryCertificateOfTheCa) {
  auto rules = MutualTls({}, {});
  EXPECT_TRUE(
      rules.Decide(Cert({"spiffe://outbox/anyone"}, {}, ""), Access::kCall)
          .ok());
}

TEST(Identity, OnlyListedIdentitiesAreAdmittedAndRefusalsNameTheIdentity) {
  auto rules = MutualTls({"spiffe://outbox/relay"}, {});
  EXPECT_TRUE(
      rules.Decide(Cert({"spiffe://outbox/relay"}, {}, "x"), Access::kCall)
          .ok());
  absl::Status s = rules.Decide(
      Cert({"spiffe://outbox/intruder"}, {"relay"}, "relay"), Access::kCall);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("spiffe://outbox/intruder"), std::string::npos)
      << s;
  EXPECT_NE(s.message().find("--allowed_clients"), std::string::npos) << s;
}

TEST(Identity, AUriSanHidesDnsSansAndTheCommonName) {
  // A certificate with a URI SAN is that URI: its DNS name or CN being
  // listed does not admit it.
  auto rules = MutualTls({"relay", "relay.svc"}, {});
  EXPECT_EQ(rules
                .Decide(Cert({"spiffe://outbox/other"}, {"relay.svc"}, "relay"),
                        Access::kCall)
                .code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(rules.Decide(Cert({}, {"relay.svc"}, "x"), Access::kCall).ok());
  // A CN alone is no identity unless the server says so.
  absl::Status s = rules.Decide(Cert({}, {}, "relay"), Access::kCall);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("--tls_cn_identity"), std::string::npos) << s;
  rules.common_name_identity = true;
  EXPECT_TRUE(rules.Decide(Cert({}, {}, "relay"), Access::kCall).ok());
  EXPECT_EQ(
      rules.Decide(Cert({}, {"other.svc"}, "relay"), Access::kCall).code(),
      absl::StatusCode::kPermissionDenied);
}

// A CN that looks like the relay's URI is not the relay: CA-signed for some
// other purpose, it would otherwise deliver forged events.
TEST(Identity, ACommonNameSpellingAUriDoesNotPassAsIt) {
  auto rules = MutualTls({}, {});
  rules.delivery = {"spiffe://outbox/relay"};
  EXPECT_EQ(
      rules.Decide(Cert({}, {}, "spiffe://outbox/relay"), Access::kDeliver)
          .code(),
      absl::StatusCode::kPermissionDenied);
}

TEST(Identity, AdminCallsNeedAnAdminIdentityEvenWhenReadsAreAllowed) {
  auto rules = MutualTls({"spiffe://outbox/reader"}, {"spiffe://outbox/ops"});
  const auto reader = Cert({"spiffe://outbox/reader"}, {}, "");
  const auto ops = Cert({"spiffe://outbox/ops"}, {}, "");
  EXPECT_TRUE(rules.Decide(reader, Access::kCall).ok());
  absl::Status s = rules.Decide(reader, Access::kAdmin);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("--admin_clients"), std::string::npos) << s;
  EXPECT_TRUE(rules.Decide(ops, Access::kAdmin).ok());
  EXPECT_TRUE(rules.Decide(ops, Access::kCall).ok());  // admins may read
}

TEST(Identity, DeliveryCanBeNarrowerThanCalls) {
  auto rules = MutualTls({"spiffe://outbox/relay", "spiffe://outbox/ops"}, {});
  const auto relay = Cert({"spiffe://outbox/relay"}, {}, "");
  const auto ops = Cert({"spiffe://outbox/ops"}, {}, "");
  EXPECT_TRUE(rules.Decide(ops, Access::kDeliver).ok());  // no list: as kCall
  rules.delivery = {"spiffe://outbox/relay"};
  EXPECT_TRUE(rules.Decide(relay, Access::kDeliver).ok());
  EXPECT_TRUE(rules.Decide(ops, Access::kCall).ok());
  absl::Status s = rules.Decide(ops, Access::kDeliver);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("--delivery_clients"), std::string::npos) << s;
}

TEST(Identity, NoAdminListRefusesAdminCallsUnderMutualTls) {
  auto rules = MutualTls({}, {});
  EXPECT_EQ(rules.Decide(Cert({"spiffe://outbox/any"}, {}, ""), Access::kAdmin)
                .code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(Identity, ListsAreCommaSeparatedAndTrimmed) {
  EXPECT_EQ(
      ParseIdentityList(" spiffe://outbox/relay, relay.svc ,,cn "),
      (std::set<std::string>{"spiffe://outbox/relay", "relay.svc", "cn"}));
  EXPECT_TRUE(ParseIdentityList("").empty());
}

TEST(Tls, FilesMustFitTogether) {
  EXPECT_TRUE(CheckServerTls({}).ok());
  EXPECT_NE(CheckServerTls({"a.crt", "", ""}).message().find("--tls_key"),
            std::string::npos);
  EXPECT_NE(
      CheckServerTls({"", "", "ca.crt"}).message().find("--tls_client_ca"),
      std::string::npos);
  absl::Status missing =
      CheckServerTls({"/nonexistent.crt", "/nonexistent.key", ""});
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("--tls_cert: cannot read"),
            std::string::npos)
      << missing;
  ClientTlsFlags flags{"--ca", "--cert", "--key"};
  EXPECT_TRUE(CheckClientTls({}, flags).ok());
  EXPECT_NE(
      CheckClientTls({"", "c.crt", "c.key"}, flags).message().find("--ca"),
      std::string::npos);
}

TEST(PublicMessage, DatabaseInternalsNeverReachCallers) {
  pqxx::sql_error e("ERROR:  permission denied for table orders",
                    "INSERT INTO orders ...", "42501");
  const std::string m = PublicMessage(StatusFromException(e));
  EXPECT_EQ(m.find("orders"), std::string::npos) << m;
  EXPECT_EQ(m.find("permission"), std::string::npos) << m;
  EXPECT_NE(m.find("the database is unavailable"), std::string::npos) << m;
  EXPECT_NE(m.find("[error id "), std::string::npos) << m;
  const std::string lost =
      PublicMessage(StatusFromException(pqxx::broken_connection(
          "connection to server at \"10.0.0.7\", port 5432 failed")));
  EXPECT_EQ(lost.find("10.0.0.7"), std::string::npos) << lost;
  // The service's own answers keep their message.
  EXPECT_EQ(
      PublicMessage(absl::InvalidArgumentError("currency: must be 3 letters")),
      "currency: must be 3 letters");
  EXPECT_EQ(PublicMessage(absl::NotFoundError("order x does not exist")),
            "order x does not exist");
  EXPECT_EQ(ToGrpcStatus(absl::InternalError("stack trace")).error_code(),
            grpc::StatusCode::INTERNAL);
}

// What the caller gets carries an error id; the log has the full error,
// internals included, under exactly that id, so an operator finds it.
TEST(PublicMessage, TheFullErrorIsLoggedUnderTheIdTheCallerGets) {
  std::ostringstream logged;
  auto previous = spdlog::default_logger();
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(logged);
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  pqxx::sql_error e("ERROR:  permission denied for table orders",
                    "INSERT INTO orders ...", "42501");
  const grpc::Status answer = ToGrpcStatus(StatusFromException(e));
  const absl::Status other = absl::InternalError("another failure");
  const std::string other_answer = PublicMessage(other);
  spdlog::set_default_logger(previous);
  EXPECT_EQ(answer.error_code(), grpc::StatusCode::UNAVAILABLE);
  const std::string m = answer.error_message();
  const size_t at = m.find("[error id ");
  ASSERT_NE(at, std::string::npos) << m;
  const std::string id = m.substr(at + 10, 8);
  EXPECT_EQ(m.substr(at + 18, 1), "]") << m;
  EXPECT_EQ(m.find("orders"), std::string::npos) << m;
  const std::string log = logged.str();
  const size_t line = log.find("error id " + id + ": ");
  ASSERT_NE(line, std::string::npos) << log;
  const std::string entry = log.substr(line, log.find('\n', line) - line);
  EXPECT_NE(entry.find("permission denied for table orders"), std::string::npos)
      << entry;
  EXPECT_NE(entry.find("42501"), std::string::npos) << entry;
  // Each error its own id.
  EXPECT_EQ(other_answer.find(id), std::string::npos) << other_answer;
}

TEST(GroupCommit, AloneACallerWritesItsItemAtOnce) {
  std::vector<size_t> groups;
  GroupCommit<int, int> commit(
      {.writers = 2, .max_group = 8},
      [&](const std::vector<const int*>& items) {
        groups.push_back(items.size());
        return std::vector<absl::StatusOr<int>>{*items[0] * 10};
      });
  EXPECT_EQ(*commit.Submit(4), 40);
  EXPECT_EQ(groups, (std::vector<size_t>{1}));
}

TEST(GroupCommit, ConcurrentCallersShareWritesAndGetTheirOwnResults) {
  std::mutex mu;
  std::vector<size_t> groups;
  GroupCommit<int, int> commit(
      {.writers = 1, .max_group = 16},
      [&](const std::vector<const int*>& items) {
        {
          std::lock_guard<std::mutex> lock(mu);
          groups.push_back(items.size());
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        std::vector<absl::StatusOr<int>> out;
        for (const int* i : items) {
          if (*i % 7 == 0) {
            out.push_back(absl::InvalidArgumentError("multiple of 7"));
          } else {
            out.push_back(*i * 2);
          }
        }
        return out;
      });
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 1; k <= 20; ++k) {
        const int item = t * 100 + k;
        absl::StatusOr<int> r = commit.Submit(item);
        const bool ok = item % 7 == 0 ? r.status().code() ==
                                            absl::StatusCode::kInvalidArgument
                                      : r.ok() && *r == item * 2;
        if (!ok) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong, 0);
  size_t total = 0, largest = 0;
  for (size_t g : groups) {
    total += g;
    largest = std::max(largest, g);
  }
  EXPECT_EQ(total, 160u);  // every item written once
  EXPECT_GT(largest, 1u);  // one writer at a time: the others queued up
  EXPECT_LE(largest, 16u);
}

// Items waiting when a write ends are written while the callers of that
// write are answered: a caller's slow answer (here one that waits for the
// next item's result) does not hold the next write up.
TEST(GroupCommit, AnsweringDoesNotHoldUpTheNextWrite) {
  std::promise<void> writing_first, second_queued;
  std::shared_future<void> queued = second_queued.get_future().share();
  std::promise<int> second_result;
  std::shared_future<int> second = second_result.get_future().share();
  std::atomic<bool> first_saw_second{false};
  std::thread::id writer, first_answered_on;
  GroupCommit<int, int> commit(
      {.writers = 1, .max_group = 8},
      [&](const std::vector<const int*>& items) {
        if (*items[0] == 1) {
          writer = std::this_thread::get_id();
          writing_first.set_value();
          queued.wait();  // the second item waits once this write ends
        }
        std::vector<absl::StatusOr<int>> out;
        for (const int* i : items) out.push_back(*i * 10);
        return out;
      });
  std::promise<void> first_done;
  commit.SubmitAsync(1, [&](absl::StatusOr<int> r) {
    EXPECT_EQ(*r, 10);
    first_answered_on = std::this_thread::get_id();
    first_saw_second =
        second.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
    first_done.set_value();
  });
  writing_first.get_future().wait();
  commit.SubmitAsync(
      2, [&](absl::StatusOr<int> r) { second_result.set_value(*r); });
  second_queued.set_value();
  first_done.get_future().wait();
  EXPECT_TRUE(first_saw_second);
  EXPECT_EQ(second.get(), 20);
  EXPECT_NE(first_answered_on, writer);
}

// Stopping writes every queued item and answers every caller.
TEST(GroupCommit, StoppingAnswersEveryCaller) {
  std::atomic<int> answered{0};
  {
    GroupCommit<int, int> commit(
        {.writers = 2, .max_group = 4},
        [&](const std::vector<const int*>& items) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          return std::vector<absl::StatusOr<int>>(items.size(), 1);
        });
    for (int i = 0; i < 200; ++i) {
      commit.SubmitAsync(i, [&](absl::StatusOr<int> r) {
        if (r.ok()) ++answered;
      });
    }
  }
  EXPECT_EQ(answered, 200);
}

// Holds a GroupCommit's writer inside write() until Release(), so that a
// test can queue items behind a write that does not end (a hung database).
class WriteGate {
 public:
  // Call from write(): tells Entered() and waits for Release().
  void Pass() {
    std::unique_lock<std::mutex> lock(mu_);
    ++entered_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
  }
  // Waits until `n` writes have entered.
  void Entered(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return entered_ >= n; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int entered_ = 0;
  bool released_ = false;
};

// What a test's items got: each item's answers, and the items written.
struct Answers {
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, std::vector<absl::StatusCode>> codes;
  std::vector<int> written;

  GroupCommit<int, int>::Done For(int item) {
    return [this, item](absl::StatusOr<int> r) {
      std::lock_guard<std::mutex> lock(mu);
      codes[item].push_back(r.status().code());
      cv.notify_all();
    };
  }
  // Waits until `n` items have been answered.
  void Await(size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return codes.size() >= n; });
  }
  absl::StatusCode Code(int item) {
    std::lock_guard<std::mutex> lock(mu);
    return codes[item].empty() ? absl::StatusCode::kUnknown
                               : codes[item].front();
  }
};

// A hung write and a full queue: the next caller is told at once, nothing
// of it is written, and what was queued is written once the write ends.
TEST(GroupCommit, AFullQueueRefusesAtOnce) {
  WriteGate gate;
  Answers answers;
  {
    GroupCommit<int, int> commit(
        {.writers = 1, .max_group = 2, .max_queued = 3},
        [&](const std::vector<const int*>& items) {
          gate.Pass();
          std::lock_guard<std::mutex> lock(answers.mu);
          for (const int* i : items) answers.written.push_back(*i);
          return std::vector<absl::StatusOr<int>>(items.size(), 0);
        });
    commit.SubmitAsync(1, answers.For(1));
    gate.Entered(1);  // 1 is being written; the write hangs
    for (int i = 2; i <= 4; ++i) commit.SubmitAsync(i, answers.For(i));
    commit.SubmitAsync(5, answers.For(5));
    // Answered before SubmitAsync returned, on this thread.
    EXPECT_EQ(answers.Code(5), absl::StatusCode::kResourceExhausted);
    gate.Release();
    answers.Await(5);
  }
  for (int i = 1; i <= 4; ++i)
    EXPECT_EQ(answers.Code(i), absl::StatusCode::kOk);
  std::sort(answers.written.begin(), answers.written.end());
  EXPECT_EQ(answers.written, (std::vector<int>{1, 2, 3, 4}));
}

// Items whose callers stopped waiting while a write hung are dropped from
// their group, answered, and never written; the others are written.
TEST(GroupCommit, ItemsNobodyWaitsForAreAnsweredAndNeverWritten) {
  WriteGate gate;
  Answers answers;
  std::atomic<bool> cancelled{false};
  {
    GroupCommit<int, int> commit({.writers = 1, .max_group = 8},
                                 [&](const std::vector<const int*>& items) {
                                   if (*items[0] == 1) gate.Pass();
                                   std::lock_guard<std::mutex> lock(answers.mu);
                                   for (const int* i : items)
                                     answers.written.push_back(*i);
                                   return std::vector<absl::StatusOr<int>>(
                                       items.size(), 0);
                                 });
    commit.SubmitAsync(1, answers.For(1));
    gate.Entered(1);
    commit.SubmitAsync(2, answers.For(2),
                       {.deadline = absl::Now() - absl::Seconds(1)});
    commit.SubmitAsync(3, answers.For(3),
                       {.cancelled = [&] { return cancelled.load(); }});
    commit.SubmitAsync(4, answers.For(4),
                       {.deadline = absl::Now() + absl::Hours(1)});
    cancelled = true;  // 3's caller goes away while 1's write hangs
    gate.Release();
    answers.Await(4);
  }
  EXPECT_EQ(answers.Code(1), absl::StatusCode::kOk);
  EXPECT_EQ(answers.Code(2), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(answers.Code(3), absl::StatusCode::kCancelled);
  EXPECT_EQ(answers.Code(4), absl::StatusCode::kOk);
  EXPECT_EQ(answers.written, (std::vector<int>{1, 4}));
}

// A full queue first drops what nobody waits for: a new caller is queued,
// not refused, when the queue is full of abandoned items.
TEST(GroupCommit, AFullQueueMakesRoomByDroppingAbandonedItems) {
  WriteGate gate;
  Answers answers;
  std::atomic<bool> gone{false};
  {
    GroupCommit<int, int> commit(
        {.writers = 1, .max_group = 8, .max_queued = 2},
        [&](const std::vector<const int*>& items) {
          if (*items[0] == 1) gate.Pass();
          std::lock_guard<std::mutex> lock(answers.mu);
          for (const int* i : items) answers.written.push_back(*i);
          return std::vector<absl::StatusOr<int>>(items.size(), 0);
        });
    commit.SubmitAsync(1, answers.For(1));
    gate.Entered(1);
    auto abandoned = [&] { return gone.load(); };
    commit.SubmitAsync(2, answers.For(2), {.cancelled = abandoned});
    commit.SubmitAsync(3, answers.For(3), {.cancelled = abandoned});
    gone = true;
    commit.SubmitAsync(4, answers.For(4));
    answers.Await(2);  // 2 and 3, while 1's write still hangs
    EXPECT_EQ(answers.Code(2), absl::StatusCode::kCancelled);
    EXPECT_EQ(answers.Code(3), absl::StatusCode::kCancelled);
    gate.Release();
    answers.Await(4);
  }
  EXPECT_EQ(answers.Code(4), absl::StatusCode::kOk);
  EXPECT_EQ(answers.written, (std::vector<int>{1, 4}));
}

// Many callers, some of whom go away: every item is answered exactly once,
// and an item is written if and only if it was answered with its result.
TEST(GroupCommit, EveryItemIsAnsweredOnceAndWrittenOnlyIfAnsweredSo) {
  Answers answers;
  std::atomic<int> writes{0};
  {
    GroupCommit<int, int> commit(
        {.writers = 2, .max_group = 8, .max_queued = 16},
        [&](const std::vector<const int*>& items) {
          ++writes;
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          std::lock_guard<std::mutex> lock(answers.mu);
          for (const int* i : items) answers.written.push_back(*i);
          return std::vector<absl::StatusOr<int>>(items.size(), 0);
        });
    std::vector<std::thread> callers;
    for (int t = 0; t < 8; ++t) {
      callers.emplace_back([&, t] {
        for (int k = 0; k < 100; ++k) {
          const int item = t * 1000 + k;
          // Every third caller has gone away by the time it is looked at.
          Waiter w;
          if (item % 3 == 0) w.cancelled = [] { return true; };
          commit.SubmitAsync(item, answers.For(item), std::move(w));
        }
      });
    }
    for (auto& c : callers) c.join();
    answers.Await(800);
  }
  std::set<int> written(answers.written.begin(), answers.written.end());
  EXPECT_EQ(written.size(), answers.written.size());  // none twice
  int ok = 0, refused = 0, dropped = 0;
  for (const auto& [item, codes] : answers.codes) {
    ASSERT_EQ(codes.size(), 1u) << "item " << item;
    switch (codes[0]) {
      case absl::StatusCode::kOk:
        ++ok;
        EXPECT_EQ(written.count(item), 1u) << "item " << item;
        break;
      case absl::StatusCode::kResourceExhausted:
        ++refused;
        EXPECT_EQ(written.count(item), 0u) << "item " << item;
        break;
      case absl::StatusCode::kCancelled:
        ++dropped;
        EXPECT_EQ(item % 3, 0) << "item " << item;
        EXPECT_EQ(written.count(item), 0u) << "item " << item;
        break;
      default:
        ADD_FAILURE() << "item " << item << ": " << codes[0];
    }
  }
  EXPECT_EQ(ok + refused + dropped, 800);
  EXPECT_EQ(static_cast<size_t>(ok), written.size());
  EXPECT_GT(writes, 0);
}

// Stopping with a write hung and items queued: once the write ends, the
// items still wanted are written, the others dropped, and every caller is
// answered before the destructor returns.
TEST(GroupCommit, StoppingAnswersEveryCallerAndWritesOnlyWhatIsWanted) {
  WriteGate gate;
  Answers answers;
  std::atomic<bool> gone{false};
  std::thread stopper;
  {
    auto commit = std::make_unique<GroupCommit<int, int>>(
        GroupCommitOptions{.writers = 1, .max_group = 4, .max_queued = 100},
        [&](const std::vector<const int*>& items) {
          if (*items[0] == 0) gate.Pass();
          std::lock_guard<std::mutex> lock(answers.mu);
          for (const int* i : items) answers.written.push_back(*i);
          return std::vector<absl::StatusOr<int>>(items.size(), 0);
        });
    commit->SubmitAsync(0, answers.For(0));
    gate.Entered(1);
    for (int i = 1; i < 40; ++i) {
      Waiter w;
      if (i % 2 == 0) w.cancelled = [&] { return gone.load(); };
      commit->SubmitAsync(i, answers.For(i), std::move(w));
    }
    gone = true;
    stopper = std::thread([&] { commit.reset(); });
    gate.Release();
    stopper.join();
  }
  ASSERT_EQ(answers.codes.size(), 40u);
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(answers.Code(i), i > 0 && i % 2 == 0
                                   ? absl::StatusCode::kCancelled
                                   : absl::StatusCode::kOk)
        << "item " << i;
  }
  std::sort(answers.written.begin(), answers.written.end());
  std::vector<int> expected = {0};
  for (int i = 1; i < 40; i += 2) expected.push_back(i);
  EXPECT_EQ(answers.written, expected);
}

// An unknown name in OUTBOX_FAULT (a typo, a renamed point, another
// binary's point) stops the binary at start-up instead of arming nothing.
TEST(Fault, UnknownCrashPointsAreRefused) {
  const char* before = std::getenv("OUTBOX_FAULT");
  const std::string saved = before ? before : "";
  unsetenv("OUTBOX_FAULT");
  EXPECT_TRUE(CheckCrashPoints(kRelayCrashPoints).ok());
  setenv("OUTBOX_FAULT",
         "relay.after_claim_before_send:0.1,relay.after_mark_commit:1", 1);
  EXPECT_TRUE(CheckCrashPoints(kRelayCrashPoints).ok());
  setenv("OUTBOX_FAULT", "relay.after_claim_befor_send:0.1", 1);
  absl::Status s = CheckCrashPoints(kRelayCrashPoints);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("relay.after_claim_befor_send"), std::string::npos)
      << s;
  setenv("OUTBOX_FAULT", "consumer.before_commit:0.1", 1);
  EXPECT_FALSE(CheckCrashPoints(kRelayCrashPoints).ok());
  EXPECT_TRUE(CheckCrashPoints(kConsumerCrashPoints).ok());
  setenv("OUTBOX_FAULT", "consumer.before_commit:2", 1);
  EXPECT_FALSE(CheckCrashPoints(kConsumerCrashPoints).ok());
  if (before) {
    setenv("OUTBOX_FAULT", saved.c_str(), 1);
  } else {
    unsetenv("OUTBOX_FAULT");
  }
}

// The lists are what the code passes: every MaybeCrash("...") in the
// sources names a listed point of its binary, and every listed point is
// passed somewhere, so a renamed point cannot disarm a test silently.
TEST(Fault, TheListedCrashPointsAreTheOnesInTheCode) {
  std::set<std::string> in_code;
  const std::regex call(R"re(MaybeCrash\("([a-z_.]+)"\))re");
  for (const char* dir : {"producer", "relay", "inbox", "consumer", "writer"}) {
    for (const auto& entry : std::filesystem::directory_iterator(
             std::filesystem::path(OUTBOX_SOURCE_DIR) / dir)) {
      if (entry.path().extension() != ".cc") continue;
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      const std::string src = text.str();
      for (std::sregex_iterator it(src.begin(), src.end(), call), end;
           it != end; ++it) {
        in_code.insert((*it)[1].str());
      }
    }
  }
  std::set<std::string> listed;
  for (const auto* list :
       {&kProducerCrashPoints, &kRelayCrashPoints, &kConsumerCrashPoints}) {
    for (const char* p : *list) listed.insert(p);
  }
  EXPECT_EQ(in_code, listed);
}

}  // namespace
}  // namespace outbox
