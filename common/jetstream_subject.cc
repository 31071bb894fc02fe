#include "common/jetstream_subject.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace outbox::jetstream {
namespace {

constexpr char kEscape = '~';
constexpr char kHex[] = "0123456789ABCDEF";

bool IsPlain(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
         (c >= '0' && c <= '9') || c == '-' || c == '_';
}

// Upper-case hex only: "~2e" and "~2E" must not both decode to ".", or
// two tokens would name one byte string and decoding would not be the
// inverse of the escaping.
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string EscapeToken(absl::string_view raw) {
  if (raw.empty()) return std::string(1, kEscape);
  std::string out;
  out.reserve(raw.size());
  for (char c : raw) {
    if (IsPlain(c)) {
      out.push_back(c);
      continue;
    }
    const auto byte = static_cast<unsigned char>(c);
    out.push_back(kEscape);
    out.push_back(kHex[byte >> 4]);
    out.push_back(kHex[byte & 0xF]);
  }
  return out;
}

absl::StatusOr<std::string> UnescapeToken(absl::string_view token) {
  if (token == absl::string_view(&kEscape, 1)) return std::string();
  if (token.empty()) {
    return absl::InvalidArgumentError("an empty token is not an escaped one");
  }
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size(); ++i) {
    const char c = token[i];
    if (IsPlain(c)) {
      out.push_back(c);
      continue;
    }
    if (c != kEscape || i + 2 >= token.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("not an escaped token: \"", token, "\""));
    }
    const int hi = HexValue(token[i + 1]), lo = HexValue(token[i + 2]);
    const unsigned char byte = static_cast<unsigned char>(hi * 16 + lo);
    if (hi < 0 || lo < 0 || IsPlain(static_cast<char>(byte))) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad escape in token \"", token, "\""));
    }
    out.push_back(static_cast<char>(byte));
    i += 2;
  }
  return out;
}

bool IsValidPrefix(absl::string_view prefix) {
  if (prefix.empty()) return false;
  for (absl::string_view token : absl::StrSplit(prefix, '.')) {
    if (token.empty()) return false;
    for (char c : token) {
      if (!IsPlain(c)) return false;
    }
  }
  return true;
}

bool IsValidName(absl::string_view name) {
  if (name.empty()) return false;
  for (char c : name) {
    if (c == '.' || c == '*' || c == '>' || absl::ascii_isspace(c)) {
      return false;
    }
  }
  return true;
}

absl::StatusOr<std::string> EventSubject(absl::string_view prefix,
                                         absl::string_view aggregate_type,
                                         absl::string_view aggregate_id) {
  if (!IsValidPrefix(prefix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("subject prefix \"", prefix,
                     "\" must be dot-separated tokens of A-Z a-z 0-9 - _"));
  }
  return absl::StrCat(prefix, ".", EscapeToken(aggregate_type), ".",
                      EscapeToken(aggregate_id));
}

std::string AllEventsUnder(absl::string_view prefix) {
  return absl::StrCat(prefix, ".>");
}

bool FilterCovers(absl::string_view filter, absl::string_view pattern) {
  const std::vector<absl::string_view> f = absl::StrSplit(filter, '.');
  const std::vector<absl::string_view> p = absl::StrSplit(pattern, '.');
  for (size_t i = 0; i < f.size(); ++i) {
    // The rest of the pattern is one token or more, whatever they are.
    if (f[i] == ">") return i + 1 == f.size() && i < p.size();
    if (i >= p.size()) return false;
    // The pattern goes on for any number of tokens; the filter does not.
    if (p[i] == ">") return false;
    if (f[i] != "*" && f[i] != p[i]) return false;  // "*" or another literal
  }
  return f.size() == p.size();
}

bool StoresEventsUnder(const std::vector<std::string>& stream_subjects,
                       absl::string_view prefix) {
  const std::string events = absl::StrCat(prefix, ".*.*");
  for (const std::string& s : stream_subjects) {
    if (FilterCovers(s, events)) return true;
  }
  return false;
}

}  // namespace outbox::jetstream
