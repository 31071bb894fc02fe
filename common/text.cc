#include "common/text.h"

namespace outbox {

std::optional<Utf8Char> DecodeUtf8(absl::string_view s, size_t i) {
  if (i >= s.size()) return std::nullopt;
  const unsigned char c = static_cast<unsigned char>(s[i]);
  uint32_t cp;
  int len;
  if (c < 0x80) {
    return Utf8Char{c, 1};
  } else if ((c >> 5) == 0x6) {
    cp = c & 0x1f, len = 2;
  } else if ((c >> 4) == 0xe) {
    cp = c & 0x0f, len = 3;
  } else if ((c >> 3) == 0x1e) {
    cp = c & 0x07, len = 4;
  } else {
    return std::nullopt;
  }
  if (i + len > s.size()) return std::nullopt;
  for (int k = 1; k < len; ++k) {
    const unsigned char cc = static_cast<unsigned char>(s[i + k]);
    if ((cc >> 6) != 0x2) return std::nullopt;
    cp = (cp << 6) | (cc & 0x3f);
  }
  static constexpr uint32_t kMinOfLength[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinOfLength[len] || (cp >= 0xd800 && cp <= 0xdfff) ||
      cp > 0x10ffff) {
    return std::nullopt;
  }
  return Utf8Char{cp, len};
}

std::string StorableText(absl::string_view s, size_t max_bytes) {
  static constexpr absl::string_view kReplacement = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(s.size() < max_bytes ? s.size() : max_bytes);
  for (size_t i = 0; i < s.size();) {
    const std::optional<Utf8Char> ch = DecodeUtf8(s, i);
    absl::string_view piece = kReplacement;
    if (ch.has_value() && ch->code_point != 0) {
      piece = s.substr(i, ch->length);
      i += ch->length;
    } else {
      i += 1;
    }
    if (out.size() + piece.size() > max_bytes) break;
    out.append(piece.data(), piece.size());
  }
  return out;
}

}  // namespace outbox
