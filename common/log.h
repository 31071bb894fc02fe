#pragma once
// Logging set-up: spdlog's default logger writes to stderr as text or as one
// JSON object a line (for log collectors).

#include <string>

#include "absl/status/status.h"

namespace outbox {

// format: "text" or "json"; level: trace, debug, info, warn or error.
absl::Status InitLogging(const std::string& format, const std::string& level);

// `s` escaped for use inside a JSON string literal.
std::string JsonEscape(const std::string& s);

}  // namespace outbox
