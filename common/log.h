#pragma once
// Logging set-up: spdlog's default logger writes to stderr as text or as one
// JSON object a line (for log collectors).

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "outbox/v1/event.pb.h"

namespace outbox {

// The event a log line is about.
struct EventLogFields {
  std::string event_id;
  std::string aggregate_id;
  int64_t seq = 0;
  std::string trace_id;  // from the event's W3C traceparent; "" if none
  std::string aggregate_type;
};

EventLogFields FieldsOf(const v1::Event& event);

// The trace id of `traceparent` if IsTraceParent (common/ids.h) accepts it,
// else "".
std::string TraceIdOf(const std::string& traceparent);

// While one lives, every line this thread logs carries `fields`: as JSON
// fields (event_id, aggregate_id, seq, trace_id) with --log_format=json,
// as key=value after the message in text. Scopes nest; the inner wins.
class LogEventScope {
 public:
  explicit LogEventScope(EventLogFields fields);
  ~LogEventScope();
  LogEventScope(const LogEventScope&) = delete;
  LogEventScope& operator=(const LogEventScope&) = delete;

 private:
  const EventLogFields* previous_;
  EventLogFields fields_;
};

// format: "text" or "json"; level: trace, debug, info, warn or error.
absl::Status InitLogging(const std::string& format, const std::string& level);

// `s` escaped for use inside a JSON string literal.
std::string JsonEscape(const std::string& s);

}  // namespace outbox
