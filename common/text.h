#pragma once
// Text that came from elsewhere (a consumer's reason, a handler's error, an
// operator's note), made safe to store: PostgreSQL's text takes valid UTF-8
// only, and no NUL byte. A reason it refused would fail the whole
// transaction that records it, again on every retry: one bad answer would
// stop a relay's marks, or a consumer's batch, for good.
//
// Example:
//   tx.exec_params("UPDATE ... SET last_error = $1", StorableText(reason,
//   2000));
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace outbox {

// One UTF-8 character: its code point and its length in bytes.
struct Utf8Char {
  uint32_t code_point;
  int length;
};

// The character that starts at byte `i` of `s`, or nothing when the bytes
// there are not one: a stray continuation byte, a sequence cut short, an
// overlong form, a surrogate, a value above U+10FFFF.
std::optional<Utf8Char> DecodeUtf8(absl::string_view s, size_t i);

// `s` with every byte that does not begin a valid character (and every NUL)
// replaced by U+FFFD, cut at a character boundary to at most `max_bytes`.
std::string StorableText(absl::string_view s, size_t max_bytes);

}  // namespace outbox
