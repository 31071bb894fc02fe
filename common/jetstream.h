#pragma once
// A small C++ face of the NATS C client (libnats) for JetStream: a
// connection to a cluster, streams, publishing with de-duplication and a
// per-subject compare-and-set, and durable pull consumers. Every call
// returns a status; the C handles are owned here and freed on every path.
//
//   auto conn = jetstream::Connection::Connect({.servers = urls});
//   if (!conn.ok()) return conn.status();
//   absl::Status s = (*conn)->EnsureStream(
//       {.name = "OUTBOX", .subjects = {"outbox.>"}, .replicas = 3});
//   auto ack = (*conn)->Publish({.subject = subject, .data = bytes,
//                                .msg_id = event_id,
//                                .expected_last_subject_seq = prev});
//   if (IsWrongLastSequence(ack.status())) { ... }  // the chain moved on
//
// Errors, so that callers can tell the event's fault from the world's:
//   - FailedPrecondition: the broker refused a publish whose expected last
//     subject sequence did not hold (JetStream error 10071); nothing was
//     stored. IsWrongLastSequence() says so. The retry of a publish whose
//     ack was lost (same msg_id, same expectation) is refused so too by a
//     2.9 cluster, which checks the expectation before the msg id: if
//     LastOnSubject() carries this msg_id, the message is in.
//   - DeadlineExceeded: no answer in time (the message may be stored: the
//     same msg_id again is safe within the duplicate window, see above).
//   - Unavailable: no connection, no responders (no stream leader yet, or
//     no stream for the subject), a cluster without quorum.
//   - NotFound: no such stream, consumer or message.
//   - InvalidArgument: a request the broker or the client will never accept
//     (a message above the stream's size limit, a bad name).
// Each message names the call, the client's status text, the JetStream
// error code when there is one, and the broker's own words.
//
// Thread-safety: a Connection may be shared between threads (libnats
// locks internally); a PullConsumer and its Messages belong to one thread.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace outbox::jetstream {

namespace internal {
struct Handles;
struct MsgHandle;
struct SubHandle;
}  // namespace internal

// The JetStream error code of a wrong expected last (subject) sequence.
inline constexpr int kWrongLastSequenceErrCode = 10071;

// Whether `status` is a publish refused because the subject's last
// sequence was not the expected one.
bool IsWrongLastSequence(const absl::Status& status);

// Whether `status` is a publish that no server took ("no responders"): no
// stream binds the subject, its stream has no leader, or the server the
// client reached has not learnt the leader's interest in the subject.
bool IsNoResponders(const absl::Status& status);

struct ConnectOptions {
  // Client URLs, e.g. "nats://127.0.0.1:4222"; the client picks among them
  // and learns the rest of the cluster from the server it reaches.
  std::vector<std::string> servers;
  std::string name = "outbox";  // shown in the server's connection list
  // One TCP connect and handshake per server.
  absl::Duration connect_timeout = absl::Seconds(2);
  // How long a JetStream API call or a publish waits for its answer.
  absl::Duration request_timeout = absl::Seconds(5);
  // After a lost connection: attempts per server and the pause between
  // rounds (-1: for ever, what a service wants; with a limit, the client
  // gives the connection up once it is spent: closed()). A request issued
  // while disconnected fails at once (Unavailable) instead of waiting for
  // the reconnection.
  int max_reconnects = -1;
  absl::Duration reconnect_wait = absl::Milliseconds(250);
  // A silent server is given up after ping_interval * 2.
  absl::Duration ping_interval = absl::Seconds(2);
  // Credentials, at most one kind: a user and password, a token, or a
  // .creds file (a user JWT and its NKey seed, as `nsc` writes it).
  std::string user, password;
  std::string token;
  std::string creds_file;
  // TLS: set ca_file to verify the servers (tls:// URLs or servers that
  // require TLS); cert_file and key_file add a client certificate.
  std::string ca_file, cert_file, key_file;
};

struct StreamOptions {
  std::string name;  // no `.`, `*`, `>` or whitespace
  std::vector<std::string> subjects;
  int replicas = 3;
  // Zero: messages are kept until another limit removes them.
  absl::Duration max_age = absl::ZeroDuration();
  // How long the broker remembers a msg_id to drop its repeats.
  absl::Duration duplicate_window = absl::Minutes(2);
  // Messages kept per subject, the oldest removed first (0: no limit).
  int64_t max_msgs_per_subject = 0;
};

// What a stream's leader reports about the stream.
struct StreamInfo {
  uint64_t messages = 0;
  uint64_t first_seq = 0;
  uint64_t last_seq = 0;
  std::string leader;                 // server name; empty while electing
  std::vector<std::string> replicas;  // the other peers' server names
  std::vector<std::string> current_replicas;  // those caught up
  std::vector<std::string> subjects;          // the stream binds
};

using Headers = std::vector<std::pair<std::string, std::string>>;

struct OutgoingMessage {
  std::string subject;
  std::string data;
  // Sent as Nats-Msg-Id: a second message with the same id within the
  // stream's duplicate window is not stored again (its ack says duplicate,
  // with the first one's sequence). Empty: none.
  std::string msg_id;
  // Sent as Nats-Expected-Last-Subject-Sequence: the broker stores the
  // message only if the subject's last message has this stream sequence
  // (0: the subject has none yet). Unset: no check.
  std::optional<uint64_t> expected_last_subject_seq;
  Headers headers;  // more headers, sent as given
};

struct PublishAck {
  std::string stream;
  uint64_t sequence = 0;   // the stream sequence the message has
  bool duplicate = false;  // an earlier message had the same msg_id
};

// A message as the stream stores it, read back by sequence or subject.
struct StoredMessage {
  std::string subject;
  std::string data;
  uint64_t sequence = 0;
  Headers headers;
  // The first value of `key` (header names match exactly); empty if none.
  std::string Header(const std::string& key) const;
};

// A message fetched from a pull consumer; acknowledge it or not.
class Message {
 public:
  ~Message();
  Message(Message&&) noexcept;
  Message& operator=(Message&&) noexcept;

  const std::string& subject() const { return subject_; }
  const std::string& data() const { return data_; }
  const Headers& headers() const { return headers_; }
  // The first value of `key`; empty if none.
  std::string Header(const std::string& key) const;
  uint64_t stream_seq() const { return stream_seq_; }
  uint64_t consumer_seq() const { return consumer_seq_; }
  // 1 the first time, more on each redelivery.
  uint64_t num_delivered() const { return num_delivered_; }
  // Messages past this one still waiting for the consumer.
  uint64_t num_pending() const { return num_pending_; }
  absl::Time timestamp() const { return timestamp_; }

  // Acknowledges and waits for the server to confirm it (a double ack): on
  // OK the message is not redelivered to this consumer. An error leaves
  // that open; the message may come again.
  absl::Status Ack();
  // Acknowledges without waiting for the server (see PullConsumer::Flush).
  absl::Status AckNoWait();
  // Asks for redelivery after `delay` (at once if zero), before AckWait.
  absl::Status Nak(absl::Duration delay = absl::ZeroDuration());

 private:
  friend class PullConsumer;
  explicit Message(std::unique_ptr<internal::MsgHandle> msg);

  std::unique_ptr<internal::MsgHandle> msg_;
  std::string subject_, data_;
  Headers headers_;
  uint64_t stream_seq_ = 0, consumer_seq_ = 0, num_delivered_ = 0,
           num_pending_ = 0;
  absl::Time timestamp_;
};

struct PullConsumerOptions {
  std::string stream;
  std::string durable;         // the consumer's name; no `.`
  std::string filter_subject;  // empty: every subject of the stream
  // A fetched message not acknowledged within this is delivered again.
  absl::Duration ack_wait = absl::Seconds(30);
  // Deliveries per message before the server stops (-1: no limit).
  int64_t max_deliver = -1;
  // Fetched but unacknowledged messages the server allows at once.
  int64_t max_ack_pending = 1000;
};

// A durable pull consumer: its position and pending acks live in the
// cluster (replicated like its stream), so another process with the same
// durable name carries on where this one stopped.
class PullConsumer {
 public:
  ~PullConsumer();
  PullConsumer(const PullConsumer&) = delete;
  PullConsumer& operator=(const PullConsumer&) = delete;

  // Up to `max` messages, waiting at most `timeout` for the first; an
  // empty vector when none came in time (not an error).
  absl::StatusOr<std::vector<Message>> Fetch(int max, absl::Duration timeout);
  // Waits until the server has everything sent so far (the AckNoWait acks
  // among it): one round trip for a batch of acks.
  absl::Status Flush(absl::Duration timeout);

 private:
  friend class Connection;
  explicit PullConsumer(std::unique_ptr<internal::SubHandle> sub);
  std::unique_ptr<internal::SubHandle> sub_;
};

class Connection {
 public:
  // Connects to one of `options.servers`; Unavailable if none answers.
  static absl::StatusOr<std::unique_ptr<Connection>> Connect(
      const ConnectOptions& options);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Creates the stream, or updates it to `options` when it exists with
  // other settings (2.9 also changes the replica count of an existing
  // stream). A change the server refuses, e.g. of the storage type, is
  // InvalidArgument.
  absl::Status EnsureStream(const StreamOptions& options);
  absl::Status DeleteStream(const std::string& name);
  absl::StatusOr<StreamInfo> GetStreamInfo(const std::string& name);

  // Publishes and waits for the stream's ack (after the replicas' quorum
  // has the message). See the error list at the top.
  absl::StatusOr<PublishAck> Publish(const OutgoingMessage& message);
  // Publishes every message (each as Publish would) without waiting for
  // each ack in turn: their acks come back together, one round trip for
  // the lot. One result per message, in order; a message whose ack did not
  // come within the request timeout is DeadlineExceeded (it may be
  // stored). The messages may be stored in any order: give each subject at
  // most one message per call when their order matters.
  std::vector<absl::StatusOr<PublishAck>> PublishAll(
      const std::vector<OutgoingMessage>& messages);

  // The newest message on `subject` (NotFound when it has none): after a
  // refused compare-and-set, its Nats-Msg-Id tells whether the refused
  // message is in fact already stored.
  absl::StatusOr<StoredMessage> LastOnSubject(const std::string& stream,
                                              const std::string& subject);
  absl::StatusOr<StoredMessage> GetMessage(const std::string& stream,
                                           uint64_t sequence);

  // Creates the durable consumer if needed (or binds to it) and
  // subscribes to it.
  absl::StatusOr<std::unique_ptr<PullConsumer>> PullSubscribe(
      const PullConsumerOptions& options);
  absl::Status DeleteConsumer(const std::string& stream,
                              const std::string& durable);

  // The server this connection is on now ("" while disconnected).
  std::string ConnectedUrl() const;
  // Whether the client gave the connection up (its reconnects spent, or
  // closed): nothing on it works again, connect anew.
  bool closed() const;

 private:
  explicit Connection(std::unique_ptr<internal::Handles> handles,
                      absl::Duration request_timeout);
  std::unique_ptr<internal::Handles> handles_;
  const absl::Duration request_timeout_;
};

}  // namespace outbox::jetstream
