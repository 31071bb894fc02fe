#pragma once
// The flags of a JetStream connection, shared by outbox-relay (its sink)
// and outbox-consumer (its source), also read as OUTBOX_JETSTREAM, ... from
// the environment. --jetstream (the servers) turns JetStream on.
//
//   --jetstream=nats://n1:4222,nats://n2:4222,nats://n3:4222
//   --jetstream_stream=OUTBOX_BILLING --jetstream_subjects=outbox.billing
//   --jetstream_creds=/etc/outbox/nats/user.creds   (or _user/_password,
//                                                   or _token)
//   --jetstream_ca=ca.pem [--jetstream_cert=c.pem --jetstream_key=k.pem]

#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/jetstream.h"

ABSL_DECLARE_FLAG(std::string, jetstream);
ABSL_DECLARE_FLAG(std::string, jetstream_stream);
ABSL_DECLARE_FLAG(std::string, jetstream_subjects);

namespace outbox {

struct JetStreamFlags {
  bool enabled = false;  // --jetstream was given
  jetstream::ConnectOptions connect;
  std::string stream;    // --jetstream_stream, or the default given
  std::string subjects;  // the subject prefix, or the default given
};

// What the flags ask for; InvalidArgument naming the flag for a bad value
// (a URL that is not nats:// or tls://, two kinds of credentials, a file
// that cannot be read, a certificate without its key, a bad prefix).
absl::StatusOr<JetStreamFlags> JetStreamFromFlags(
    absl::string_view client_name, absl::string_view default_stream,
    absl::string_view default_subjects);

// "OUTBOX_BILLING" for "billing": a stream name per subscription.
std::string DefaultStreamFor(absl::string_view subscription);

}  // namespace outbox
