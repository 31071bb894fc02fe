#include "tools/load.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace outbox::tools {
namespace {

TEST(CheckLoadOptions, AcceptsTheDefaultsAndEveryKnownOnly) {
  LoadOptions o;
  EXPECT_TRUE(CheckLoadOptions(o).ok());
  for (const char* only : {"", "create", "pay", "cancel", "get"}) {
    o.only = only;
    EXPECT_TRUE(CheckLoadOptions(o).ok()) << only;
  }
  o.orders = 0;  // nothing to do is a valid load
  o.rate = 0;
  o.connections = 0;
  o.pay_fraction = 1;
  o.cancel_fraction = 0;
  o.duration = absl::ZeroDuration();
  o.max_tries = 1;  // a client that never retries
  o.idempotency_keys = false;
  EXPECT_TRUE(CheckLoadOptions(o).ok());
}

TEST(CheckLoadOptions, NamesTheFlagItRefuses) {
  struct Case {
    std::function<void(LoadOptions&)> spoil;
    std::string flag;
  };
  const double nan = std::nan("");
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Case> cases = {
      {[](LoadOptions& o) { o.orders = -1; }, "--orders"},
      {[](LoadOptions& o) { o.concurrency = 0; }, "--concurrency"},
      {[](LoadOptions& o) { o.concurrency = -3; }, "--concurrency"},
      {[](LoadOptions& o) { o.connections = -1; }, "--connections"},
      {[](LoadOptions& o) { o.pay_fraction = 1.5; }, "--pay_fraction"},
      {[&](LoadOptions& o) { o.pay_fraction = nan; }, "--pay_fraction"},
      {[](LoadOptions& o) { o.cancel_fraction = -0.1; }, "--cancel_fraction"},
      {[](LoadOptions& o) { o.rate = -1; }, "--rate"},
      {[&](LoadOptions& o) { o.rate = nan; }, "--rate"},
      {[&](LoadOptions& o) { o.rate = inf; }, "--rate"},
      {[](LoadOptions& o) { o.call_timeout = absl::ZeroDuration(); },
       "--timeout"},
      {[](LoadOptions& o) { o.duration = absl::Seconds(-1); }, "--duration"},
      {[](LoadOptions& o) { o.only = "refund"; }, "--only"},
      {[](LoadOptions& o) { o.max_tries = 0; }, "--max_tries"},
  };
  for (const Case& c : cases) {
    LoadOptions o;
    c.spoil(o);
    absl::Status s = CheckLoadOptions(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.flag;
    EXPECT_NE(s.message().find(c.flag), std::string::npos)
        << c.flag << ": " << s.message();
  }
}

}  // namespace
}  // namespace outbox::tools
