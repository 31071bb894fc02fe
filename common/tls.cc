#include "common/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace outbox {
namespace {

using grpc::experimental::FileWatcherCertificateProvider;

absl::Status CheckPem(const std::string& path, const char* flag,
                      const char* kind) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read \"", path, "\""));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (!absl::StrContains(text.str(), absl::StrCat("-----BEGIN ", kind)) &&
      !(std::string(kind) == "PRIVATE KEY" &&
        absl::StrContains(text.str(), "PRIVATE KEY-----"))) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": \"", path, "\" holds no PEM ", absl::AsciiStrToLower(kind)));
  }
  return absl::OkStatus();
}

absl::Status Together(const std::string& a, const char* a_flag,
                      const std::string& b, const char* b_flag) {
  if (a.empty() != b.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(a_flag, " and ", b_flag, ": give both or neither"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckServerTls(const ServerTlsFiles& f) {
  if (absl::Status s = Together(f.cert, "--tls_cert", f.key, "--tls_key");
      !s.ok())
    return s;
  if (f.mutual() && !f.tls()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca: needs --tls_cert and --tls_key (mutual TLS is TLS)");
  }
  if (!f.tls()) return absl::OkStatus();
  if (absl::Status s = CheckPem(f.cert, "--tls_cert", "CERTIFICATE"); !s.ok())
    return s;
  if (absl::Status s = CheckPem(f.key, "--tls_key", "PRIVATE KEY"); !s.ok())
    return s;
  if (f.mutual())
    return CheckPem(f.client_ca, "--tls_client_ca", "CERTIFICATE");
  return absl::OkStatus();
}

absl::Status CheckClientTls(const ClientTlsFiles& f,
                            const ClientTlsFlags& flags) {
  if (absl::Status s = Together(f.cert, flags.cert, f.key, flags.key); !s.ok())
    return s;
  if (!f.cert.empty() && !f.tls()) {
    return absl::InvalidArgumentError(absl::StrCat(
        flags.cert, ": needs ", flags.ca, " (the server's CA) as well"));
  }
  if (!f.tls()) return absl::OkStatus();
  if (absl::Status s = CheckPem(f.ca, flags.ca, "CERTIFICATE"); !s.ok())
    return s;
  if (f.cert.empty()) return absl::OkStatus();
  if (absl::Status s = CheckPem(f.cert, flags.cert, "CERTIFICATE"); !s.ok())
    return s;
  return CheckPem(f.key, flags.key, "PRIVATE KEY");
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const ServerTlsFiles& f) {
  if (!f.tls()) return grpc::InsecureServerCredentials();
  auto provider = std::make_shared<FileWatcherCertificateProvider>(
      f.key, f.cert, f.client_ca, kTlsRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (f.mutual()) {
    options.watch_root_certs();
    options.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(
    const ClientTlsFiles& f) {
  if (!f.tls()) return grpc::InsecureChannelCredentials();
  auto provider = f.cert.empty()
                      ? std::make_shared<FileWatcherCertificateProvider>(
                            f.ca, kTlsRefreshSeconds)
                      : std::make_shared<FileWatcherCertificateProvider>(
                            f.key, f.cert, f.ca, kTlsRefreshSeconds);
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  if (!f.cert.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  options.set_certificate_verifier(
      std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  return grpc::experimental::TlsCredentials(options);
}

}  // namespace outbox
