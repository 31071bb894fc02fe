#include "common/log.h"

#include <grpc/support/log.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"

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
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %^%-5l%$ %v",
                        spdlog::pattern_time_type::utc);
  } else if (format == "json") {
    auto formatter = std::make_unique<spdlog::pattern_formatter>(
        spdlog::pattern_time_type::utc);
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","pid":%P,"msg":"%*"})");
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
