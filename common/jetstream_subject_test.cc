#include "common/jetstream_subject.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace outbox::jetstream {
namespace {

// What nats-server accepts as a token of a subject to publish to.
bool IsNatsToken(const std::string& token) {
  if (token.empty()) return false;
  for (char c : token) {
    if (c == '.' || c == '*' || c == '>' || c == ' ' || c == '\t' ||
        c == '\r' || c == '\n' || c == '\0') {
      return false;
    }
  }
  return true;
}

TEST(EscapeToken, LeavesPlainIdsAlone) {
  EXPECT_EQ(EscapeToken("order"), "order");
  EXPECT_EQ(EscapeToken("o-1_A"), "o-1_A");
  EXPECT_EQ(EscapeToken("550e8400-e29b-41d4-a716-446655440000"),
            "550e8400-e29b-41d4-a716-446655440000");
}

TEST(EscapeToken, EscapesWhatSubjectsForbidAndTheEscapeItself) {
  EXPECT_EQ(EscapeToken("a.b"), "a~2Eb");
  EXPECT_EQ(EscapeToken("*"), "~2A");
  EXPECT_EQ(EscapeToken(">"), "~3E");
  EXPECT_EQ(EscapeToken("a b\tc"), "a~20b~09c");
  EXPECT_EQ(EscapeToken("~"), "~7E");
  EXPECT_EQ(EscapeToken("$SYS"), "~24SYS");
  EXPECT_EQ(EscapeToken(std::string("\0\xff", 2)), "~00~FF");
  EXPECT_EQ(EscapeToken("é"), "~C3~A9");
}

TEST(EscapeToken, EmptyIsALoneTilde) {
  EXPECT_EQ(EscapeToken(""), "~");
  EXPECT_NE(EscapeToken(""), EscapeToken("~"));
}

TEST(EscapeToken, EveryResultIsOneValidToken) {
  std::vector<std::string> inputs = {"",  ".", "..", "a.", ".a",  "*",
                                     ">", " ", "~",  "~~", "~2E", "\n"};
  for (int b = 0; b < 256; ++b) inputs.push_back(std::string(1, char(b)));
  for (const std::string& in : inputs) {
    const std::string token = EscapeToken(in);
    EXPECT_TRUE(IsNatsToken(token)) << "for input of size " << in.size();
  }
}

TEST(EscapeToken, RoundTripsEveryByteAndTrickyStrings) {
  std::vector<std::string> inputs = {"",    "~",     "~7E", "~~",  "a~", "~a",
                                     "a.b", "a~2Eb", "x y", ">*.", "ab"};
  for (int b = 0; b < 256; ++b) {
    inputs.push_back(std::string(1, char(b)));
    inputs.push_back(std::string("k") + char(b) + "~");
  }
  for (const std::string& in : inputs) {
    auto back = UnescapeToken(EscapeToken(in));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, in);
  }
}

// Injective: distinct inputs, distinct tokens (here all strings of up to
// three bytes from an alphabet that mixes plain, forbidden and escape
// characters, 2,000 of them).
TEST(EscapeToken, DistinctInputsGiveDistinctTokens) {
  const std::string alphabet = {'a', 'A', '0', '-', '_', '.',
                                '*', '>', ' ', '~', '2', 'E'};
  std::vector<std::string> inputs = {""};
  for (int len = 1; len <= 3; ++len) {
    std::vector<std::string> next;
    for (const std::string& s : inputs) {
      if (s.size() + 1 != static_cast<size_t>(len)) continue;
      for (char c : alphabet) next.push_back(s + c);
    }
    inputs.insert(inputs.end(), next.begin(), next.end());
  }
  std::set<std::string> tokens;
  for (const std::string& in : inputs) tokens.insert(EscapeToken(in));
  EXPECT_EQ(tokens.size(), inputs.size());
  EXPECT_GT(inputs.size(), 1800u);
}

TEST(UnescapeToken, RefusesWhatEscapingNeverMakes) {
  for (const char* bad :
       {"", "~2", "~2e", "~G0", "a~", "~41", "a.b", "a b", "*", "~~", "~7"}) {
    EXPECT_FALSE(UnescapeToken(bad).ok()) << bad;
  }
}

TEST(EventSubject, PrefixTypeAndIdAsThreeParts) {
  auto subject = EventSubject("outbox.billing", "order", "o-1");
  ASSERT_TRUE(subject.ok()) << subject.status();
  EXPECT_EQ(*subject, "outbox.billing.order.o-1");
  subject = EventSubject("outbox", "order", "a.b *>");
  ASSERT_TRUE(subject.ok());
  EXPECT_EQ(*subject, "outbox.order.a~2Eb~20~2A~3E");
}

// The split into type and id cannot move: ("a.b", "c") and ("a", "b.c")
// would share "p.a.b.c" without escaping.
TEST(EventSubject, TypeAndIdBoundaryIsKept) {
  auto one = EventSubject("p", "a.b", "c");
  auto two = EventSubject("p", "a", "b.c");
  auto three = EventSubject("p", "", "a");
  auto four = EventSubject("p", "a", "");
  ASSERT_TRUE(one.ok() && two.ok() && three.ok() && four.ok());
  EXPECT_NE(*one, *two);
  EXPECT_NE(*three, *four);
  for (const std::string& s : {*one, *two, *three, *four}) {
    std::vector<std::string> tokens = absl::StrSplit(s, '.');
    EXPECT_EQ(tokens.size(), 3u) << s;
    for (const std::string& t : tokens) EXPECT_TRUE(IsNatsToken(t)) << s;
  }
}

TEST(EventSubject, RefusesABadPrefix) {
  for (const char* bad :
       {"", ".", "a.", ".a", "a..b", "a.*", "a.>", "a b", "$JS.API", "a~b"}) {
    EXPECT_FALSE(EventSubject(bad, "order", "1").ok()) << bad;
    EXPECT_FALSE(IsValidPrefix(bad)) << bad;
  }
  EXPECT_TRUE(IsValidPrefix("outbox.billing-v2_x"));
}

TEST(IsValidName, TakesStreamAndDurableNames) {
  for (const char* good :
       {"OUTBOX_BILLING", "outbox-consumer", "a", "$name", "x~y", "a/b",
        "a\\b", "é", "A-Z_a-z_0-9"}) {
    EXPECT_TRUE(IsValidName(good)) << good;
  }
}

TEST(IsValidName, RefusesEachForbiddenCharacter) {
  for (char c : {'.', '*', '>'}) {
    const std::string alone(1, c);
    EXPECT_FALSE(IsValidName(alone)) << alone;
    EXPECT_FALSE(IsValidName("OUTBOX" + alone)) << alone;
    EXPECT_FALSE(IsValidName(alone + "OUTBOX")) << alone;
    EXPECT_FALSE(IsValidName("OUT" + alone + "BOX")) << alone;
  }
}

TEST(IsValidName, RefusesWhitespace) {
  for (char c : {' ', '\t', '\n', '\v', '\f', '\r'}) {
    const std::string ws(1, c);
    EXPECT_FALSE(IsValidName(ws)) << int(c);
    EXPECT_FALSE(IsValidName("OUT" + ws + "BOX")) << int(c);
    EXPECT_FALSE(IsValidName("OUTBOX" + ws)) << int(c);
  }
}

TEST(IsValidName, RefusesEmpty) {
  EXPECT_FALSE(IsValidName(""));
  EXPECT_FALSE(IsValidName(absl::string_view()));
}

TEST(AllEventsUnder, IsTheFullWildcard) {
  EXPECT_EQ(AllEventsUnder("outbox.billing"), "outbox.billing.>");
}

TEST(FilterCovers, WildcardsOnEitherSide) {
  EXPECT_TRUE(FilterCovers("a.>", "a.*.*"));
  EXPECT_TRUE(FilterCovers("a.>", "a.b.>"));
  EXPECT_TRUE(FilterCovers("a.>", "a.>"));
  EXPECT_TRUE(FilterCovers(">", "a.b"));
  EXPECT_TRUE(FilterCovers("*.*.*", "a.b.*"));
  EXPECT_TRUE(FilterCovers("a.*.>", "a.*.*"));
  EXPECT_TRUE(FilterCovers("a.b", "a.b"));
  // Fewer subjects than the pattern's.
  EXPECT_FALSE(FilterCovers("a.*", "a.*.*"));
  EXPECT_FALSE(FilterCovers("a.b.>", "a.*.*"));    // one type only
  EXPECT_FALSE(FilterCovers("a.*.*", "a.>"));      // three tokens only
  EXPECT_FALSE(FilterCovers("a.*.*.>", "a.*.*"));  // four or more
  EXPECT_FALSE(FilterCovers("b.>", "a.*.*"));
  EXPECT_FALSE(FilterCovers("a.>", "a"));        // ">" is one token or more
  EXPECT_FALSE(FilterCovers("a.>.b", "a.x.b"));  // ">" only at the end
  EXPECT_FALSE(FilterCovers("a", "a.b"));
}

TEST(StoresEventsUnder, OneSubjectMustCoverEveryAggregate) {
  EXPECT_TRUE(StoresEventsUnder({"outbox.>"}, "outbox"));
  EXPECT_TRUE(StoresEventsUnder({"x.>", "outbox.*.*"}, "outbox"));
  EXPECT_TRUE(StoresEventsUnder({">"}, "outbox.billing"));
  EXPECT_TRUE(StoresEventsUnder({"outbox.*.>"}, "outbox.billing"));
  EXPECT_FALSE(StoresEventsUnder({}, "outbox"));
  EXPECT_FALSE(StoresEventsUnder({"elsewhere.>"}, "outbox"));
  EXPECT_FALSE(StoresEventsUnder({"outbox.billing.>"}, "outbox"));
  // Types named one by one never cover them all.
  EXPECT_FALSE(
      StoresEventsUnder({"outbox.order.>", "outbox.invoice.>"}, "outbox"));
  EXPECT_FALSE(StoresEventsUnder({"outbox.*"}, "outbox"));
}

}  // namespace
}  // namespace outbox::jetstream
