#pragma once
// Who may call what: the identity a client's certificate presents and the
// rule that admits it, in one place for every server. The rules are pure
// (AccessRules::Decide, unit-tested); CallerCheck applies them to a gRPC
// call's auth context and logs each refusal with the identity presented.
//
// A certificate's identity is its URI SANs (e.g. spiffe://outbox/relay);
// failing those its DNS SANs; failing both, its subject CN only where the
// server allows it (--tls_cn_identity): any CA that signs for a name may
// put any string in a CN, and a certificate without SAN is rarely meant as
// an identity. A caller is admitted when any of its identities is listed.
//
// Example (in a service method):
//   if (grpc::Status s = Admit(check_, ctx, Access::kAdmin, "Requeue");
//       !s.ok()) return s;

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace outbox {

// What a peer's certificate says about it.
struct PeerCertificate {
  std::vector<std::string> uri_sans;
  std::vector<std::string> dns_sans;
  std::string common_name;
};

// The identities `cert` presents, by the precedence above (empty if none);
// its CN counts only with `common_name_counts` and no SAN.
std::vector<std::string> IdentitiesOf(const PeerCertificate& cert,
                                      bool common_name_counts);

// The certificate gRPC verified for the call's peer; nothing for a
// plaintext peer or a TLS peer that sent no certificate.
std::optional<PeerCertificate> PeerCertificateOf(const grpc::AuthContext& auth);

enum class Access {
  kCall,     // any method of the service's API, reads included
  kDeliver,  // EventSink.Deliver: effects and cursors follow what it sends
  kAdmin,    // a method that changes state behind the pipeline's back (requeue)
};

struct AccessRules {
  // Mutual TLS is on: every caller must present a certificate from the
  // client CA (gRPC enforces it in the handshake; Decide checks it again).
  bool require_identity = false;
  // TLS is on, with or without client certificates. Without them
  // (--tls_no_client_auth) kCall is admitted and kDeliver and kAdmin are
  // refused: what a delivery or an admin call changes must never come from
  // a caller nobody authenticated.
  bool tls = false;
  // A certificate without any SAN is known by its subject CN.
  bool common_name_identity = false;
  // Identities admitted for kCall; empty admits every verified client.
  // Identities in `admin` are admitted for kCall too.
  std::set<std::string> allowed;
  // Identities admitted for kAdmin. Empty refuses kAdmin to everyone when
  // identities are required.
  std::set<std::string> admin;
  // Identities admitted for kDeliver; empty: as for kCall. Lets the
  // consumer admit operators to its query API but only the relay to
  // Deliver.
  std::set<std::string> delivery;

  // OK, or PermissionDenied / Unauthenticated naming the identity presented
  // and the flag that would admit it. In plaintext (loopback development)
  // everything is admitted; under TLS without client certificates, kCall
  // only.
  absl::Status Decide(const std::optional<PeerCertificate>& peer,
                      Access access) const;
};

// Parses "a,b , c" into {"a", "b", "c"}.
std::set<std::string> ParseIdentityList(const std::string& list);

// Applies AccessRules to gRPC calls. Thread-safe.
class CallerCheck {
 public:
  explicit CallerCheck(AccessRules rules);

  // OK if the caller of `ctx` may make a call needing `access`; otherwise
  // the status to answer, and a log line naming `method`, the peer address
  // and the identity presented (at most a few lines a second).
  grpc::Status Admit(const grpc::ServerContextBase& ctx, Access access,
                     const char* method) const;

  const AccessRules& rules() const { return rules_; }

 private:
  const AccessRules rules_;
  mutable std::atomic<int64_t> last_log_second_{0};
  mutable std::atomic<int> logged_this_second_{0};
};

// Admit through `check`, or admit everything when `check` is null (a
// service built without one, as in tests of the logic).
inline grpc::Status Admit(const CallerCheck* check,
                          const grpc::ServerContextBase* ctx, Access access,
                          const char* method) {
  return check == nullptr ? grpc::Status::OK
                          : check->Admit(*ctx, access, method);
}

// Who is calling, for the record: the identity of the caller's certificate
// by `check`'s rules (its first), else "unauthenticated <peer address>".
std::string CallerName(const CallerCheck* check,
                       const grpc::ServerContextBase& ctx);

}  // namespace outbox
