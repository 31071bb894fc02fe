#include "common/identity.h"

#include <grpc/grpc_security_constants.h>
#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace outbox {
namespace {

std::vector<std::string> Values(const grpc::AuthContext& auth,
                                const char* property) {
  std::vector<std::string> out;
  for (const grpc::string_ref& v : auth.FindPropertyValues(property)) {
    out.emplace_back(v.data(), v.size());
  }
  return out;
}

std::string Presented(const std::optional<PeerCertificate>& peer,
                      bool common_name_counts) {
  if (!peer.has_value()) return "no client certificate";
  std::vector<std::string> ids = IdentitiesOf(*peer, common_name_counts);
  if (!ids.empty()) return absl::StrCat("identity ", absl::StrJoin(ids, ", "));
  if (peer->common_name.empty()) {
    return "a certificate without URI SAN, DNS SAN or CN";
  }
  return absl::StrCat("a certificate without URI or DNS SAN (its CN \"",
                      peer->common_name,
                      "\" is no identity here without --tls_cn_identity)");
}

}  // namespace

std::vector<std::string> IdentitiesOf(const PeerCertificate& cert,
                                      bool common_name_counts) {
  if (!cert.uri_sans.empty()) return cert.uri_sans;
  if (!cert.dns_sans.empty()) return cert.dns_sans;
  if (common_name_counts && !cert.common_name.empty()) {
    return {cert.common_name};
  }
  return {};
}

std::optional<PeerCertificate> PeerCertificateOf(
    const grpc::AuthContext& auth) {
  if (!auth.IsPeerAuthenticated()) return std::nullopt;
  PeerCertificate cert;
  cert.uri_sans = Values(auth, GRPC_PEER_URI_PROPERTY_NAME);
  cert.dns_sans = Values(auth, GRPC_PEER_DNS_PROPERTY_NAME);
  std::vector<std::string> cn = Values(auth, GRPC_X509_CN_PROPERTY_NAME);
  if (!cn.empty()) cert.common_name = cn[0];
  return cert;
}

absl::Status AccessRules::Decide(const std::optional<PeerCertificate>& peer,
                                 Access access) const {
  if (!require_identity) {
    if (!tls || access == Access::kCall) return absl::OkStatus();
    return absl::UnauthenticatedError(absl::StrCat(
        access == Access::kDeliver ? "delivering events"
                                   : "this call changes state and",
        " needs an authenticated client, and this server serves TLS without "
        "client certificates (--tls_no_client_auth); give it "
        "--tls_client_ca"));
  }
  if (!peer.has_value()) {
    return absl::UnauthenticatedError(
        "a client certificate from the server's client CA is required");
  }
  const std::vector<std::string> ids = IdentitiesOf(*peer, common_name_identity);
  auto listed = [&](const std::set<std::string>& set) {
    for (const std::string& id : ids) {
      if (set.count(id)) return true;
    }
    return false;
  };
  if (access == Access::kDeliver && !delivery.empty()) {
    if (listed(delivery)) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        "only identities in --delivery_clients may deliver events; the "
        "caller presented ",
        Presented(peer, common_name_identity)));
  }
  if (access == Access::kAdmin) {
    if (listed(admin)) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        "this call changes state and needs an identity in --admin_clients; "
        "the caller presented ",
        Presented(peer, common_name_identity)));
  }
  if (allowed.empty() || listed(allowed) || listed(admin)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat("the caller presented ", Presented(peer, common_name_identity),
                   ", which is not in --allowed_clients"));
}

std::set<std::string> ParseIdentityList(const std::string& list) {
  std::set<std::string> out;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (!part.empty()) out.emplace(part);
  }
  return out;
}

CallerCheck::CallerCheck(AccessRules rules) : rules_(std::move(rules)) {}

grpc::Status CallerCheck::Admit(const grpc::ServerContextBase& ctx,
                                Access access, const char* method) const {
  if (!rules_.require_identity && !rules_.tls) return grpc::Status::OK;
  std::optional<PeerCertificate> peer;
  if (auto auth = ctx.auth_context(); auth != nullptr) {
    peer = PeerCertificateOf(*auth);
  }
  absl::Status s = rules_.Decide(peer, access);
  if (s.ok()) return grpc::Status::OK;
  // A flood of refused calls must not flood the log: ten lines a second.
  const int64_t now = absl::ToUnixSeconds(absl::Now());
  int64_t last = last_log_second_.load();
  if (last != now && last_log_second_.compare_exchange_strong(last, now)) {
    logged_this_second_ = 0;
  }
  if (logged_this_second_.fetch_add(1) < 10) {
    spdlog::warn("refused {} from {}: {}", method, ctx.peer(),
                 std::string(s.message()));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

std::string CallerName(const CallerCheck* check,
                       const grpc::ServerContextBase& ctx) {
  if (auto auth = ctx.auth_context()) {
    if (auto cert = PeerCertificateOf(*auth)) {
      const bool cn = check != nullptr && check->rules().common_name_identity;
      std::vector<std::string> ids = IdentitiesOf(*cert, cn);
      if (!ids.empty()) return ids.front();
    }
  }
  return absl::StrCat("unauthenticated ", ctx.peer());
}

}  // namespace outbox
