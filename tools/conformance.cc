#include "tools/conformance.h"

#include <google/protobuf/wrappers.pb.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/ids.h"
#include "common/limits.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "outbox/v1/sink.grpc.pb.h"

namespace outbox::tools {
namespace {

using v1::APPLIED;
using v1::DeliveryOutcome;
using v1::DIVERGED;
using v1::DUPLICATE;
using v1::HELD;
using v1::REJECTED;
using Batch = std::vector<v1::Event>;
// The answers the contract allows for one event.
using Allowed = std::set<DeliveryOutcome>;

constexpr char kEventType[] = "ConformanceProbe";

const std::vector<std::string> kCases = {
    "duplicates",      "out-of-order",     "forks",
    "reused-position", "reused-id",        "malformed",
    "split-streams",   "stream-reset",     "oversized-batch",
    "message-size",    "identity-missing", "identity-wrong",
    "health",
};

std::string Name(DeliveryOutcome o) { return v1::DeliveryOutcome_Name(o); }

std::string Names(const Allowed& a) {
  std::vector<std::string> out;
  for (DeliveryOutcome o : a) out.push_back(Name(o));
  return absl::StrJoin(out, " or ");
}

std::string CodeName(grpc::StatusCode c) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  const int i = static_cast<int>(c);
  return i >= 0 && i <= 16 ? kNames[i] : absl::StrCat("code ", i);
}

// How a stream ended, for a verdict: "INVALID_ARGUMENT: events: ...".
std::string Describe(const grpc::Status& s) {
  return absl::StrCat(CodeName(s.error_code()),
                      s.error_message().empty() ? "" : ": ",
                      s.error_message().substr(0, 200));
}

// One delivery stream, held as a relay holds it: batches written in
// order, each answered in order.
class Stream {
 public:
  Stream(v1::EventSink::Stub* stub, absl::Duration timeout, int protocol) {
    ctx_.set_deadline(std::chrono::system_clock::now() +
                      absl::ToChronoMilliseconds(timeout));
    ctx_.AddMetadata(inbox::kProtocolHeader, std::to_string(protocol));
    rw_ = stub->Deliver(&ctx_);
  }
  ~Stream() {
    if (!ended_) {
      ctx_.TryCancel();
      End();
    }
  }

  // Sends `batch` as the next batch; false if the stream is gone.
  bool Write(const Batch& batch) {
    v1::DeliverRequest req;
    req.set_batch_id(++last_batch_id_);
    for (const v1::Event& e : batch) *req.add_events() = e;
    return !ended_ && rw_->Write(req);
  }
  // The next answer, or nothing once the stream ended (then status()).
  std::optional<v1::DeliverResponse> Read() {
    v1::DeliverResponse resp;
    if (!ended_ && rw_->Read(&resp)) return resp;
    End();
    return std::nullopt;
  }
  std::optional<v1::DeliverResponse> Send(const Batch& batch) {
    if (!Write(batch)) {
      End();
      return std::nullopt;
    }
    return Read();
  }
  // Resets the stream, as a relay that dies or gives up does.
  void Cancel() { ctx_.TryCancel(); }
  // Half-closes the stream, as a relay that stops cleanly does, and waits
  // (within the deadline) for the sink to end it.
  const grpc::Status& Close() {
    if (!ended_) rw_->WritesDone();
    End();
    return status_;
  }
  // The status the stream ended with, once Read or Send said it ended.
  const grpc::Status& status() const { return status_; }
  uint64_t last_batch_id() const { return last_batch_id_; }

 private:
  void End() {
    if (ended_) return;
    ended_ = true;
    v1::DeliverResponse ignored;
    while (rw_->Read(&ignored)) {
    }
    status_ = rw_->Finish();
  }

  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::DeliverRequest, v1::DeliverResponse>>
      rw_;
  bool ended_ = false;
  grpc::Status status_;
  uint64_t last_batch_id_ = 0;
};

struct Decision {
  CaseVerdict verdict;
  std::string reason;
};
Decision Pass(std::string why) { return {CaseVerdict::kPass, std::move(why)}; }
Decision Fail(std::string why) { return {CaseVerdict::kFail, std::move(why)}; }
Decision Skip(std::string why) { return {CaseVerdict::kSkip, std::move(why)}; }

// Ends the case with the step's failure, if it failed.
#define STEP(expr)                                  \
  do {                                              \
    if (std::string why_ = (expr); !why_.empty()) { \
      return Fail(std::move(why_));                 \
    }                                               \
  } while (0)

class Runner {
 public:
  explicit Runner(const ConformanceOptions& o) : o_(o) {
    stub_ = Stub(o.tls);
    // What a reused position must get: DIVERGED for a relay that knows it.
    intruder_ = o.protocol >= 2 ? DIVERGED : REJECTED;
  }

  // "" if the sink answers within the timeout, else why not.
  std::string Reach() {
    auto channel = Channel(o_.tls);
    if (channel->WaitForConnected(std::chrono::system_clock::now() +
                                  absl::ToChronoMilliseconds(o_.timeout))) {
      return "";
    }
    return absl::StrCat("cannot reach the sink at ", o_.sink, " within ",
                        absl::FormatDuration(o_.timeout),
                        o_.tls.tls() ? " over TLS (--ca, --cert, --key)"
                                     : " (plaintext; TLS needs --ca)");
  }

  Decision Run(const std::string& name) {
    if (name == "duplicates") return Duplicates();
    if (name == "out-of-order") return OutOfOrder();
    if (name == "forks") return Forks();
    if (name == "reused-position") return ReusedPosition();
    if (name == "reused-id") return ReusedId();
    if (name == "malformed") return Malformed();
    if (name == "split-streams") return SplitStreams();
    if (name == "stream-reset") return StreamReset();
    if (name == "oversized-batch") return OversizedBatch();
    if (name == "message-size") return MessageSize();
    if (name == "identity-missing") return IdentityMissing();
    if (name == "identity-wrong") return IdentityWrong();
    if (name == "health") return Health();
    return Fail("no such case");
  }

 private:
  std::shared_ptr<grpc::Channel> Channel(const ClientTlsFiles& tls) const {
    grpc::ChannelArguments args;
    // Each channel its own connection: a refused identity must not ride
    // on the connection of an admitted one.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(o_.sink, MakeChannelCredentials(tls),
                                     args);
  }
  std::unique_ptr<v1::EventSink::Stub> Stub(const ClientTlsFiles& tls) const {
    return v1::EventSink::NewStub(Channel(tls));
  }
  std::unique_ptr<Stream> Open(v1::EventSink::Stub* stub = nullptr) const {
    return std::make_unique<Stream>(stub != nullptr ? stub : stub_.get(),
                                    o_.timeout, o_.protocol);
  }

  // A chain nobody used before: a fresh random aggregate id.
  std::string NewAggregate(const char* what) const {
    return absl::StrCat("conformance-", what, "-", NewUuid());
  }
  v1::Event Probe(const std::string& aggregate, int64_t seq,
                  int64_t prev_seq) const {
    v1::Event e;
    e.set_event_id(NewUuid());
    e.set_aggregate_type(o_.aggregate_type);
    e.set_aggregate_id(aggregate);
    e.set_seq(seq);
    e.set_prev_seq(prev_seq);
    e.set_event_type(kEventType);
    e.set_schema_version(1);
    ToTimestamp(absl::Now(), e.mutable_occurred_at());
    google::protobuf::StringValue note;
    note.set_value(absl::StrCat("seq ", seq, " of ", aggregate));
    e.mutable_payload()->PackFrom(note);
    return e;
  }
  // `n` linked events of a fresh chain, seq 10, 20, ... after `after`.
  Batch ChainOf(const std::string& aggregate, int n, int64_t after = 0) const {
    Batch out;
    for (int i = 0; i < n; ++i) {
      out.push_back(Probe(aggregate, after + 10 * (i + 1), after + 10 * i));
    }
    return out;
  }

  // "" when `resp` answers `batch` (sent as batch `batch_id`) event by
  // event with an outcome `want` allows; else what differs, led by `step`.
  static std::string Judge(const std::string& step, const Batch& batch,
                           const std::optional<v1::DeliverResponse>& resp,
                           const grpc::Status& ended, uint64_t batch_id,
                           const std::vector<Allowed>& want) {
    if (!resp) {
      return absl::StrCat(step, ": no answer; the stream ended with ",
                          Describe(ended));
    }
    if (resp->batch_id() != batch_id) {
      return absl::StrCat(step, ": the answer names batch ", resp->batch_id(),
                          ", not ", batch_id);
    }
    if (resp->results_size() != static_cast<int>(batch.size())) {
      return absl::StrCat(step, ": ", resp->results_size(), " results for ",
                          batch.size(), " events");
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      const v1::EventResult& r = resp->results(static_cast<int>(i));
      const std::string which =
          absl::StrCat(step, ": event ", i + 1, " of ", batch.size(), " (seq ",
                       batch[i].seq(), ", prev_seq ", batch[i].prev_seq(), ")");
      if (r.event_id() != batch[i].event_id() || r.seq() != batch[i].seq()) {
        return absl::StrCat(which, ": its result names event ", r.event_id(),
                            " seq ", r.seq(), ": results must be in order");
      }
      if (!want[i].count(r.outcome())) {
        return absl::StrCat(which, ": answered ", Name(r.outcome()),
                            r.reason().empty() ? "" : " (" + r.reason() + ")",
                            ", expected ", Names(want[i]));
      }
      if ((r.outcome() == REJECTED || r.outcome() == DIVERGED) &&
          r.reason().empty()) {
        return absl::StrCat(which, ": answered ", Name(r.outcome()),
                            " without a reason");
      }
    }
    return "";
  }
  // Sends `batch` on `s` and judges the answer; `out` gets it.
  std::string Expect(Stream& s, const std::string& step, const Batch& batch,
                     const std::vector<Allowed>& want,
                     v1::DeliverResponse* out = nullptr) const {
    auto resp = s.Send(batch);
    std::string why =
        Judge(step, batch, resp, s.status(), s.last_batch_id(), want);
    if (why.empty() && out != nullptr) *out = *resp;
    return why;
  }
  std::string ExpectAll(Stream& s, const std::string& step, const Batch& batch,
                        DeliveryOutcome want) const {
    return Expect(s, step, batch,
                  std::vector<Allowed>(batch.size(), Allowed{want}));
  }
  // HELD and DIVERGED answers carry the aggregate's applied position.
  static std::string AppliedSeq(const std::string& step,
                                const v1::DeliverResponse& resp, int64_t want) {
    for (const v1::EventResult& r : resp.results()) {
      if ((r.outcome() == HELD || r.outcome() == DIVERGED) &&
          r.applied_seq() != want) {
        return absl::StrCat(step, ": ", Name(r.outcome()), " for seq ", r.seq(),
                            " carries applied_seq ", r.applied_seq(),
                            ", but the aggregate is applied through seq ",
                            want);
      }
    }
    return "";
  }
  // After a batch the sink may have committed in part or whole before its
  // stream was reset: each event APPLIED or DUPLICATE, the DUPLICATEs
  // first (an event applied before its predecessor would be out of order).
  std::string ExpectResent(Stream& s, const std::string& step,
                           const Batch& batch) const {
    auto resp = s.Send(batch);
    std::string why =
        Judge(step, batch, resp, s.status(), s.last_batch_id(),
              std::vector<Allowed>(batch.size(), Allowed{APPLIED, DUPLICATE}));
    if (!why.empty()) return why;
    bool applied = false;
    for (const v1::EventResult& r : resp->results()) {
      if (r.outcome() == APPLIED) applied = true;
      if (r.outcome() == DUPLICATE && applied) {
        return absl::StrCat(step, ": seq ", r.seq(),
                            " is a DUPLICATE after an APPLIED predecessor: "
                            "the cancelled batch was applied out of order");
      }
    }
    return "";
  }
  // The stream must end with one of `codes` and answer nothing.
  static std::string ExpectRefused(Stream& s, const std::string& step,
                                   const Batch& batch,
                                   const std::set<grpc::StatusCode>& codes) {
    std::vector<std::string> names;
    for (grpc::StatusCode c : codes) names.push_back(CodeName(c));
    auto resp = s.Send(batch);
    if (resp) {
      std::vector<std::string> outcomes;
      for (const v1::EventResult& r : resp->results()) {
        outcomes.push_back(Name(r.outcome()));
      }
      return absl::StrCat(step, ": answered ", absl::StrJoin(outcomes, ", "),
                          " instead of ending the stream with ",
                          absl::StrJoin(names, " or "));
    }
    if (!codes.count(s.status().error_code())) {
      return absl::StrCat(step, ": the stream ended with ",
                          Describe(s.status()), ", expected ",
                          absl::StrJoin(names, " or "));
    }
    return "";
  }

  Decision Duplicates() {
    const std::string a = NewAggregate("dup");
    const Batch c = ChainOf(a, 2);
    auto s = Open();
    STEP(Expect(*s, "the same event twice in one batch", {c[0], c[0]},
                {{APPLIED}, {DUPLICATE}}));
    STEP(ExpectAll(*s, "again in a later batch", {c[0]}, DUPLICATE));
    {
      auto t = Open();
      STEP(ExpectAll(*t, "again on another stream", {c[0]}, DUPLICATE));
    }
    STEP(ExpectAll(*s, "its successor", {c[1]}, APPLIED));
    STEP(ExpectAll(*s, "both again", c, DUPLICATE));
    if (const grpc::Status& end = s->Close();
        end.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return Fail(absl::StrCat("the sink did not end a half-closed stream (",
                               Describe(end), ")"));
    }
    return Pass(
        "applied once; DUPLICATE in its batch, a later batch, another stream");
  }

  Decision OutOfOrder() {
    const std::string a = NewAggregate("order");
    const Batch c = ChainOf(a, 5);
    auto s = Open();
    v1::DeliverResponse r;
    STEP(ExpectAll(*s, "the first event", {c[0]}, APPLIED));
    STEP(Expect(*s, "seq 40 and 30 before 20", {c[3], c[2]}, {{HELD}, {HELD}},
                &r));
    STEP(AppliedSeq("seq 40 and 30 before 20", r, 10));
    STEP(ExpectAll(*s, "a held event again", {c[3]}, HELD));
    STEP(ExpectAll(*s, "seq 20, which closes the gap", {c[1]}, APPLIED));
    STEP(ExpectAll(*s, "the held events again", {c[2], c[3]}, DUPLICATE));
    STEP(ExpectAll(*s, "seq 50 (the cursor must be at 40)", {c[4]}, APPLIED));
    // Reversed within one batch: the last applies the whole chain.
    const std::string b = NewAggregate("order-batch");
    const Batch d = ChainOf(b, 4);
    STEP(Expect(*s, "a chain reversed in one batch", {d[2], d[1], d[0]},
                {{HELD, APPLIED}, {HELD, APPLIED}, {APPLIED}}));
    STEP(ExpectAll(*s, "the reversed chain again", {d[0], d[1], d[2]},
                   DUPLICATE));
    STEP(ExpectAll(*s, "its next event", {d[3]}, APPLIED));
    return Pass(
        "HELD with applied_seq until the gap closed, then applied in "
        "order");
  }

  Decision Forks() {
    const std::string a = NewAggregate("fork");
    const Batch c = ChainOf(a, 4);
    const v1::Event link_fork = Probe(a, 31, 20);   // c[2]'s prev_seq
    const v1::Event place_fork = Probe(a, 30, 25);  // c[2]'s seq
    auto s = Open();
    STEP(ExpectAll(*s, "the first event", {c[0]}, APPLIED));
    STEP(ExpectAll(*s, "seq 30 (prev_seq 20) before 20", {c[2]}, HELD));
    STEP(ExpectAll(*s, "another event for prev_seq 20", {link_fork}, REJECTED));
    STEP(ExpectAll(*s, "another event at the held seq 30", {place_fork},
                   REJECTED));
    STEP(ExpectAll(*s, "seq 20", {c[1]}, APPLIED));
    STEP(ExpectAll(*s, "the held seq 30 again (it must have applied)", {c[2]},
                   DUPLICATE));
    STEP(ExpectAll(*s, "seq 40", {c[3]}, APPLIED));
    const std::string b = NewAggregate("fork-batch");
    const Batch d = ChainOf(b, 3);
    STEP(Expect(*s, "a fork within one batch", {d[0], d[2], Probe(b, 31, 20)},
                {{APPLIED}, {HELD}, {REJECTED}}));
    return Pass(
        "a second event for a held link or seq is REJECTED; the "
        "first applies");
  }

  Decision ReusedPosition() {
    const std::string a = NewAggregate("reuse");
    const Batch c = ChainOf(a, 3);
    auto s = Open();
    v1::DeliverResponse r;
    STEP(ExpectAll(*s, "seq 10 and 20", {c[0], c[1]}, APPLIED));
    STEP(ExpectAll(*s, "another event at seq 20", {Probe(a, 20, 10)},
                   intruder_));
    STEP(Expect(*s, "another event at seq 10", {Probe(a, 10, 0)}, {{intruder_}},
                &r));
    if (intruder_ == DIVERGED) STEP(AppliedSeq("seq 10 again", r, 20));
    STEP(ExpectAll(*s, "seq 25 after seq 5 (a chain that left this one)",
                   {Probe(a, 25, 5)}, intruder_));
    STEP(ExpectAll(*s, "the real seq 20 again", {c[1]}, DUPLICATE));
    STEP(ExpectAll(*s, "seq 30", {c[2]}, APPLIED));
    return Pass(absl::StrCat("another event at a passed position is ",
                             Name(intruder_), " (outbox-protocol ", o_.protocol,
                             "); the chain goes on"));
  }

  Decision ReusedId() {
    const std::string a = NewAggregate("id");
    const std::string b = NewAggregate("id-other");
    const Batch c = ChainOf(a, 2);
    auto s = Open();
    STEP(ExpectAll(*s, "seq 10", {c[0]}, APPLIED));
    v1::Event moved = c[1];
    moved.set_event_id(c[0].event_id());
    STEP(ExpectAll(*s, "its event_id again at seq 20", {moved}, REJECTED));
    v1::Event elsewhere = Probe(b, 10, 0);
    elsewhere.set_event_id(c[0].event_id());
    STEP(ExpectAll(*s, "its event_id again in another chain", {elsewhere},
                   REJECTED));
    const Batch d = ChainOf(b, 2);
    v1::Event twice = d[1];
    twice.set_event_id(d[0].event_id());
    STEP(Expect(*s, "one event_id at two seqs of one batch", {d[0], twice},
                {{APPLIED}, {REJECTED}}));
    // At a seq the other chain has passed: DUPLICATE would tell the relay
    // that this event took effect there.
    v1::Event passed = Probe(b, 10, 0);
    passed.set_event_id(c[0].event_id());
    STEP(ExpectAll(*s, "its event_id at a passed seq of another chain",
                   {passed}, REJECTED));
    STEP(ExpectAll(*s, "the real seq 20", {c[1]}, APPLIED));
    return Pass(
        "an applied event_id at another place is REJECTED, also at a passed "
        "seq");
  }

  Decision Malformed() {
    const std::string a = NewAggregate("bad");
    const Batch c = ChainOf(a, 2);
    v1::Event bad_id = Probe(a, 20, 10);
    bad_id.set_event_id("not-a-uuid");
    v1::Event bad_prev = Probe(a, 30, 30);
    v1::Event no_aggregate = Probe("", 10, 0);
    v1::Event no_type = Probe(a, 20, 10);
    no_type.clear_event_type();
    v1::Event bad_seq = Probe(a, -5, 0);
    auto s = Open();
    STEP(Expect(*s, "one good event and five malformed ones",
                {c[0], bad_id, bad_prev, no_aggregate, no_type, bad_seq},
                {{APPLIED},
                 {REJECTED},
                 {REJECTED},
                 {REJECTED},
                 {REJECTED},
                 {REJECTED}}));
    STEP(ExpectAll(*s, "seq 20 (nothing malformed moved the cursor)", {c[1]},
                   APPLIED));
    return Pass(
        "a bad event_id, prev_seq, aggregate_id, event_type or seq is "
        "REJECTED with a reason");
  }

  Decision SplitStreams() {
    const std::string a = NewAggregate("streams");
    const Batch c = ChainOf(a, 3);
    auto s1 = Open();
    auto s2 = Open();
    STEP(ExpectAll(*s1, "stream 1: seq 20", {c[1]}, HELD));
    STEP(ExpectAll(*s2, "stream 2: seq 10", {c[0]}, APPLIED));
    STEP(ExpectAll(*s1, "stream 1: seq 30", {c[2]}, APPLIED));
    STEP(ExpectAll(*s2, "stream 2: seq 20 and 30 again", {c[1], c[2]},
                   DUPLICATE));
    // One chain's batches on two streams at once, as two relays after a
    // rebalance: the sink must serialize them per aggregate.
    const std::string b = NewAggregate("streams-race");
    const Batch d = ChainOf(b, 41);
    std::vector<Batch> parts(4);
    for (int i = 0; i < 40; ++i) parts[i / 10].push_back(d[i]);
    auto t1 = Open();
    auto t2 = Open();
    if (!t1->Write(parts[1]) || !t2->Write(parts[0]) || !t1->Write(parts[3]) ||
        !t2->Write(parts[2])) {
      return Fail("concurrent streams: a stream ended while writing");
    }
    const Allowed either = {APPLIED, HELD};
    for (int k = 0; k < 4; ++k) {
      Stream& t = k % 2 == 0 ? *t1 : *t2;
      const int part = k % 2 == 0 ? 1 + (k / 2) * 2 : (k / 2) * 2;
      auto resp = t.Read();
      STEP(Judge(
          absl::StrCat("concurrent streams: batch of seq ",
                       parts[part][0].seq(), "-", parts[part].back().seq()),
          parts[part], resp, t.status(), 1 + k / 2,
          std::vector<Allowed>(10, either)));
    }
    const Batch first40(d.begin(), d.begin() + 40);
    STEP(ExpectAll(*s1, "after the race: all 40 again (each must be applied)",
                   first40, DUPLICATE));
    STEP(ExpectAll(*s2, "after the race: seq 410", {d[40]}, APPLIED));
    return Pass(
        "held and applied state is shared by streams, also "
        "concurrent ones");
  }

  Decision StreamReset() {
    const std::string a = NewAggregate("reset");
    const Batch c = ChainOf(a, 201);
    const Batch b1(c.begin(), c.begin() + 100),
        b2(c.begin() + 100, c.begin() + 200);
    {
      auto s = Open();
      if (!s->Write(b1) || !s->Write(b2)) {
        return Fail("the stream ended while writing two batches");
      }
      auto resp = s->Read();
      STEP(Judge("batch 1 of 2", b1, resp, s->status(), 1,
                 std::vector<Allowed>(b1.size(), Allowed{APPLIED})));
      s->Cancel();  // while batch 2 is on its way or being applied
    }
    auto t = Open();
    STEP(ExpectResent(*t, "batch 2, resent after the reset", b2));
    STEP(ExpectAll(*t, "batch 1, resent", b1, DUPLICATE));
    STEP(ExpectAll(*t, "the next event", {c[200]}, APPLIED));
    // Reset before any answer.
    const std::string b = NewAggregate("reset-early");
    const Batch d = ChainOf(b, 51);
    const Batch d1(d.begin(), d.begin() + 50);
    {
      auto s = Open();
      if (!s->Write(d1)) return Fail("the stream ended while writing");
      s->Cancel();
    }
    STEP(
        ExpectResent(*t, "a batch resent after a reset before its answer", d1));
    STEP(ExpectAll(*t, "its next event", {d[50]}, APPLIED));
    return Pass("a batch cut off by a reset is applied once when resent");
  }

  Decision OversizedBatch() {
    const int max = o_.max_batch_events;
    auto s = Open();
    STEP(ExpectAll(*s, absl::StrCat("a batch of ", max, " events"),
                   ChainOf(NewAggregate("full"), max), APPLIED));
    const Batch over = ChainOf(NewAggregate("over"), max + 1);
    STEP(ExpectRefused(*s, absl::StrCat("a batch of ", max + 1, " events"),
                       over, {grpc::StatusCode::INVALID_ARGUMENT}));
    auto t = Open();
    STEP(ExpectAll(*t, "the refused batch's first event (none applied)",
                   {over[0]}, APPLIED));
    return Pass(absl::StrCat(max, " events applied; ", max + 1,
                             " end the stream with INVALID_ARGUMENT, "
                             "nothing applied"));
  }

  Decision MessageSize() {
    auto s = Open();
    v1::Event large = Probe(NewAggregate("large"), 10, 0);
    google::protobuf::StringValue fill;
    // The largest event a relay sends (common/limits.h), less its envelope.
    fill.set_value(std::string(kMaxEventBytes - (4 << 10), 'x'));
    large.mutable_payload()->PackFrom(fill);
    STEP(ExpectAll(
        *s, absl::StrCat("an event of ", large.ByteSizeLong() >> 10, " KiB"),
        {large}, APPLIED));
    v1::Event huge = Probe(NewAggregate("huge"), 10, 0);
    fill.set_value(std::string(kMaxDeliverMessageBytes + 1, 'x'));
    v1::Event small = huge;
    huge.mutable_payload()->PackFrom(fill);
    STEP(ExpectRefused(*s, "a message over 4 MiB", {huge},
                       {grpc::StatusCode::RESOURCE_EXHAUSTED}));
    auto t = Open();
    STEP(ExpectAll(*t, "the same event, small (none applied)", {small},
                   APPLIED));
    return Pass(absl::StrCat(
        "a ", large.ByteSizeLong() >> 10,
        " KiB event applied; a message over 4 MiB is RESOURCE_EXHAUSTED"));
  }

  // A caller without the delivery identity: the stream must end with no
  // answer and nothing applied.
  Decision Refused(const ClientTlsFiles& who, const char* what,
                   const std::set<grpc::StatusCode>& codes) {
    const Batch c = ChainOf(NewAggregate("identity"), 1);
    auto stub = Stub(who);
    {
      auto s = Open(stub.get());
      STEP(ExpectRefused(*s, what, c, codes));
    }
    auto s = Open();
    STEP(
        ExpectAll(*s, "the same event from the delivery identity", c, APPLIED));
    return Pass(absl::StrCat(what, ": refused, nothing applied"));
  }

  Decision IdentityMissing() {
    if (!o_.tls.tls()) {
      return Skip("plaintext (no --ca): the sink admits every caller");
    }
    // Under mutual TLS the handshake itself may refuse (UNAVAILABLE).
    return Refused(
        {o_.tls.ca, "", ""}, "a caller without a certificate",
        {grpc::StatusCode::UNAUTHENTICATED, grpc::StatusCode::PERMISSION_DENIED,
         grpc::StatusCode::UNAVAILABLE});
  }

  Decision IdentityWrong() {
    if (!o_.tls.tls()) {
      return Skip("plaintext (no --ca): the sink admits every caller");
    }
    if (o_.wrong_cert.empty()) {
      return Skip("no --wrong_cert: give one of an identity the sink refuses");
    }
    return Refused({o_.tls.ca, o_.wrong_cert, o_.wrong_key},
                   "a caller with another identity (--wrong_cert)",
                   {grpc::StatusCode::PERMISSION_DENIED,
                    grpc::StatusCode::UNAUTHENTICATED});
  }

  // An idle relay probes the sink's health (relay --consumer_unready_after):
  // a sink that does not answer SERVING for the EventSink service makes
  // the relay unready, and it gives up its partitions.
  Decision Health() {
    auto stub = grpc::health::v1::Health::NewStub(Channel(o_.tls));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     absl::ToChronoMilliseconds(o_.timeout));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(v1::EventSink::service_full_name());
    grpc::health::v1::HealthCheckResponse resp;
    const grpc::Status s = stub->Check(&ctx, req, &resp);
    if (!s.ok()) {
      return Fail(absl::StrCat(
          "grpc.health.v1.Health/Check of ", v1::EventSink::service_full_name(),
          ": ", Describe(s), "; an idle relay takes the sink for down"));
    }
    if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
      return Fail(absl::StrCat(
          "grpc.health.v1.Health/Check of ", v1::EventSink::service_full_name(),
          " answers ",
          grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
              resp.status())));
    }
    return Pass(absl::StrCat("grpc.health.v1 says ",
                             v1::EventSink::service_full_name(),
                             " is SERVING"));
  }

  const ConformanceOptions& o_;
  std::unique_ptr<v1::EventSink::Stub> stub_;
  DeliveryOutcome intruder_;
};

#undef STEP

}  // namespace

const std::vector<std::string>& ConformanceCases() { return kCases; }

absl::Status CheckConformanceOptions(const ConformanceOptions& o) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(parts...));
  };
  if (o.sink.empty()) {
    return bad("--sink: the EventSink to test is required (HOST:PORT)");
  }
  if (o.sink.find(':') == std::string::npos ||
      o.sink.find_first_of(" \t\n") != std::string::npos) {
    return bad("--sink must be HOST:PORT, not \"", o.sink, "\"");
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return bad("--timeout must be positive, not ",
               absl::FormatDuration(o.timeout));
  }
  if (o.max_batch_events < 1 || o.max_batch_events > 10000) {
    return bad("--max_batch_events must be within [1, 10000], not ",
               o.max_batch_events);
  }
  if (o.protocol != 1 && o.protocol != 2) {
    return bad("--protocol must be 1 or 2, not ", o.protocol);
  }
  if (o.aggregate_type.empty() || o.aggregate_type.size() > 64) {
    return bad("--aggregate_type must be 1-64 bytes");
  }
  for (const std::string& c : o.cases) {
    if (std::find(kCases.begin(), kCases.end(), c) == kCases.end()) {
      return bad("--cases: no case \"", c, "\"; the cases are ",
                 absl::StrJoin(kCases, ", "));
    }
  }
  if (o.wrong_cert.empty() != o.wrong_key.empty()) {
    return bad("--wrong_cert and --wrong_key go together");
  }
  if (!o.wrong_cert.empty()) {
    if (!o.tls.tls()) return bad("--wrong_cert needs --ca (TLS)");
    if (absl::Status s =
            CheckClientTls({o.tls.ca, o.wrong_cert, o.wrong_key},
                           {"--ca", "--wrong_cert", "--wrong_key"});
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

std::string CaseResult::Line() const {
  const char* v = verdict == CaseVerdict::kPass   ? "PASS"
                  : verdict == CaseVerdict::kSkip ? "SKIP"
                                                  : "FAIL";
  // One line, whatever the sink put in its messages.
  std::string text = reason;
  std::replace(text.begin(), text.end(), '\n', ' ');
  return absl::StrFormat("%s  %-16s %6.2f s  %s", v, name,
                         absl::ToDoubleSeconds(elapsed), text);
}

bool ConformanceReport::ok() const {
  if (!unreachable.empty()) return false;
  for (const CaseResult& c : cases) {
    if (c.verdict == CaseVerdict::kFail) return false;
  }
  return true;
}

std::string ConformanceReport::Summary() const {
  if (!unreachable.empty()) return absl::StrCat("FAIL: ", unreachable, "\n");
  int pass = 0, skip = 0;
  std::vector<std::string> failed;
  for (const CaseResult& c : cases) {
    if (c.verdict == CaseVerdict::kPass) ++pass;
    if (c.verdict == CaseVerdict::kSkip) ++skip;
    if (c.verdict == CaseVerdict::kFail) failed.push_back(c.name);
  }
  return absl::StrCat(
      "conformance of ", sink, ": ", pass, " passed, ", failed.size(),
      " failed, ", skip, " skipped",
      failed.empty()
          ? ""
          : absl::StrCat(" (failed: ", absl::StrJoin(failed, ", "), ")"),
      "\n");
}

ConformanceReport RunConformance(
    const ConformanceOptions& options,
    const std::function<void(const CaseResult&)>& on_case) {
  ConformanceReport report;
  report.sink = options.sink;
  Runner runner(options);
  report.unreachable = runner.Reach();
  if (!report.unreachable.empty()) return report;
  for (const std::string& name : kCases) {
    if (!options.cases.empty() && !options.cases.count(name)) continue;
    const absl::Time t0 = absl::Now();
    Decision d = runner.Run(name);
    CaseResult r{name, d.verdict, std::move(d.reason), absl::Now() - t0};
    if (on_case) on_case(r);
    report.cases.push_back(std::move(r));
  }
  return report;
}

}  // namespace outbox::tools
