#pragma once
// Transport security from files: gRPC server and channel credentials for
// TLS and mutual TLS, re-read when the files change (a rotated certificate
// needs no restart), or plaintext when no file is named (loopback
// development). Peer identities are checked by CallerCheck (identity.h).

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"

namespace outbox {

// How often the files are read again for a rotated certificate.
inline constexpr unsigned kTlsRefreshSeconds = 5;

struct ServerTlsFiles {
  std::string cert;       // PEM certificate chain; empty: plaintext
  std::string key;        // PEM private key of `cert`
  std::string client_ca;  // PEM CA bundle; set: clients need a certificate
  bool tls() const { return !cert.empty(); }
  bool mutual() const { return !client_ca.empty(); }
};

struct ClientTlsFiles {
  std::string ca;    // PEM CA bundle the server's certificate must chain to
  std::string cert;  // PEM client certificate chain, for mutual TLS
  std::string key;   // its private key
  bool tls() const { return !ca.empty(); }
};

// The flag names a binary uses for ClientTlsFiles, for error messages.
struct ClientTlsFlags {
  const char* ca;
  const char* cert;
  const char* key;
};

// OK if the files make sense together and each is readable PEM;
// InvalidArgument naming the flag otherwise.
absl::Status CheckServerTls(const ServerTlsFiles& files);
absl::Status CheckClientTls(const ClientTlsFiles& files,
                            const ClientTlsFlags& flags);

// Insecure credentials when `files` name no certificate.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const ServerTlsFiles& files);
// Verifies the server's certificate against `files.ca` and its name
// against the target's host; presents `files.cert` when set. Insecure
// credentials when `files` name no CA.
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(
    const ClientTlsFiles& files);

}  // namespace outbox
