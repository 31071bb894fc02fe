#include <gtest/gtest.h>

#include <set>
#include <string>

#include "tools/conformance.h"

namespace outbox::tools {
namespace {

ConformanceOptions Valid() {
  ConformanceOptions o;
  o.sink = "127.0.0.1:50053";
  return o;
}

// The message of the options' refusal, "" when they are accepted.
std::string Refusal(const ConformanceOptions& o) {
  absl::Status s = CheckConformanceOptions(o);
  return s.ok() ? "" : std::string(s.message());
}

TEST(CheckConformanceOptions, AcceptsTheDefaultsWithASinkAndEveryCase) {
  ConformanceOptions o = Valid();
  EXPECT_EQ(Refusal(o), "");
  o.cases.insert(ConformanceCases().begin(), ConformanceCases().end());
  o.protocol = 1;
  o.max_batch_events = 1;
  EXPECT_EQ(Refusal(o), "");
}

TEST(CheckConformanceOptions, NamesTheFlagOfEachBadValue) {
  struct {
    const char* flag;
    void (*spoil)(ConformanceOptions*);
  } cases[] = {
      {"--sink", [](ConformanceOptions* o) { o->sink.clear(); }},
      {"--sink", [](ConformanceOptions* o) { o->sink = "nocolon"; }},
      {"--timeout",
       [](ConformanceOptions* o) { o->timeout = absl::ZeroDuration(); }},
      {"--max_batch_events",
       [](ConformanceOptions* o) { o->max_batch_events = 0; }},
      {"--max_batch_events",
       [](ConformanceOptions* o) { o->max_batch_events = 10001; }},
      {"--protocol", [](ConformanceOptions* o) { o->protocol = 3; }},
      {"--aggregate_type",
       [](ConformanceOptions* o) { o->aggregate_type = std::string(65, 'a'); }},
      {"--cases",
       [](ConformanceOptions* o) {
         o->cases = {"duplicates", "x"};
       }},
      {"--wrong_key", [](ConformanceOptions* o) { o->wrong_cert = "c.pem"; }},
      {"--ca",
       [](ConformanceOptions* o) {
         o->wrong_cert = "c.pem";
         o->wrong_key = "k.pem";
       }},
  };
  for (const auto& c : cases) {
    ConformanceOptions o = Valid();
    c.spoil(&o);
    EXPECT_NE(Refusal(o).find(c.flag), std::string::npos)
        << c.flag << ": " << Refusal(o);
  }
}

TEST(ConformanceCases, AreUniqueAndTheUnknownCaseListsThem) {
  const auto& names = ConformanceCases();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(),
            names.size());
  ConformanceOptions o = Valid();
  o.cases = {"nope"};
  for (const std::string& n : names) {
    EXPECT_NE(Refusal(o).find(n), std::string::npos) << n;
  }
}

TEST(ConformanceReport, FailsOnAnyFailureOrAnUnreachableSink) {
  ConformanceReport r;
  r.sink = "h:1";
  r.cases = {{"duplicates", CaseVerdict::kPass, "ok", absl::Seconds(1)},
             {"identity-wrong", CaseVerdict::kSkip, "plaintext", {}}};
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.Summary(), "conformance of h:1: 1 passed, 0 failed, 1 skipped\n");
  r.cases.push_back({"forks", CaseVerdict::kFail, "answered\nAPPLIED", {}});
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.Summary(),
            "conformance of h:1: 1 passed, 1 failed, 1 skipped (failed: "
            "forks)\n");
  EXPECT_EQ(r.cases[2].Line(),
            "FAIL  forks              0.00 s  answered APPLIED");
  ConformanceReport unreachable;
  unreachable.unreachable = "cannot reach the sink";
  EXPECT_FALSE(unreachable.ok());
}

}  // namespace
}  // namespace outbox::tools
