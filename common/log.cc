#include "common/log.h"

#include <grpc/support/log.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace outbox {

std::string JsonEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  return out;
}

namespace {

thread_local const EventLogFields* current_event = nullptr;

void Append(spdlog::memory_buf_t& dest, const std::string& s) {
  dest.append(s.data(), s.data() + s.size());
}

// %& in the JSON pattern: the fields of the event in scope, if any.
class JsonEventFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const EventLogFields* f = current_event;
    if (f == nullptr) return;
    Append(dest,
           absl::StrCat(",\"event_id\":\"", JsonEscape(f->event_id),
                        "\",\"aggregate_id\":\"", JsonEscape(f->aggregate_id),
                        "\",\"seq\":", f->seq));
    if (!f->trace_id.empty()) {
      Append(dest, absl::StrCat(",\"trace_id\":\"", f->trace_id, "\""));
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonEventFlag>();
  }
};

// %& in the text pattern: the same as key=value pairs.
class TextEventFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const EventLogFields* f = current_event;
    if (f == nullptr) return;
    Append(dest, absl::StrCat(" [event_id=", f->event_id, " aggregate_id=",
                              f->aggregate_id, " seq=", f->seq));
    if (!f->trace_id.empty()) Append(dest, " trace_id=" + f->trace_id);
    Append(dest, "]");
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<TextEventFlag>();
  }
};

// %* in the JSON pattern: the message, escaped for a JSON string.
class JsonMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    std::string escaped =
        JsonEscape(std::string(msg.payload.data(), msg.payload.size()));
    dest.append(escaped.data(), escaped.data() + escaped.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

// gRPC core's own lines (a failed TLS handshake of a port scanner, say)
// through the same logger and format. What gRPC calls an error is rarely
// ours: a warning.
void GrpcLog(gpr_log_func_args* args) {
  switch (args->severity) {
    case GPR_LOG_SEVERITY_DEBUG:
      spdlog::debug("grpc: {}", args->message);
      break;
    case GPR_LOG_SEVERITY_INFO:
      spdlog::info("grpc: {}", args->message);
      break;
    default:
      spdlog::warn("grpc: {}", args->message);
  }
}

}  // namespace

std::string TraceIdOf(const std::string& traceparent) {
  // One definition of a valid traceparent: what the producer stores is
  // exactly what the logs carry.
  return IsTraceParent(traceparent) ? traceparent.substr(3, 32) : "";
}

EventLogFields FieldsOf(const v1::Event& event) {
  return {event.event_id(), event.aggregate_id(), event.seq(),
          TraceIdOf(event.trace_parent()), event.aggregate_type()};
}

LogEventScope::LogEventScope(EventLogFields fields)
    : previous_(current_event), fields_(std::move(fields)) {
  current_event = &fields_;
}

LogEventScope::~LogEventScope() { current_event = previous_; }

absl::Status InitLogging(const std::string& format, const std::string& level) {
  spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level: \"", level,
                     "\" is not one of trace, debug, info, warn, error, off"));
  }
  spdlog::drop("outbox");
  auto logger = spdlog::stderr_logger_mt("outbox");
  spdlog::set_default_logger(logger);
  spdlog::set_level(lvl);
  if (format == "text") {
    auto formatter = std::make_unique<spdlog::pattern_formatter>(
        spdlog::pattern_time_type::utc);
    formatter->add_flag<TextEventFlag>('&').set_pattern(
        "%Y-%m-%dT%H:%M:%S.%eZ %^%-5l%$ %v%&");
    spdlog::set_formatter(std::move(formatter));
  } else if (format == "json") {
    auto formatter = std::make_unique<spdlog::pattern_formatter>(
        spdlog::pattern_time_type::utc);
    formatter->add_flag<JsonMessageFlag>('*')
        .add_flag<JsonEventFlag>('&')
        .set_pattern(
            R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","pid":%P,"msg":"%*"%&})");
    spdlog::set_formatter(std::move(formatter));
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log_format: \"", format, "\" is not one of text, json"));
  }
  spdlog::flush_on(spdlog::level::info);
  gpr_set_log_function(GrpcLog);
  return absl::OkStatus();
}

}  // namespace outbox
