#pragma once
// outboxctl conformance: drives any EventSink (sink.proto), in any
// language, through the delivery protocol's cases and judges each answer
// by the contract: duplicates, events out of order, forks, reused
// positions and ids, malformed events, a chain split across streams, a
// stream cancelled mid-batch, batches and messages over the limits,
// callers without the delivery identity, and the health check an idle
// relay makes. It speaks only the protocol, so it judges what a relay
// would see, never the sink's tables.
//
// Every case uses chains of its own, under fresh random aggregate ids, so
// runs can repeat against the same database. The sink must accept events
// of type "ConformanceProbe" whose payload is a google.protobuf.StringValue
// (outbox-consumer --handler=audit does, as does any handler that records
// what it gets).
//
// Example:
//   ConformanceOptions o;
//   o.sink = "127.0.0.1:50053";
//   ConformanceReport r = RunConformance(o, [](const CaseResult& c) {
//     std::printf("%s\n", c.Line().c_str());
//   });
//   std::printf("%s", r.Summary().c_str());
//   return r.ok() ? 0 : 1;

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/tls.h"
#include "inbox/sink_service.h"

namespace outbox::tools {

struct ConformanceOptions {
  std::string sink;  // HOST:PORT of the EventSink
  // How the relay calls the sink: none for plaintext; else the CA its
  // certificate chains to, and the delivery identity's certificate.
  ClientTlsFiles tls;
  // A certificate of the same CA whose identity the sink must refuse
  // (cert and key; the CA is tls.ca). Empty: the case is skipped.
  std::string wrong_cert, wrong_key;
  absl::Duration timeout = absl::Seconds(10);  // each stream's deadline
  // The largest batch (events) the sink documents; one more must end the
  // stream with INVALID_ARGUMENT. outbox-consumer: 1000.
  int max_batch_events = inbox::kMaxBatchEvents;
  // "outbox-protocol" sent: 2 expects DIVERGED for a reused position, 1
  // REJECTED (what the sink must tell a relay that knows no DIVERGED).
  int protocol = inbox::kProtocolVersion;
  std::string aggregate_type = "conformance";
  std::set<std::string> cases;  // empty: every case
};

// The names of the cases, in the order they run.
const std::vector<std::string>& ConformanceCases();

// OK, or INVALID_ARGUMENT naming the first option, by its outboxctl flag,
// that a run cannot honour.
absl::Status CheckConformanceOptions(const ConformanceOptions& options);

enum class CaseVerdict { kPass, kFail, kSkip };

struct CaseResult {
  std::string name;
  CaseVerdict verdict = CaseVerdict::kFail;
  std::string reason;  // why it failed or was skipped; what held for a pass
  absl::Duration elapsed;
  // "PASS  duplicates  (0.05 s) ...": one line, for people and for grep.
  std::string Line() const;
};

struct ConformanceReport {
  std::string sink;
  std::vector<CaseResult> cases;
  // Set when the sink could not be reached at all (no case ran).
  std::string unreachable;
  bool ok() const;  // reached, and no case failed
  std::string Summary() const;
};

// Runs the cases of `options` (as CheckConformanceOptions accepts them)
// one after another; `on_case`, when set, hears each result as it is
// decided.
ConformanceReport RunConformance(
    const ConformanceOptions& options,
    const std::function<void(const CaseResult&)>& on_case = nullptr);

}  // namespace outbox::tools
