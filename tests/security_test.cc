// Every method of every service, found through the descriptors (so a method
// added later is covered too), refuses a client of the right CA whose
// identity is not admitted, and refuses a client with no certificate;
// health and reflection stay reachable to any client that passes TLS.
// Real certificates (scripts/lib/certs.sh, openssl) and real TLS on
// loopback; no database is needed, since every refusal comes before one.

#include <google/protobuf/descriptor.h>
#include <grpc/support/log.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/identity.h"
#include "common/server.h"
#include "common/tls.h"
#include "consumer/billing.h"
#include "consumer/query_service.h"
#include "inbox/engine.h"
#include "inbox/sink_service.h"
#include "producer/order_service.h"
#include "producer/order_store.h"
#include "relay/admin_service.h"
#include "relay/relay.h"
#include "tests/testing/grpc.h"

namespace outbox {
namespace {

// A throwaway CA and certificates in a temporary folder.
class Certificates {
 public:
  Certificates() {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("outbox-security-test-", getpid());
    const std::string cmd = absl::StrCat(
        "bash -c 'source \"", OUTBOX_SOURCE_DIR, "/scripts/lib/certs.sh\" && ",
        "make_certs \"", dir_.string(),
        "\" server relay reader ops intruder && ",
        // Identities without a URI SAN: a DNS SAN, a CN alone, and a DNS
        // SAN beside a CN that is listed (the SAN wins).
        "make_cert_san \"", dir_.string(),
        "\" dnsreader DNS:reader.example.com && make_cert_san \"",
        dir_.string(), "\" cnreader \"\" && make_cert_san \"", dir_.string(),
        "\" cnreader-too DNS:unlisted.example.com' >/dev/null");
    ok_ = std::system(cmd.c_str()) == 0;
  }
  ~Certificates() { std::filesystem::remove_all(dir_); }
  bool ok() const { return ok_; }
  std::string File(const std::string& name) const {
    return (dir_ / name).string();
  }
  ClientTlsFiles Client(const std::string& who) const {
    if (who.empty()) return {File("ca.crt"), "", ""};
    return {File("ca.crt"), File(who + ".crt"), File(who + ".key")};
  }

 private:
  std::filesystem::path dir_;
  bool ok_ = false;
};

// Calls `method` ("/pkg.Service/Method") with one empty message, whatever
// its kind (unary or streaming), and returns the final status.
grpc::Status CallAnything(grpc::Channel* channel, const std::string& method) {
  grpc::GenericStub stub(channel->shared_from_this());
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = stub.PrepareCall(&ctx, method, &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  grpc::Slice empty("");
  grpc::ByteBuffer message(&empty, 1);
  call->Write(message, reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  call->WritesDone(reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(4));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(4)) {
  }
  return status;
}

std::vector<std::string> MethodsOf(const std::string& service) {
  const auto* d =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          service);
  std::vector<std::string> out;
  for (int i = 0; d != nullptr && i < d->method_count(); ++i) {
    out.push_back(absl::StrCat("/", service, "/", d->method(i)->name()));
  }
  return out;
}

// How the servers under test are configured: who may call what, and
// whether client certificates are asked for at all.
struct Mode {
  AccessRules rules;
  bool client_ca = true;
};

// The deployment's: mutual TLS, lists as the manifests give them.
Mode MutualTls() {
  Mode m;
  m.rules.require_identity = true;
  m.rules.tls = true;
  m.rules.allowed = {"spiffe://outbox/relay", "spiffe://outbox/reader",
                     "reader.example.com", "cnreader", "cnreader-too"};
  m.rules.admin = {"spiffe://outbox/ops"};
  m.rules.delivery = {"spiffe://outbox/relay"};
  return m;
}

class SecurityTest : public ::testing::Test {
 protected:
  explicit SecurityTest(Mode mode = MutualTls())
      : client_ca_(mode.client_ca),
        check_(std::move(mode.rules)),
        db_("postgresql://127.0.0.1:1/none", 1, "security-test"),
        store_(&db_, &writer_),
        workers_(2, 64),
        orders_(&store_, &metrics_, &workers_, nullptr, &check_),
        applier_(&db_, &billing_, &metrics_),
        sink_(&applier_, &check_),
        query_(&db_, &metrics_, "billing", &check_, &applier_),
        relay_(RelayOptionsForTest(), &metrics_),
        admin_(&db_, &relay_, &check_) {}

  static relay::RelayOptions RelayOptionsForTest() {
    relay::RelayOptions o;
    o.db_url = "postgresql://127.0.0.1:1/none";
    o.consumer = "127.0.0.1:1";
    return o;
  }

  void SetUp() override {
    ASSERT_TRUE(certs_.ok()) << "openssl could not make test certificates";
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.shutdown_timeout = absl::Seconds(1);
    options.health_listen = "127.0.0.1:0";
    options.credentials = MakeServerCredentials(
        {certs_.File("server.crt"), certs_.File("server.key"),
         client_ca_ ? certs_.File("ca.crt") : ""});
    auto server = GrpcServer::Start(
        options, {{&orders_, v1::OrderService::service_full_name()},
                  {&sink_, v1::EventSink::service_full_name()},
                  {&query_, v1::BillingQuery::service_full_name()},
                  {&admin_, v1::RelayAdmin::service_full_name()}});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  std::shared_ptr<grpc::Channel> As(const std::string& who) {
    return grpc::CreateChannel(absl::StrCat("localhost:", server_->port()),
                               MakeChannelCredentials(certs_.Client(who)));
  }

  Certificates certs_;
  bool client_ca_;
  CallerCheck check_;
  Metrics metrics_;
  Database db_;
  Writer writer_;
  producer::OrderStore store_;
  WorkerPool workers_;
  producer::OrderServiceImpl orders_;
  consumer::BillingHandler billing_;
  inbox::Engine applier_;
  inbox::EventSinkImpl sink_;
  consumer::BillingQueryImpl query_;
  relay::Relay relay_;
  relay::RelayAdminImpl admin_;
  std::unique_ptr<GrpcServer> server_;
};

// The calls that change what is delivered or applied behind the pipeline.
constexpr const char* kAdminMethods[] = {
    "/outbox.v1.RelayAdmin/Requeue", "/outbox.v1.RelayAdmin/Replay",
    "/outbox.v1.RelayAdmin/ResolveDivergence",
    "/outbox.v1.RelayAdmin/PauseSubscription",
    "/outbox.v1.RelayAdmin/ResumeSubscription",
    "/outbox.v1.RelayAdmin/DropSubscription",
    "/outbox.v1.RelayAdmin/MoveSubscriptionToLog",
    "/outbox.v1.RelayAdmin/MoveSubscriptionToRows",
    "/outbox.v1.BillingQuery/ReleaseHeldEvent",
    "/outbox.v1.BillingQuery/SkipHeldEvent"};

bool IsAdminMethod(const std::string& method) {
  for (const char* m : kAdminMethods) {
    if (method == m) return true;
  }
  return false;
}

TEST_F(SecurityTest, EveryMethodRefusesAnIdentityThatIsNotAdmitted) {
  auto intruder = As("intruder");
  int methods = 0;
  for (const char* service :
       {"outbox.v1.OrderService", "outbox.v1.EventSink",
        "outbox.v1.BillingQuery", "outbox.v1.RelayAdmin"}) {
    for (const std::string& method : MethodsOf(service)) {
      ++methods;
      grpc::Status s = CallAnything(intruder.get(), method);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
          << method << ": " << s.error_message();
      EXPECT_NE(s.error_message().find("spiffe://outbox/intruder"),
                std::string::npos)
          << method << ": " << s.error_message();
    }
  }
  EXPECT_EQ(methods, 4 + 3 + 5 + 13);
}

TEST_F(SecurityTest, AdmittedIdentitiesGetPastTheCheck) {
  // Past the check, the calls reach the (absent) database or validation:
  // anything but PERMISSION_DENIED / UNAUTHENTICATED.
  auto reader = As("reader");
  for (const std::string& method : MethodsOf("outbox.v1.BillingQuery")) {
    if (IsAdminMethod(method)) continue;
    grpc::Status s = CallAnything(reader.get(), method);
    EXPECT_NE(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << method;
    // UNAVAILABLE from the absent database, not from the handshake.
    EXPECT_TRUE(s.error_code() != grpc::StatusCode::UNAVAILABLE ||
                s.error_message().find("database") != std::string::npos)
        << method << ": " << s.error_message();
  }
  // Deliver: only the relay, though the reader may query.
  EXPECT_EQ(
      CallAnything(reader.get(), "/outbox.v1.EventSink/Deliver").error_code(),
      grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(CallAnything(As("relay").get(), "/outbox.v1.EventSink/Deliver")
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // The consumer's repair calls: only the relay, as Deliver.
  for (const char* method :
       {"/outbox.v1.EventSink/GetCursors", "/outbox.v1.EventSink/Rewind"}) {
    EXPECT_EQ(CallAnything(reader.get(), method).error_code(),
              grpc::StatusCode::PERMISSION_DENIED)
        << method;
    EXPECT_NE(CallAnything(As("relay").get(), method).error_code(),
              grpc::StatusCode::PERMISSION_DENIED)
        << method;
  }
  // Requeue, Replay, ResolveDivergence and the actions on subscriptions
  // change what is delivered, and the actions on held events what is
  // applied: the
  // reader may not, ops may (and an empty request is refused as such).
  for (const char* method : kAdminMethods) {
    EXPECT_EQ(CallAnything(reader.get(), method).error_code(),
              grpc::StatusCode::PERMISSION_DENIED)
        << method;
    EXPECT_EQ(CallAnything(As("ops").get(), method).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << method;
  }
  // ListDivergences is a read.
  EXPECT_NE(CallAnything(reader.get(), "/outbox.v1.RelayAdmin/ListDivergences")
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

// Without a URI SAN a certificate is known by its DNS SAN; a CN alone is
// no identity (README "Security"): real certificates, made by
// scripts/lib/certs.sh, through the real TLS stack.
TEST_F(SecurityTest, IdentityComesFromTheDnsSanAndNeverFromACommonName) {
  const std::string query = "/outbox.v1.BillingQuery/GetStats";
  grpc::Status s = CallAnything(As("dnsreader").get(), query);
  EXPECT_NE(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << s.error_message();
  EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  // Its CN is listed, but a CN is not an identity here.
  s = CallAnything(As("cnreader").get(), query);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << s.error_message();
  EXPECT_NE(s.error_message().find("--tls_cn_identity"), std::string::npos)
      << s.error_message();
  // A DNS SAN hides the CN: this one's CN is listed, its SAN is not.
  s = CallAnything(As("cnreader-too").get(), query);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << s.error_message();
  EXPECT_NE(s.error_message().find("identity unlisted.example.com"),
            std::string::npos)
      << s.error_message();
}

// --tls_cn_identity: a certificate without SAN is known by its CN, and a
// SAN still hides the CN.
class CommonNameSecurityTest : public SecurityTest {
 protected:
  CommonNameSecurityTest()
      : SecurityTest([] {
          Mode m = MutualTls();
          m.rules.common_name_identity = true;
          return m;
        }()) {}
};

TEST_F(CommonNameSecurityTest, ACommonNameCountsOnlyWithoutSan) {
  const std::string query = "/outbox.v1.BillingQuery/GetStats";
  grpc::Status s = CallAnything(As("cnreader").get(), query);
  EXPECT_NE(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << s.error_message();
  EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  s = CallAnything(As("cnreader-too").get(), query);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << s.error_message();
}

// TLS without client certificates (--tls_no_client_auth): the API is
// served to anyone, but nothing that delivers events or changes state.
class ServerTlsOnlySecurityTest : public SecurityTest {
 protected:
  ServerTlsOnlySecurityTest()
      : SecurityTest([] {
          Mode m;
          m.rules.tls = true;
          m.client_ca = false;
          return m;
        }()) {}
};

TEST_F(ServerTlsOnlySecurityTest, DeliveryAndAdminCallsNeedAnAuthenticatedClient) {
  for (const std::string& who : {std::string(), std::string("relay")}) {
    auto client = As(who);  // a certificate is not even asked for
    int refused = 0;
    for (const char* service : {"outbox.v1.EventSink", "outbox.v1.RelayAdmin",
                                "outbox.v1.BillingQuery"}) {
      for (const std::string& method : MethodsOf(service)) {
        grpc::Status s = CallAnything(client.get(), method);
        const bool admin = IsAdminMethod(method);
        if (std::string(service) == "outbox.v1.EventSink" || admin) {
          ++refused;
          EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
              << method << ": " << s.error_message();
          EXPECT_NE(s.error_message().find("--tls_client_ca"),
                    std::string::npos)
              << method << ": " << s.error_message();
        } else {
          EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
              << method << ": " << s.error_message();
          EXPECT_NE(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
              << method << ": " << s.error_message();
        }
      }
    }
    EXPECT_EQ(refused, 3 + 8 + 2) << who;
  }
  // The order API is served.
  grpc::Status s =
      CallAnything(As("").get(), "/outbox.v1.OrderService/GetOrder");
  EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
}

TEST_F(SecurityTest, HealthAndReflectionAnswerAnyClientThatPassesTls) {
  auto intruder = As("intruder");
  EXPECT_EQ(testing::HealthStatus(intruder.get()), "SERVING");
  EXPECT_TRUE(
      testing::ReflectedServices(intruder.get()).count("outbox.v1.EventSink"));
}

TEST_F(SecurityTest, ThePlaintextHealthPortAnswersHealthOnly) {
  auto probe =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->health_port()),
                          grpc::InsecureChannelCredentials());
  EXPECT_EQ(testing::HealthStatus(probe.get()), "SERVING");
  for (const char* method :
       {"/outbox.v1.EventSink/Deliver", "/outbox.v1.RelayAdmin/Requeue",
        "/outbox.v1.OrderService/CreateOrder"}) {
    EXPECT_EQ(CallAnything(probe.get(), method).error_code(),
              grpc::StatusCode::UNIMPLEMENTED)
        << method;
  }
  server_->SetServing(false);
  EXPECT_EQ(testing::HealthStatus(probe.get()), "NOT_SERVING");
}

// What gRPC core logs (the server's side of a handshake, here in the
// same process), from the first GrpcLogCapture on; still written to
// stderr as well.
class GrpcLogCapture {
 public:
  GrpcLogCapture() { gpr_set_log_function(&Capture); }
  // True once a line containing `text` was logged.
  static bool Saw(const std::string& text) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& line : lines_) {
      if (line.find(text) != std::string::npos) return true;
    }
    return false;
  }

 private:
  static void Capture(gpr_log_func_args* args) {
    std::fprintf(stderr, "grpc: %s\n", args->message);
    std::lock_guard<std::mutex> lock(mu_);
    lines_.emplace_back(args->message);
  }
  static inline std::mutex mu_;
  static inline std::vector<std::string> lines_;
};

// Refused in the handshake, by a server that is up: the server's TLS
// stack says why (no certificate; not TLS at all), and it answers a client
// with a certificate meanwhile. A dead port would fail the calls too, but
// not for these reasons.
TEST_F(SecurityTest, NoCertificateReachesNothing) {
  GrpcLogCapture log;
  auto anonymous = As("");
  grpc::Status s =
      CallAnything(anonymous.get(), "/outbox.v1.EventSink/Deliver");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(testing::HealthStatus(anonymous.get()), "SERVING");
  EXPECT_TRUE(log.Saw("peer did not return a certificate"));
  auto plaintext =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                          grpc::InsecureChannelCredentials());
  s = CallAnything(plaintext.get(), "/outbox.v1.EventSink/Deliver");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_TRUE(log.Saw("wrong version number"));
  EXPECT_EQ(testing::HealthStatus(As("reader").get()), "SERVING");
}

}  // namespace
}  // namespace outbox
