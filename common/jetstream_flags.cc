#include "common/jetstream_flags.h"

#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/jetstream_subject.h"

ABSL_FLAG(std::string, jetstream, "",
          "Comma-separated NATS server URLs (nats:// or tls://) of a "
          "JetStream cluster; empty: no JetStream.");
ABSL_FLAG(std::string, jetstream_stream, "",
          "The JetStream stream; empty: OUTBOX_<SUBSCRIPTION>.");
ABSL_FLAG(std::string, jetstream_subjects, "",
          "The subject prefix of the events (<prefix>.<aggregate type>."
          "<aggregate id>); empty: outbox.<subscription>.");
ABSL_FLAG(std::string, jetstream_creds, "",
          "A NATS .creds file (user JWT and NKey seed).");
ABSL_FLAG(std::string, jetstream_user, "", "NATS user name.");
ABSL_FLAG(std::string, jetstream_password, "",
          "NATS password of --jetstream_user (better from "
          "OUTBOX_JETSTREAM_PASSWORD).");
ABSL_FLAG(std::string, jetstream_token, "",
          "NATS token (better from OUTBOX_JETSTREAM_TOKEN).");
ABSL_FLAG(std::string, jetstream_ca, "",
          "PEM CA bundle that verifies the NATS servers: TLS.");
ABSL_FLAG(std::string, jetstream_cert, "",
          "PEM client certificate for NATS (with --jetstream_key).");
ABSL_FLAG(std::string, jetstream_key, "",
          "PEM private key of --jetstream_cert.");

namespace outbox {
namespace {

absl::Status Readable(const std::string& path, absl::string_view flag) {
  if (path.empty() || access(path.c_str(), R_OK) == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": cannot read ", path));
}

}  // namespace

std::string DefaultStreamFor(absl::string_view subscription) {
  std::string out =
      absl::StrCat("OUTBOX_", absl::AsciiStrToUpper(subscription));
  for (char& c : out) {
    if (c == '-') c = '_';
  }
  return out;
}

absl::StatusOr<JetStreamFlags> JetStreamFromFlags(
    absl::string_view client_name, absl::string_view default_stream,
    absl::string_view default_subjects) {
  JetStreamFlags out;
  const std::string servers = absl::GetFlag(FLAGS_jetstream);
  out.stream = absl::GetFlag(FLAGS_jetstream_stream);
  if (out.stream.empty()) out.stream = std::string(default_stream);
  out.subjects = absl::GetFlag(FLAGS_jetstream_subjects);
  if (out.subjects.empty()) out.subjects = std::string(default_subjects);
  if (servers.empty()) return out;
  out.enabled = true;
  jetstream::ConnectOptions& c = out.connect;
  c.name = std::string(client_name);
  for (absl::string_view url :
       absl::StrSplit(servers, ',', absl::SkipWhitespace())) {
    url = absl::StripAsciiWhitespace(url);
    if (!absl::StartsWith(url, "nats://") && !absl::StartsWith(url, "tls://")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--jetstream: \"", url, "\" is not a nats:// or tls:// URL"));
    }
    c.servers.emplace_back(url);
  }
  if (c.servers.empty()) {
    return absl::InvalidArgumentError("--jetstream: no server URL");
  }
  if (!jetstream::IsValidPrefix(out.subjects)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--jetstream_subjects: \"", out.subjects,
                     "\" is not dot-separated tokens of A-Z a-z 0-9 - _"));
  }
  // A stream's name also names its directory in the broker's file store.
  if (!jetstream::IsValidName(out.stream) ||
      out.stream.find_first_of("/\\") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--jetstream_stream: \"", out.stream,
                     "\" must be non-empty, without . * > / \\ or whitespace"));
  }
  c.creds_file = absl::GetFlag(FLAGS_jetstream_creds);
  c.user = absl::GetFlag(FLAGS_jetstream_user);
  c.password = absl::GetFlag(FLAGS_jetstream_password);
  c.token = absl::GetFlag(FLAGS_jetstream_token);
  const int kinds = !c.creds_file.empty() + !c.user.empty() + !c.token.empty();
  if (kinds > 1) {
    return absl::InvalidArgumentError(
        "--jetstream_creds, --jetstream_user and --jetstream_token: give at "
        "most one kind of credentials");
  }
  if (!c.password.empty() && c.user.empty()) {
    return absl::InvalidArgumentError(
        "--jetstream_password needs --jetstream_user");
  }
  c.ca_file = absl::GetFlag(FLAGS_jetstream_ca);
  c.cert_file = absl::GetFlag(FLAGS_jetstream_cert);
  c.key_file = absl::GetFlag(FLAGS_jetstream_key);
  if (c.cert_file.empty() != c.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--jetstream_cert and --jetstream_key go together");
  }
  for (const auto& [path, flag] : {std::pair{c.creds_file, "jetstream_creds"},
                                   std::pair{c.ca_file, "jetstream_ca"},
                                   std::pair{c.cert_file, "jetstream_cert"},
                                   std::pair{c.key_file, "jetstream_key"}}) {
    if (absl::Status s = Readable(path, flag); !s.ok()) return s;
  }
  return out;
}

}  // namespace outbox
