#include "common/jetstream.h"

#include <nats/nats.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace outbox::jetstream {
namespace internal {

struct ConnDeleter {
  void operator()(natsConnection* c) const { natsConnection_Destroy(c); }
};
struct CtxDeleter {
  void operator()(jsCtx* js) const { jsCtx_Destroy(js); }
};
struct OptionsDeleter {
  void operator()(natsOptions* o) const { natsOptions_Destroy(o); }
};
struct NatsMsgDeleter {
  void operator()(natsMsg* m) const { natsMsg_Destroy(m); }
};
struct SubDeleter {
  void operator()(natsSubscription* s) const { natsSubscription_Destroy(s); }
};
struct PubAckDeleter {
  void operator()(jsPubAck* a) const { jsPubAck_Destroy(a); }
};
struct StreamInfoDeleter {
  void operator()(jsStreamInfo* si) const { jsStreamInfo_Destroy(si); }
};
struct ConsumerInfoDeleter {
  void operator()(jsConsumerInfo* ci) const { jsConsumerInfo_Destroy(ci); }
};
struct MetaDeleter {
  void operator()(jsMsgMetaData* m) const { jsMsgMetaData_Destroy(m); }
};

using NatsMsgPtr = std::unique_ptr<natsMsg, NatsMsgDeleter>;

// The context is declared after the connection it uses, so it goes first.
struct Handles {
  std::unique_ptr<natsConnection, ConnDeleter> conn;
  std::unique_ptr<jsCtx, CtxDeleter> js;
};
struct MsgHandle {
  NatsMsgPtr msg;
  int64_t wait_ms = 5000;
};
struct SubHandle {
  std::unique_ptr<natsSubscription, SubDeleter> sub;
  natsConnection* conn = nullptr;  // the Connection's; outlives this
  int64_t wait_ms = 5000;
};

}  // namespace internal

namespace {

using internal::NatsMsgPtr;

// What a publish no server took says after the client's words.
constexpr absl::string_view kNoRespondersNote =
    "no stream binds the subject, or its stream has no leader now";

int64_t Millis(absl::Duration d) { return absl::ToInt64Milliseconds(d); }
int64_t Nanos(absl::Duration d) { return absl::ToInt64Nanoseconds(d); }

// Which statuses are whose fault: see the list in jetstream.h.
absl::StatusCode CodeFor(natsStatus s, jsErrCode code) {
  switch (static_cast<int>(code)) {
    case JSStreamWrongLastSequenceErr:
      return absl::StatusCode::kFailedPrecondition;
    case JSStreamNotFoundErr:
    case JSConsumerNotFoundErr:
    case JSNoMessageFoundErr:
    case JSSequenceNotFoundErr:
      return absl::StatusCode::kNotFound;
    case JSStreamMessageExceedsMaximumErr:
    case JSStreamInvalidConfig:
    case JSStreamReplicasNotUpdatableErr:
    case JSStreamReplicasNotSupportedErr:
    case JSBadRequestErr:
    case JSInvalidJSONErr:
    case JSStreamSubjectOverlapErr:
      return absl::StatusCode::kInvalidArgument;
    case JSAccountResourcesExceededErr:
    case JSInsufficientResourcesErr:
    case JSMemoryResourcesExceededErr:
    case JSStorageResourcesExceededErr:
      return absl::StatusCode::kResourceExhausted;
    case JSClusterIncompleteErr:
    case JSClusterNoPeersErr:
    case JSClusterNotAvailErr:
    case JSClusterNotLeaderErr:
    case JSRaftGeneralErr:
    case JSStreamStoreFailedErr:
    case JSNotEnabledErr:
    case JSNotEnabledForAccountErr:
      return absl::StatusCode::kUnavailable;
    default:
      break;
  }
  switch (s) {
    case NATS_TIMEOUT:
      return absl::StatusCode::kDeadlineExceeded;
    case NATS_NO_RESPONDERS:
    case NATS_CONNECTION_CLOSED:
    case NATS_CONNECTION_DISCONNECTED:
    case NATS_NO_SERVER:
    case NATS_STALE_CONNECTION:
    case NATS_IO_ERROR:
    case NATS_NOT_YET_CONNECTED:
    case NATS_DRAINING:
    case NATS_SLOW_CONSUMER:
    case NATS_MISSED_HEARTBEAT:
      return absl::StatusCode::kUnavailable;
    case NATS_NOT_FOUND:
      return absl::StatusCode::kNotFound;
    case NATS_INVALID_ARG:
    case NATS_INVALID_SUBJECT:
    case NATS_MAX_PAYLOAD:
    case NATS_INVALID_TIMEOUT:
      return absl::StatusCode::kInvalidArgument;
    case NATS_CONNECTION_AUTH_FAILED:
    case NATS_NOT_PERMITTED:
      return absl::StatusCode::kPermissionDenied;
    case NATS_ILLEGAL_STATE:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return code != 0 ? absl::StatusCode::kUnknown
                       : absl::StatusCode::kInternal;
  }
}

// "<what>: <client status> (jetstream error <code>): <broker's words>".
// The broker's words are the thread's last libnats error text, taken only
// when that error's status is this one: libnats does not clear it, and a
// failure that sets none would otherwise show an older call's text.
absl::Status ToStatus(natsStatus s, jsErrCode code, absl::string_view what) {
  if (s == NATS_OK) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", natsStatus_GetText(s));
  if (code != 0) absl::StrAppend(&message, " (jetstream error ", code, ")");
  natsStatus last = NATS_OK;
  if (const char* text = nats_GetLastError(&last);
      last == s && text != nullptr && *text != '\0') {
    absl::StrAppend(&message, ": ", text);
  }
  if (s == NATS_NO_RESPONDERS) {
    // libnats reports it as JetStream error 10076 (not enabled); for a
    // publish it means that no stream leader took the subject.
    absl::StrAppend(&message, ": ", kNoRespondersNote);
  }
  return absl::Status(CodeFor(s, code), message);
}

// Every header of `msg`, in the client's key order, each value in order.
Headers ReadHeaders(natsMsg* msg) {
  Headers out;
  const char** keys = nullptr;
  int key_count = 0;
  if (natsMsgHeader_Keys(msg, &keys, &key_count) != NATS_OK) return out;
  for (int k = 0; k < key_count; ++k) {
    const char** values = nullptr;
    int value_count = 0;
    if (natsMsgHeader_Values(msg, keys[k], &values, &value_count) != NATS_OK) {
      continue;
    }
    for (int v = 0; v < value_count; ++v) out.emplace_back(keys[k], values[v]);
    free(static_cast<void*>(values));
  }
  free(static_cast<void*>(keys));
  return out;
}

std::string FirstValue(const Headers& headers, const std::string& key) {
  for (const auto& [k, v] : headers) {
    if (k == key) return v;
  }
  return std::string();
}

std::string Data(const natsMsg* msg) {
  const char* data = natsMsg_GetData(msg);
  const int len = natsMsg_GetDataLength(msg);
  return data == nullptr ? std::string() : std::string(data, len);
}

StoredMessage ToStored(natsMsg* msg) {
  StoredMessage out;
  out.subject = natsMsg_GetSubject(msg);
  out.data = Data(msg);
  out.sequence = natsMsg_GetSequence(msg);
  out.headers = ReadHeaders(msg);
  return out;
}

}  // namespace

bool IsNoResponders(const absl::Status& status) {
  return absl::IsUnavailable(status) &&
         absl::StrContains(status.message(), kNoRespondersNote);
}

bool IsWrongLastSequence(const absl::Status& status) {
  return absl::IsFailedPrecondition(status) &&
         absl::StrContains(
             status.message(),
             absl::StrCat("jetstream error ", kWrongLastSequenceErrCode, ")"));
}

std::string StoredMessage::Header(const std::string& key) const {
  return FirstValue(headers, key);
}

// ---- Message

Message::Message(std::unique_ptr<internal::MsgHandle> msg)
    : msg_(std::move(msg)) {
  natsMsg* m = msg_->msg.get();
  subject_ = natsMsg_GetSubject(m);
  data_ = Data(m);
  headers_ = ReadHeaders(m);
  jsMsgMetaData* raw = nullptr;
  if (natsMsg_GetMetaData(&raw, m) == NATS_OK) {
    std::unique_ptr<jsMsgMetaData, internal::MetaDeleter> meta(raw);
    stream_seq_ = meta->Sequence.Stream;
    consumer_seq_ = meta->Sequence.Consumer;
    num_delivered_ = meta->NumDelivered;
    num_pending_ = meta->NumPending;
    timestamp_ = absl::FromUnixNanos(meta->Timestamp);
  }
}

Message::~Message() = default;
Message::Message(Message&&) noexcept = default;
Message& Message::operator=(Message&&) noexcept = default;

std::string Message::Header(const std::string& key) const {
  return FirstValue(headers_, key);
}

absl::Status Message::Ack() {
  jsOptions opts;
  jsOptions_Init(&opts);
  opts.Wait = msg_->wait_ms;
  jsErrCode code = static_cast<jsErrCode>(0);
  const natsStatus s = natsMsg_AckSync(msg_->msg.get(), &opts, &code);
  return ToStatus(s, code, absl::StrCat("ack of stream seq ", stream_seq_));
}

absl::Status Message::AckNoWait() {
  const natsStatus s = natsMsg_Ack(msg_->msg.get(), nullptr);
  return ToStatus(s, static_cast<jsErrCode>(0),
                  absl::StrCat("ack of stream seq ", stream_seq_));
}

absl::Status Message::Nak(absl::Duration delay) {
  const natsStatus s =
      delay > absl::ZeroDuration()
          ? natsMsg_NakWithDelay(msg_->msg.get(), Millis(delay), nullptr)
          : natsMsg_Nak(msg_->msg.get(), nullptr);
  return ToStatus(s, static_cast<jsErrCode>(0),
                  absl::StrCat("nak of stream seq ", stream_seq_));
}

// ---- PullConsumer

PullConsumer::PullConsumer(std::unique_ptr<internal::SubHandle> sub)
    : sub_(std::move(sub)) {}
PullConsumer::~PullConsumer() = default;

absl::StatusOr<std::vector<Message>> PullConsumer::Fetch(
    int max, absl::Duration timeout) {
  if (max <= 0) return absl::InvalidArgumentError("fetch of no message");
  natsMsgList list{};
  jsErrCode code = static_cast<jsErrCode>(0);
  const natsStatus s =
      natsSubscription_Fetch(&list, sub_->sub.get(), max,
                             std::max<int64_t>(1, Millis(timeout)), &code);
  std::vector<Message> out;
  // A timeout with nothing fetched is an empty answer; one after some
  // messages came still hands them over.
  if (s != NATS_OK && !(s == NATS_TIMEOUT && code == 0)) {
    natsMsgList_Destroy(&list);
    return ToStatus(s, code, "fetch");
  }
  out.reserve(list.Count);
  for (int i = 0; i < list.Count; ++i) {
    auto handle = std::make_unique<internal::MsgHandle>();
    handle->msg.reset(list.Msgs[i]);
    list.Msgs[i] = nullptr;
    handle->wait_ms = sub_->wait_ms;
    out.push_back(Message(std::move(handle)));
  }
  natsMsgList_Destroy(&list);
  return out;
}

absl::Status PullConsumer::Flush(absl::Duration timeout) {
  if (sub_->conn == nullptr) return absl::OkStatus();
  const natsStatus s = natsConnection_FlushTimeout(
      sub_->conn, std::max<int64_t>(1, Millis(timeout)));
  return ToStatus(s, static_cast<jsErrCode>(0), "flush");
}

// ---- Connection

Connection::Connection(std::unique_ptr<internal::Handles> handles,
                       absl::Duration request_timeout)
    : handles_(std::move(handles)), request_timeout_(request_timeout) {}

Connection::~Connection() = default;

absl::StatusOr<std::unique_ptr<Connection>> Connection::Connect(
    const ConnectOptions& options) {
  if (options.servers.empty()) {
    return absl::InvalidArgumentError("no NATS server URL given");
  }
  natsOptions* raw_opts = nullptr;
  natsStatus s = natsOptions_Create(&raw_opts);
  if (s != NATS_OK) return ToStatus(s, {}, "nats options");
  std::unique_ptr<natsOptions, internal::OptionsDeleter> opts(raw_opts);
  std::vector<const char*> urls;
  for (const std::string& url : options.servers) urls.push_back(url.c_str());
  s = natsOptions_SetServers(opts.get(), urls.data(),
                             static_cast<int>(urls.size()));
  if (s == NATS_OK) s = natsOptions_SetName(opts.get(), options.name.c_str());
  if (s == NATS_OK) {
    s = natsOptions_SetTimeout(opts.get(), Millis(options.connect_timeout));
  }
  if (s == NATS_OK) s = natsOptions_SetAllowReconnect(opts.get(), true);
  if (s == NATS_OK) {
    s = natsOptions_SetMaxReconnect(opts.get(), options.max_reconnects);
  }
  if (s == NATS_OK) {
    s = natsOptions_SetReconnectWait(opts.get(),
                                     Millis(options.reconnect_wait));
  }
  if (s == NATS_OK) {
    s = natsOptions_SetPingInterval(opts.get(), Millis(options.ping_interval));
  }
  if (s == NATS_OK) s = natsOptions_SetMaxPingsOut(opts.get(), 2);
  // A publish issued while disconnected must not sit in the reconnect
  // buffer until the request times out: fail it now, the caller retries.
  if (s == NATS_OK)
    s = natsOptions_SetFailRequestsOnDisconnect(opts.get(), true);
  if (s != NATS_OK) return ToStatus(s, {}, "nats options");
  if (!options.user.empty()) {
    s = natsOptions_SetUserInfo(opts.get(), options.user.c_str(),
                                options.password.c_str());
  } else if (!options.token.empty()) {
    s = natsOptions_SetToken(opts.get(), options.token.c_str());
  } else if (!options.creds_file.empty()) {
    s = natsOptions_SetUserCredentialsFromFiles(
        opts.get(), options.creds_file.c_str(), nullptr);
  }
  if (s != NATS_OK) return ToStatus(s, {}, "nats credentials");
  if (!options.ca_file.empty() || !options.cert_file.empty()) {
    s = natsOptions_SetSecure(opts.get(), true);
    if (s == NATS_OK && !options.ca_file.empty()) {
      s = natsOptions_LoadCATrustedCertificates(opts.get(),
                                                options.ca_file.c_str());
    }
    if (s == NATS_OK && !options.cert_file.empty()) {
      s = natsOptions_LoadCertificatesChain(
          opts.get(), options.cert_file.c_str(), options.key_file.c_str());
    }
    if (s != NATS_OK) return ToStatus(s, {}, "nats TLS files");
  }

  auto handles = std::make_unique<internal::Handles>();
  natsConnection* conn = nullptr;
  s = natsConnection_Connect(&conn, opts.get());
  handles->conn.reset(conn);
  if (s != NATS_OK) {
    return ToStatus(s, {},
                    absl::StrCat("connect to ", options.servers[0], " and ",
                                 urls.size() - 1, " more"));
  }
  jsOptions js_opts;
  jsOptions_Init(&js_opts);
  js_opts.Wait = Millis(options.request_timeout);
  jsCtx* js = nullptr;
  s = natsConnection_JetStream(&js, conn, &js_opts);
  handles->js.reset(js);
  if (s != NATS_OK) return ToStatus(s, {}, "jetstream context");
  return std::unique_ptr<Connection>(
      new Connection(std::move(handles), options.request_timeout));
}

bool Connection::closed() const {
  return natsConnection_IsClosed(handles_->conn.get());
}

std::string Connection::ConnectedUrl() const {
  char buf[256];
  if (natsConnection_GetConnectedUrl(handles_->conn.get(), buf, sizeof(buf)) !=
      NATS_OK) {
    return std::string();
  }
  return buf;
}

absl::Status Connection::EnsureStream(const StreamOptions& options) {
  jsStreamConfig cfg;
  jsStreamConfig_Init(&cfg);
  std::vector<const char*> subjects;
  for (const std::string& subject : options.subjects) {
    subjects.push_back(subject.c_str());
  }
  cfg.Name = options.name.c_str();
  cfg.Subjects = subjects.data();
  cfg.SubjectsLen = static_cast<int>(subjects.size());
  cfg.Storage = js_FileStorage;
  cfg.Replicas = options.replicas;
  cfg.MaxAge = Nanos(options.max_age);
  cfg.Duplicates = Nanos(options.duplicate_window);
  if (options.max_msgs_per_subject > 0) {
    cfg.MaxMsgsPerSubject = options.max_msgs_per_subject;
  }
  jsErrCode code = static_cast<jsErrCode>(0);
  natsStatus s =
      js_AddStream(nullptr, handles_->js.get(), &cfg, nullptr, &code);
  if (s == NATS_OK) return absl::OkStatus();
  // Adding an existing stream with the same settings succeeds; with other
  // settings it is refused as a name in use, and an update applies them.
  if (code != JSStreamNameExistErr) {
    return ToStatus(s, code, absl::StrCat("add stream ", options.name));
  }
  code = static_cast<jsErrCode>(0);
  s = js_UpdateStream(nullptr, handles_->js.get(), &cfg, nullptr, &code);
  return ToStatus(s, code, absl::StrCat("update stream ", options.name));
}

absl::Status Connection::DeleteStream(const std::string& name) {
  jsErrCode code = static_cast<jsErrCode>(0);
  const natsStatus s =
      js_DeleteStream(handles_->js.get(), name.c_str(), nullptr, &code);
  return ToStatus(s, code, absl::StrCat("delete stream ", name));
}

absl::StatusOr<StreamInfo> Connection::GetStreamInfo(const std::string& name) {
  jsStreamInfo* raw = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  const natsStatus s =
      js_GetStreamInfo(&raw, handles_->js.get(), name.c_str(), nullptr, &code);
  std::unique_ptr<jsStreamInfo, internal::StreamInfoDeleter> si(raw);
  if (s != NATS_OK) {
    return ToStatus(s, code, absl::StrCat("stream info of ", name));
  }
  StreamInfo out;
  out.messages = si->State.Msgs;
  out.first_seq = si->State.FirstSeq;
  out.last_seq = si->State.LastSeq;
  if (si->Config != nullptr) {
    for (int i = 0; i < si->Config->SubjectsLen; ++i) {
      out.subjects.push_back(si->Config->Subjects[i]);
    }
  }
  if (si->Cluster != nullptr) {
    if (si->Cluster->Leader != nullptr) out.leader = si->Cluster->Leader;
    for (int i = 0; i < si->Cluster->ReplicasLen; ++i) {
      const jsPeerInfo* peer = si->Cluster->Replicas[i];
      out.replicas.push_back(peer->Name);
      if (peer->Current && !peer->Offline) {
        out.current_replicas.push_back(peer->Name);
      }
    }
  }
  return out;
}

namespace {

// The natsMsg of `message`, its headers set; `expected` keeps the text of
// the expected sequence for error messages.
absl::StatusOr<NatsMsgPtr> BuildMsg(const OutgoingMessage& message,
                                    std::string* expected) {
  natsMsg* raw = nullptr;
  natsStatus s = natsMsg_Create(&raw, message.subject.c_str(), nullptr,
                                message.data.data(),
                                static_cast<int>(message.data.size()));
  if (s != NATS_OK) {
    return ToStatus(s, {}, absl::StrCat("message to ", message.subject));
  }
  NatsMsgPtr msg(raw);
  // Set as headers rather than through jsPubOptions, whose
  // ExpectLastSubjectSeq cannot say 0 ("no message on the subject yet").
  if (!message.msg_id.empty()) {
    s = natsMsgHeader_Set(msg.get(), "Nats-Msg-Id", message.msg_id.c_str());
  }
  if (s == NATS_OK && message.expected_last_subject_seq.has_value()) {
    *expected = absl::StrCat(*message.expected_last_subject_seq);
    s = natsMsgHeader_Set(msg.get(), "Nats-Expected-Last-Subject-Sequence",
                          expected->c_str());
  }
  for (const auto& [key, value] : message.headers) {
    if (s != NATS_OK) break;
    s = natsMsgHeader_Add(msg.get(), key.c_str(), value.c_str());
  }
  if (s != NATS_OK) {
    return ToStatus(s, {}, absl::StrCat("headers of ", message.subject));
  }
  return msg;
}

std::string PublishWhat(const OutgoingMessage& message,
                        const std::string& expected) {
  return absl::StrCat("publish to ", message.subject,
                      message.msg_id.empty() ? "" : " msg id ", message.msg_id,
                      expected.empty() ? "" : " expecting last subject seq ",
                      expected);
}

// The acks of one PublishAll, filled in by the library's thread.
struct AsyncAcks {
  absl::Mutex mu;  // PublishAll awaits open == 0 under it
  std::map<natsMsg*, size_t> index;  // published, not answered
  std::vector<absl::StatusOr<PublishAck>>* results = nullptr;
  const std::vector<OutgoingMessage>* messages = nullptr;
  const std::vector<std::string>* expected = nullptr;
  size_t open = 0;  // published and neither answered nor taken back

  static void OnAck(jsCtx*, natsMsg* msg, jsPubAck* pa, jsPubAckErr* pae,
                    void* closure) {
    auto* self = static_cast<AsyncAcks*>(closure);
    {
      absl::MutexLock lock(&self->mu);
      auto it = self->index.find(msg);
      if (it != self->index.end()) {
        const size_t i = it->second;
        if (pa != nullptr) {
          PublishAck ack;
          if (pa->Stream != nullptr) ack.stream = pa->Stream;
          ack.sequence = pa->Sequence;
          ack.duplicate = pa->Duplicate;
          (*self->results)[i] = ack;
        } else {
          const natsStatus err = pae != nullptr ? pae->Err : NATS_ERR;
          const jsErrCode code =
              pae != nullptr ? pae->ErrCode : static_cast<jsErrCode>(0);
          (*self->results)[i] = ToStatus(
              err, code,
              absl::StrCat(
                  PublishWhat((*self->messages)[i], (*self->expected)[i]),
                  pae != nullptr && pae->ErrText != nullptr
                      ? absl::StrCat(" (", pae->ErrText, ")")
                      : ""));
        }
        self->index.erase(it);
        --self->open;
      }
    }
    natsMsg_Destroy(msg);
  }
};

}  // namespace

absl::StatusOr<PublishAck> Connection::Publish(const OutgoingMessage& message) {
  std::string expected;
  absl::StatusOr<NatsMsgPtr> msg = BuildMsg(message, &expected);
  if (!msg.ok()) return msg.status();
  jsPubOptions opts;
  jsPubOptions_Init(&opts);
  opts.MaxWait = Millis(request_timeout_);
  jsPubAck* raw_ack = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  const natsStatus s =
      js_PublishMsg(&raw_ack, handles_->js.get(), msg->get(), &opts, &code);
  std::unique_ptr<jsPubAck, internal::PubAckDeleter> ack(raw_ack);
  if (s != NATS_OK) return ToStatus(s, code, PublishWhat(message, expected));
  PublishAck out;
  if (ack->Stream != nullptr) out.stream = ack->Stream;
  out.sequence = ack->Sequence;
  out.duplicate = ack->Duplicate;
  return out;
}

std::vector<absl::StatusOr<PublishAck>> Connection::PublishAll(
    const std::vector<OutgoingMessage>& messages) {
  std::vector<absl::StatusOr<PublishAck>> results(
      messages.size(), absl::DeadlineExceededError("no publish ack in time"));
  if (messages.empty()) return results;
  std::vector<std::string> expected(messages.size());
  AsyncAcks acks;
  acks.results = &results;
  acks.messages = &messages;
  acks.expected = &expected;
  // A context of this call's own: its acks, and only its, come to `acks`.
  jsOptions js_opts;
  jsOptions_Init(&js_opts);
  js_opts.Wait = Millis(request_timeout_);
  js_opts.PublishAsync.AckHandler = &AsyncAcks::OnAck;
  js_opts.PublishAsync.AckHandlerClosure = &acks;
  js_opts.PublishAsync.MaxPending = static_cast<int64_t>(messages.size()) + 1;
  jsCtx* raw_js = nullptr;
  natsStatus s =
      natsConnection_JetStream(&raw_js, handles_->conn.get(), &js_opts);
  std::unique_ptr<jsCtx, internal::CtxDeleter> js(raw_js);
  if (s != NATS_OK) {
    const absl::Status st = ToStatus(s, {}, "jetstream context");
    for (auto& r : results) r = st;
    return results;
  }
  jsPubOptions opts;
  jsPubOptions_Init(&opts);
  opts.MaxWait = Millis(request_timeout_);
  for (size_t i = 0; i < messages.size(); ++i) {
    absl::StatusOr<NatsMsgPtr> built = BuildMsg(messages[i], &expected[i]);
    if (!built.ok()) {
      results[i] = built.status();
      continue;
    }
    natsMsg* m = built->release();
    {
      absl::MutexLock lock(&acks.mu);
      acks.index[m] = i;
      ++acks.open;
    }
    natsMsg* handed = m;
    s = js_PublishMsgAsync(js.get(), &handed, &opts);
    if (s != NATS_OK) {
      // Not taken: still ours, and no ack will name it.
      {
        absl::MutexLock lock(&acks.mu);
        acks.index.erase(m);
        --acks.open;
      }
      natsMsg_Destroy(handed);
      results[i] = ToStatus(s, {}, PublishWhat(messages[i], expected[i]));
    }
  }
  jsPubOptions wait;
  jsPubOptions_Init(&wait);
  wait.MaxWait = Millis(request_timeout_) + 1000;
  (void)js_PublishAsyncComplete(js.get(), &wait);
  natsMsgList pending{};
  if (js_PublishAsyncGetPendingList(&pending, js.get()) == NATS_OK) {
    absl::MutexLock lock(&acks.mu);
    for (int k = 0; k < pending.Count; ++k) {
      if (acks.index.erase(pending.Msgs[k]) > 0) --acks.open;
    }
  }
  natsMsgList_Destroy(&pending);
  // An ack being handed over as the list was taken: wait for it, so that
  // nothing touches `acks` once this returns.
  absl::MutexLock lock(&acks.mu);
  acks.mu.AwaitWithTimeout(
      absl::Condition(+[](AsyncAcks* a) { return a->open == 0; }, &acks),
      absl::Seconds(2));
  return results;
}

absl::StatusOr<StoredMessage> Connection::LastOnSubject(
    const std::string& stream, const std::string& subject) {
  natsMsg* raw = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  const natsStatus s = js_GetLastMsg(&raw, handles_->js.get(), stream.c_str(),
                                     subject.c_str(), nullptr, &code);
  NatsMsgPtr msg(raw);
  if (s != NATS_OK) {
    return ToStatus(s, code,
                    absl::StrCat("last message of ", subject, " in ", stream));
  }
  return ToStored(msg.get());
}

absl::StatusOr<StoredMessage> Connection::GetMessage(const std::string& stream,
                                                     uint64_t sequence) {
  natsMsg* raw = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  const natsStatus s = js_GetMsg(&raw, handles_->js.get(), stream.c_str(),
                                 sequence, nullptr, &code);
  NatsMsgPtr msg(raw);
  if (s != NATS_OK) {
    return ToStatus(s, code,
                    absl::StrCat("message ", sequence, " of ", stream));
  }
  return ToStored(msg.get());
}

absl::StatusOr<std::unique_ptr<PullConsumer>> Connection::PullSubscribe(
    const PullConsumerOptions& options) {
  jsConsumerConfig cfg;
  jsConsumerConfig_Init(&cfg);
  cfg.Durable = options.durable.c_str();
  cfg.AckPolicy = js_AckExplicit;
  cfg.DeliverPolicy = js_DeliverAll;
  cfg.AckWait = Nanos(options.ack_wait);
  cfg.MaxDeliver = options.max_deliver;
  cfg.MaxAckPending = options.max_ack_pending;
  if (!options.filter_subject.empty()) {
    cfg.FilterSubject = options.filter_subject.c_str();
  }
  // Created here, not by the subscription: a consumer the subscription
  // created would be deleted by its unsubscribe, and a durable consumer
  // must outlive this process.
  jsConsumerInfo* raw_ci = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  natsStatus s = js_AddConsumer(&raw_ci, handles_->js.get(),
                                options.stream.c_str(), &cfg, nullptr, &code);
  std::unique_ptr<jsConsumerInfo, internal::ConsumerInfoDeleter> ci(raw_ci);
  // An existing durable with other settings: 2.9 applies what it can
  // (and refuses the rest as 10013); later servers refuse any change as
  // 10148 and want an update.
  constexpr int kConsumerAlreadyExists = 10148;
  if (s != NATS_OK && (code == JSConsumerNameExistErr ||
                       static_cast<int>(code) == kConsumerAlreadyExists)) {
    code = static_cast<jsErrCode>(0);
    raw_ci = nullptr;
    s = js_UpdateConsumer(&raw_ci, handles_->js.get(), options.stream.c_str(),
                          &cfg, nullptr, &code);
    ci.reset(raw_ci);
  }
  if (s != NATS_OK) {
    return ToStatus(
        s, code,
        absl::StrCat("consumer ", options.durable, " on ", options.stream));
  }
  jsSubOptions sub_opts;
  jsSubOptions_Init(&sub_opts);
  sub_opts.Stream = options.stream.c_str();
  sub_opts.Consumer = options.durable.c_str();
  natsSubscription* raw_sub = nullptr;
  code = static_cast<jsErrCode>(0);
  s = js_PullSubscribe(
      &raw_sub, handles_->js.get(),
      options.filter_subject.empty() ? nullptr : options.filter_subject.c_str(),
      options.durable.c_str(), nullptr, &sub_opts, &code);
  auto handle = std::make_unique<internal::SubHandle>();
  handle->sub.reset(raw_sub);
  handle->conn = handles_->conn.get();
  handle->wait_ms = Millis(request_timeout_);
  if (s != NATS_OK) {
    return ToStatus(s, code,
                    absl::StrCat("pull subscribe to ", options.durable, " on ",
                                 options.stream));
  }
  return std::unique_ptr<PullConsumer>(new PullConsumer(std::move(handle)));
}

absl::Status Connection::DeleteConsumer(const std::string& stream,
                                        const std::string& durable) {
  jsErrCode code = static_cast<jsErrCode>(0);
  const natsStatus s = js_DeleteConsumer(handles_->js.get(), stream.c_str(),
                                         durable.c_str(), nullptr, &code);
  return ToStatus(s, code,
                  absl::StrCat("delete consumer ", durable, " on ", stream));
}

}  // namespace outbox::jetstream
