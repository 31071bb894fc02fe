// outboxctl: operate and exercise the outbox from a terminal.
//
//   outboxctl stats                      relay and consumer state
//   outboxctl dead-letters [--aggregate ID] [--limit N]
//   outboxctl requeue EVENT_ID | --aggregate ID | --all-dead
//                     [--since DURATION] [--error SUBSTRING]
//   outboxctl show EVENT_ID              one outbox row, decoded
//   outboxctl load --orders N --concurrency C [--only create|pay|cancel|get]
//                  [--rate CALLS_PER_S] [--duration D] [--format json]
//                  [--max_tries N] [--idempotency_keys=false]
//   outboxctl verify --orders_db URL --billing_db URL [--wait 60s]
//   outboxctl demo --orders N ...        load, then verify, with a summary
//   outboxctl reconcile --orders_db URL --billing_db URL [--window 1h]
//                     [--grace 5m]         events committed, not applied: why
//   outboxctl replay --event ID | --aggregate ID | --from_seq N [--to_seq M]
//                    | --since D [--until D]   owe retained events again
//   outboxctl diverged [--all]           aggregates whose histories diverged
//   outboxctl resolve --aggregate ID | --all [--parallel N] --reason TEXT
//                                        adopt the producer's history for a
//                                        diverged aggregate (or every one)
//   outboxctl conformance --sink HOST:PORT [--cases a,b] [--wrong_cert F
//                     --wrong_key F]     drive any EventSink through the
//                                        delivery protocol's cases
//   outboxctl partition-outbox [--span N] [--ahead K] [--span_time D]
//                                        partition the outbox by seq range:
//                                        retention then drops whole children
//
// verify, demo and reconcile take each database's password from
// OUTBOX_ORDERS_PASSWORD and OUTBOX_BILLING_PASSWORD (--orders_password,
// --billing_password) if set, else from PGPASSWORD (one for both).
//
// stats, dead-letters, requeue and show act on the relay's subscription, or
// on another one with --subscription NAME.

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/config.h"
#include "common/db.h"
#include "common/db_flags.h"
#include "common/ids.h"
#include "common/schema.h"
#include "common/tls.h"
#include "outbox/v1/billing.grpc.pb.h"
#include "outbox/v1/relay.grpc.pb.h"
#include "tools/checker.h"
#include "tools/conformance.h"
#include "tools/load.h"
#include "tools/reconcile.h"

ABSL_FLAG(std::string, producer, "127.0.0.1:50051", "Producer address.");
ABSL_FLAG(std::string, relay, "127.0.0.1:50052", "Relay admin address.");
ABSL_FLAG(std::string, consumer, "127.0.0.1:50053", "Consumer address.");
ABSL_FLAG(std::string, orders_db, "postgresql://127.0.0.1:5432/outbox_orders",
          "Orders database (verify, demo, reconcile); its password from "
          "OUTBOX_ORDERS_PASSWORD if set, else PGPASSWORD.");
ABSL_FLAG(std::string, billing_db, "postgresql://127.0.0.1:5432/outbox_billing",
          "Billing database (verify, demo, reconcile); its password from "
          "OUTBOX_BILLING_PASSWORD if set, else PGPASSWORD.");
ABSL_FLAG(std::string, orders_password, "",
          "Password of --orders_db, over PGPASSWORD (set it as "
          "OUTBOX_ORDERS_PASSWORD: a command line is visible to others).");
ABSL_FLAG(std::string, billing_password, "",
          "Password of --billing_db, over PGPASSWORD (set it as "
          "OUTBOX_BILLING_PASSWORD: a command line is visible to others).");
ABSL_FLAG(std::string, aggregate, "", "Aggregate id (dead-letters, requeue).");
ABSL_FLAG(std::string, aggregate_type, "",
          "With --aggregate (replay, resolve): that type's chain of the id "
          "only; conformance: the type of its events (empty: conformance).");
ABSL_FLAG(bool, all_dead, false, "requeue: every dead letter (--all-dead).");
ABSL_FLAG(absl::Duration, since, absl::ZeroDuration(),
          "requeue: only dead letters that died within this long (e.g. 1h); "
          "replay: events committed within this long.");
ABSL_FLAG(std::string, error, "",
          "requeue: only dead letters whose last_error contains this text.");
ABSL_FLAG(int, limit, 100, "Rows to list.");
ABSL_FLAG(int64_t, after_seq, 0,
          "dead-letters: only those above this seq (the next page).");
ABSL_FLAG(int, orders, 100, "Orders to create (load, demo).");
ABSL_FLAG(int, concurrency, 8, "Client threads (load, demo).");
ABSL_FLAG(int, connections, 0,
          "load, demo: connections to the producer, shared by the client "
          "threads (0: one per thread).");
ABSL_FLAG(double, pay_fraction, 0.7, "Share of orders paid (load, demo).");
ABSL_FLAG(double, cancel_fraction, 0.3, "Share of orders cancelled.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the load's random choices.");
ABSL_FLAG(absl::Duration, wait, absl::Seconds(120),
          "How long verify waits for the backlog to drain.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "Per-call deadline.");
ABSL_FLAG(absl::Duration, duration, absl::ZeroDuration(),
          "load: start no new order after this long (0: run to --orders).");
ABSL_FLAG(std::string, format, "text",
          "verify, load, reconcile: text or json.");
ABSL_FLAG(absl::Duration, window, absl::Hours(1),
          "reconcile: events committed within this long.");
ABSL_FLAG(absl::Duration, grace, absl::Minutes(5),
          "reconcile: ... except the last this long, which may still be on "
          "their way.");
ABSL_FLAG(std::string, only, "",
          "load: one call alone: create (CreateOrder only), pay, cancel or "
          "get (first creates --orders orders, not counted, then pays, "
          "cancels or reads them); empty: the mix of --pay_fraction and "
          "--cancel_fraction.");
ABSL_FLAG(int, max_tries, 20,
          "load, demo: tries of each call before the operation gives up (1: "
          "no retry).");
ABSL_FLAG(bool, idempotency_keys, true,
          "load, demo: send an idempotency key with each CreateOrder (false: "
          "a client that cannot retry safely; use with --max_tries=1).");
ABSL_FLAG(double, rate, 0,
          "load: calls started per second at most, all clients together "
          "(0: as fast as they go).");
ABSL_FLAG(std::string, subscription, "",
          "stats, dead-letters, requeue, show: the subscription to act on "
          "(empty: the one the relay delivers, its --subscription).");
ABSL_FLAG(int64_t, from_seq, 0, "replay: the first seq owed again.");
ABSL_FLAG(int64_t, to_seq, 0, "replay: the last seq owed again (0: open).");
ABSL_FLAG(absl::Duration, until, absl::ZeroDuration(),
          "replay with --since: only events committed more than this long "
          "ago (0: up to now).");
ABSL_FLAG(std::string, event, "", "replay: one event, by its event_id.");
ABSL_FLAG(bool, all, false,
          "diverged: resolved ones too; resolve: every open divergence.");
ABSL_FLAG(int64_t, span, 1000000,
          "partition-outbox: seqs per child of the partitioned outbox (with "
          "--span_time, the least); a child goes whole, once all its events "
          "may (so they outlive --retention by up to the time the writers "
          "take to fill one).");
ABSL_FLAG(absl::Duration, span_time, absl::ZeroDuration(),
          "partition-outbox: size each child made to hold what the writers "
          "draw in this long, at the rate seen since the one before (at "
          "least --span, at most 100 times it); 0: --span each. A fraction "
          "of the relays' --retention.");
ABSL_FLAG(int, ahead, 2,
          "partition-outbox: children the relay keeps made ahead of the "
          "sequence.");
ABSL_FLAG(int, parallel, 4,
          "resolve --all: aggregates resolved at once (1-64); each is a "
          "rewind at the consumer and a transaction at the outbox.");
ABSL_FLAG(std::string, reason, "",
          "resolve: why the producer's history is adopted; held release, "
          "held skip, subscriptions pause|resume|drop|log|rows: why (recorded "
          "with your identity).");
ABSL_FLAG(bool, force, false,
          "subscriptions drop: even while relays deliver it.");
ABSL_FLAG(bool, failed, false,
          "held: only events whose effect failed as they drained.");
ABSL_FLAG(std::string, ca, "",
          "PEM CA bundle the servers' certificates must chain to: call every "
          "address with TLS.");
ABSL_FLAG(std::string, cert, "",
          "PEM client certificate to present (mutual TLS), with --key.");
ABSL_FLAG(std::string, key, "", "PEM private key of --cert.");
ABSL_FLAG(std::string, sink, "",
          "conformance: the EventSink to test, HOST:PORT (TLS with --ca; "
          "--cert/--key: the delivery identity, the relay's).");
ABSL_FLAG(std::string, cases, "",
          "conformance: comma-separated cases to run (empty: all).");
ABSL_FLAG(int, max_batch_events, outbox::inbox::kMaxBatchEvents,
          "conformance: the largest batch the sink documents (events); one "
          "more must end the stream INVALID_ARGUMENT.");
ABSL_FLAG(int, protocol, outbox::inbox::kProtocolVersion,
          "conformance: the outbox-protocol to announce: 2 expects DIVERGED "
          "for a reused position, 1 REJECTED.");
ABSL_FLAG(std::string, wrong_cert, "",
          "conformance: a PEM client certificate of --ca's whose identity "
          "the sink must refuse to deliver from, with --wrong_key.");
ABSL_FLAG(std::string, wrong_key, "", "PEM private key of --wrong_cert.");

namespace {

using outbox::v1::BillingQuery;
using outbox::v1::RelayAdmin;

outbox::ClientTlsFiles TlsFromFlags() {
  return {absl::GetFlag(FLAGS_ca), absl::GetFlag(FLAGS_cert),
          absl::GetFlag(FLAGS_key)};
}

std::shared_ptr<grpc::Channel> Channel(const std::string& target) {
  return grpc::CreateChannel(target,
                             outbox::MakeChannelCredentials(TlsFromFlags()));
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_timeout)));
}

int Fail(const std::string& what, const grpc::Status& s) {
  std::fprintf(stderr, "outboxctl: %s: %s (%d)\n", what.c_str(),
               s.error_message().c_str(), s.error_code());
  return 1;
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "outboxctl: %s: %s\n", what.c_str(),
               std::string(s.message()).c_str());
  return 1;
}

// A database URL with the password of its own flag, if set: PGPASSWORD is
// one for both databases, and their roles may differ.
std::string OrdersDb() {
  return outbox::WithPassword(absl::GetFlag(FLAGS_orders_db),
                              absl::GetFlag(FLAGS_orders_password));
}
std::string BillingDb() {
  return outbox::WithPassword(absl::GetFlag(FLAGS_billing_db),
                              absl::GetFlag(FLAGS_billing_password));
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, opts);
  return out;
}

int Stats() {
  int rc = 0;
  {
    auto stub = RelayAdmin::NewStub(Channel(absl::GetFlag(FLAGS_relay)));
    grpc::ClientContext ctx;
    Deadline(&ctx);
    outbox::v1::GetRelayStatsRequest req;
    req.set_subscription(absl::GetFlag(FLAGS_subscription));
    outbox::v1::RelayStats s;
    grpc::Status st = stub->GetStats(&ctx, req, &s);
    if (st.ok()) {
      std::printf(
          "relay %s (%s), subscription %s\n  pending %lld, oldest %.1f s, dead "
          "letters %lld, "
          "delivered %lld, diverged aggregates %lld\n  partitions owned %d of "
          "%d, in flight %lld, stream %s%s%s%s%s\n  consumer database %s\n  "
          "this process: delivered %lld, rejected %lld\n",
          s.replica_id().c_str(), absl::GetFlag(FLAGS_relay).c_str(),
          s.subscription().c_str(), static_cast<long long>(s.pending()),
          s.oldest_pending_seconds(), static_cast<long long>(s.dead_letters()),
          static_cast<long long>(s.delivered_total()),
          static_cast<long long>(s.diverged()), s.partitions_owned_size(),
          s.partitions_total(), static_cast<long long>(s.in_flight()),
          s.stream_connected() ? "connected" : "down",
          s.paused_reason().empty() ? "" : "\n  PAUSED: ",
          s.paused_reason().c_str(),
          s.heal_due().empty() ? "" : "\n  HEAL DUE: ", s.heal_due().c_str(),
          s.consumer_database().empty() ? "not seen yet"
                                        : s.consumer_database().c_str(),
          static_cast<long long>(s.delivered_by_process()),
          static_cast<long long>(s.rejected_by_process()));
    } else {
      rc = Fail("relay stats", st);
    }
  }
  {
    auto stub = BillingQuery::NewStub(Channel(absl::GetFlag(FLAGS_consumer)));
    grpc::ClientContext ctx;
    Deadline(&ctx);
    outbox::v1::ConsumerStats s;
    grpc::Status st = stub->GetStats(&ctx, {}, &s);
    if (st.ok()) {
      std::printf(
          "consumer (%s)\n  applied %lld, held %lld (oldest %.1f s), "
          "aggregates %lld\n  this process: applied %lld, duplicates %lld, "
          "held %lld, rejected %lld\n",
          absl::GetFlag(FLAGS_consumer).c_str(),
          static_cast<long long>(s.applied()), static_cast<long long>(s.held()),
          s.oldest_held_seconds(), static_cast<long long>(s.aggregates()),
          static_cast<long long>(s.applied_by_process()),
          static_cast<long long>(s.duplicates_by_process()),
          static_cast<long long>(s.held_by_process()),
          static_cast<long long>(s.rejected_by_process()));
    } else {
      rc = Fail("consumer stats", st);
    }
  }
  return rc;
}

int DeadLetters() {
  auto stub = RelayAdmin::NewStub(Channel(absl::GetFlag(FLAGS_relay)));
  grpc::ClientContext ctx;
  Deadline(&ctx);
  outbox::v1::ListDeadLettersRequest req;
  req.set_limit(absl::GetFlag(FLAGS_limit));
  req.set_subscription(absl::GetFlag(FLAGS_subscription));
  req.set_aggregate_id(absl::GetFlag(FLAGS_aggregate));
  req.set_after_seq(absl::GetFlag(FLAGS_after_seq));
  outbox::v1::ListDeadLettersResponse resp;
  grpc::Status st = stub->ListDeadLetters(&ctx, req, &resp);
  if (!st.ok()) return Fail("dead-letters", st);
  if (resp.rows().empty()) std::printf("no dead letters\n");
  for (const auto& row : resp.rows()) {
    std::printf("%s  seq %lld  %s %s  attempts %d\n    %s\n",
                row.event().event_id().c_str(),
                static_cast<long long>(row.event().seq()),
                row.event().event_type().c_str(),
                row.event().aggregate_id().c_str(), row.attempts(),
                row.last_error().c_str());
  }
  if (resp.more() && !resp.rows().empty()) {
    std::printf(
        "more: outboxctl dead-letters --after_seq %lld\n",
        static_cast<long long>(resp.rows(resp.rows_size() - 1).event().seq()));
  }
  return 0;
}

int Requeue(const std::vector<char*>& args) {
  outbox::v1::RequeueRequest req;
  if (args.size() > 2) req.set_event_id(args[2]);
  req.set_aggregate_id(absl::GetFlag(FLAGS_aggregate));
  req.set_all_dead(absl::GetFlag(FLAGS_all_dead));
  req.set_subscription(absl::GetFlag(FLAGS_subscription));
  req.set_error_contains(absl::GetFlag(FLAGS_error));
  if (absl::GetFlag(FLAGS_since) > absl::ZeroDuration()) {
    outbox::ToTimestamp(absl::Now() - absl::GetFlag(FLAGS_since),
                        req.mutable_died_after());
  }
  auto stub = RelayAdmin::NewStub(Channel(absl::GetFlag(FLAGS_relay)));
  grpc::ClientContext ctx;
  Deadline(&ctx);
  outbox::v1::RequeueResponse resp;
  grpc::Status st = stub->Requeue(&ctx, req, &resp);
  if (!st.ok()) return Fail("requeue", st);
  std::printf("requeued %lld dead letter%s\n",
              static_cast<long long>(resp.requeued()),
              resp.requeued() == 1 ? "" : "s");
  return 0;
}

int Show(const std::vector<char*>& args) {
  if (args.size() < 3) {
    std::fprintf(stderr, "usage: outboxctl show EVENT_ID\n");
    return 2;
  }
  auto stub = RelayAdmin::NewStub(Channel(absl::GetFlag(FLAGS_relay)));
  grpc::ClientContext ctx;
  Deadline(&ctx);
  outbox::v1::GetEventRequest req;
  req.set_event_id(args[2]);
  req.set_subscription(absl::GetFlag(FLAGS_subscription));
  outbox::v1::OutboxRow row;
  grpc::Status st = stub->GetEvent(&ctx, req, &row);
  if (!st.ok()) return Fail("show", st);
  std::printf("%s\n", Json(row).c_str());
  return 0;
}

int ReplayCommand() {
  outbox::v1::ReplayRequest req;
  req.set_subscription(absl::GetFlag(FLAGS_subscription));
  req.set_event_id(absl::GetFlag(FLAGS_event));
  req.set_aggregate_id(absl::GetFlag(FLAGS_aggregate));
  req.set_aggregate_type(absl::GetFlag(FLAGS_aggregate_type));
  req.set_from_seq(absl::GetFlag(FLAGS_from_seq));
  req.set_to_seq(absl::GetFlag(FLAGS_to_seq));
  if (absl::GetFlag(FLAGS_since) > absl::ZeroDuration()) {
    outbox::ToTimestamp(absl::Now() - absl::GetFlag(FLAGS_since),
                        req.mutable_since());
    if (absl::GetFlag(FLAGS_until) > absl::ZeroDuration()) {
      outbox::ToTimestamp(absl::Now() - absl::GetFlag(FLAGS_until),
                          req.mutable_until());
    }
  } else if (absl::GetFlag(FLAGS_until) != absl::ZeroDuration()) {
    std::fprintf(stderr, "outboxctl: replay: --until needs --since\n");
    return 2;
  }
  auto stub = RelayAdmin::NewStub(Channel(absl::GetFlag(FLAGS_relay)));
  grpc::ClientContext ctx;
  Deadline(&ctx);
  outbox::v1::ReplayResponse resp;
  grpc::Status st = stub->Replay(&ctx, req, &resp);
  if (!st.ok()) return Fail("replay", st);
  std::printf(
      "replay: %lld retained events matched, %lld owed again (the rest were "
      "pending already); the consumer answers DUPLICATE for what it has\n",
      static_cast<long long>(resp.matched()),
      static_cast<long long>(resp.owed()));
  return 0;
}

std::string Time(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0 && t.nanos() == 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", outbox::FromTimestamp(t),
                          absl::UTCTimeZone());
}

void PrintDivergence(const outbox::v1::Divergence& d) {
  std::printf("%s%s%s  %s  detected %s\n    %s\n", d.aggregate_type().c_str(),
              d.aggregate_type().empty() ? "" : " ", d.aggregate_id().c_str(),
              d.kind().c_str(), Time(d.detected_at()).c_str(),
              d.detail().c_str());
  if (d.has_resolved_at()) {
    std::printf("    resolved %s by %s: %s\n", Time(d.resolved_at()).c_str(),
                d.resolved_by().c_str(), d.resolution().c_str());
  }
}

// The --subscription's divergences, `limit` at most; the resolved ones too
// when `include_resolved`.
grpc::Status ListDivergences(RelayAdmin::Stub* stub, bool include_resolved,
                             int limit,
                             outbox::v1::ListDivergencesResponse* resp) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  outbox::v1::ListDivergencesRequest req;
  req.set_subscription(absl::GetFlag(FLAGS_subscription));
  req.set_include_resolved(include_resolved);
  req.set_limit(limit);
  return stub->ListDivergences(&ctx, req, resp);
}

// Exit 0: nothing diverged (open); 1: some are (listed).
int Diverged() {
  auto stub = RelayAdmin::NewStub(Channel(absl::GetFlag(FLAGS_relay)));
  outbox::v1::ListDivergencesResponse resp;
  grpc::Status st = ListDivergences(stub.get(), absl::GetFlag(FLAGS_all),
                                    absl::GetFlag(FLAGS_limit), &resp);
  if (!st.ok()) return Fail("diverged", st);
  int open = 0;
  for (const auto& d : resp.divergences()) {
    PrintDivergence(d);
    open += d.has_resolved_at() ? 0 : 1;
  }
  if (absl::GetFlag(FLAGS_format) == "json") {
    std::printf("%s\n", Json(resp).c_str());
  }
  std::printf(
      "%d diverged aggregate%s waiting for a decision (outboxctl "
      "resolve --aggregate ID --reason TEXT)\n",
      open, open == 1 ? "" : "s");
  return open == 0 ? 0 : 1;
}

// Resolves one aggregate's divergence into `closed`.
grpc::Status ResolveOne(RelayAdmin::Stub* stub, const std::string& type,
                        const std::string& aggregate,
                        outbox::v1::Divergence* closed) {
  grpc::ClientContext ctx;
  // A rewind walks the aggregate's history at both ends.
  ctx.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(std::max(
                       absl::GetFlag(FLAGS_timeout), absl::Seconds(30))));
  outbox::v1::ResolveDivergenceRequest req;
  req.set_subscription(absl::GetFlag(FLAGS_subscription));
  req.set_aggregate_id(aggregate);
  req.set_aggregate_type(type);
  req.set_reason(absl::GetFlag(FLAGS_reason));
  return stub->ResolveDivergence(&ctx, req, closed);
}

// Every open divergence, --parallel at a time, each printed as it is
// closed. The open ones are listed again after each page (10,000), less
// those that failed, until none is left. 0: all resolved; 1: some not.
int ResolveAll(RelayAdmin::Stub* stub) {
  constexpr int kPage = 10000;
  const int parallel = absl::GetFlag(FLAGS_parallel);
  absl::Mutex mu;  // the output and the counts
  int resolved = 0, failed = 0;
  std::set<std::pair<std::string, std::string>> failures;  // type, id
  for (;;) {
    outbox::v1::ListDivergencesResponse resp;
    grpc::Status st = ListDivergences(stub, false, kPage, &resp);
    if (!st.ok()) return Fail("diverged", st);
    std::vector<const outbox::v1::Divergence*> todo;
    for (const auto& d : resp.divergences()) {
      if (failures.count({d.aggregate_type(), d.aggregate_id()}) == 0) {
        todo.push_back(&d);
      }
    }
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < todo.size();) {
        const outbox::v1::Divergence& d = *todo[i];
        outbox::v1::Divergence closed;
        grpc::Status r =
            ResolveOne(stub, d.aggregate_type(), d.aggregate_id(), &closed);
        absl::MutexLock lock(&mu);
        if (r.ok()) {
          PrintDivergence(closed);
          ++resolved;
        } else {
          Fail(absl::StrCat("resolve ", d.aggregate_id()), r);
          failures.insert({d.aggregate_type(), d.aggregate_id()});
          ++failed;
        }
      }
    };
    const int resolved_before = resolved;
    std::vector<std::thread> workers;
    for (int w = 1; w < std::min<int>(parallel, todo.size()); ++w) {
      workers.emplace_back(work);
    }
    work();
    for (std::thread& t : workers) t.join();
    // A short page was the last; a page of failures alone makes no
    // progress.
    if (resp.divergences_size() < kPage || resolved == resolved_before) break;
  }
  std::printf("resolved %d of %d diverged aggregates\n", resolved,
              resolved + failed);
  return failed == 0 ? 0 : 1;
}

// One aggregate (--aggregate), or every open divergence (--all), each
// with the same --reason.
int Resolve() {
  const bool all = absl::GetFlag(FLAGS_all);
  if (absl::GetFlag(FLAGS_reason).empty() ||
      all == !absl::GetFlag(FLAGS_aggregate).empty()) {
    std::fprintf(stderr,
                 "usage: outboxctl resolve --aggregate ID | --all "
                 "[--parallel N] --reason TEXT\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_parallel) < 1 || absl::GetFlag(FLAGS_parallel) > 64) {
    std::fprintf(stderr, "outboxctl: --parallel: must be 1-64, not %d\n",
                 absl::GetFlag(FLAGS_parallel));
    return 2;
  }
  auto stub = RelayAdmin::NewStub(Channel(absl::GetFlag(FLAGS_relay)));
  if (all) return ResolveAll(stub.get());
  outbox::v1::Divergence closed;
  grpc::Status st = ResolveOne(stub.get(), absl::GetFlag(FLAGS_aggregate_type),
                               absl::GetFlag(FLAGS_aggregate), &closed);
  if (!st.ok()) {
    return Fail(absl::StrCat("resolve ", absl::GetFlag(FLAGS_aggregate)), st);
  }
  PrintDivergence(closed);
  return 0;
}

// outboxctl held [--failed] | held release|skip EVENT_ID --reason TEXT:
// the consumer's held events, and an operator's actions on one whose
// effect failed as it drained.
int Held(const std::vector<char*>& args) {
  auto stub = BillingQuery::NewStub(Channel(absl::GetFlag(FLAGS_consumer)));
  const std::string action = args.size() > 2 ? args[2] : "";
  if (action.empty() || action == "list") {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    outbox::v1::ListHeldEventsRequest req;
    req.set_limit(absl::GetFlag(FLAGS_limit));
    req.set_failed_only(absl::GetFlag(FLAGS_failed));
    outbox::v1::ListHeldEventsResponse resp;
    grpc::Status st = stub->ListHeldEvents(&ctx, req, &resp);
    if (!st.ok()) return Fail("held", st);
    for (const auto& h : resp.events()) {
      const bool next = h.prev_seq() == h.cursor();
      std::printf(
          "%s  aggregate %s%s%s%s seq %lld prev_seq %lld (applied through "
          "%lld)  %s\n",
          h.event_id().c_str(), h.aggregate_type().c_str(),
          h.aggregate_type().empty() ? "" : " ", h.aggregate_id().c_str(),
          h.source().empty() ? "" : (" of source " + h.source()).c_str(),
          static_cast<long long>(h.seq()), static_cast<long long>(h.prev_seq()),
          static_cast<long long>(h.cursor()),
          h.attempts() > 0
              ? absl::StrCat("FAILED x", h.attempts(), ": ", h.last_error(),
                             "; release or skip it")
                    .c_str()
          : next ? "next, drains with the next batch of its aggregate"
                 : absl::StrCat("waits for the event after seq ", h.prev_seq(),
                                " (missing)")
                       .c_str());
    }
    std::printf("%d held event(s)%s\n", resp.events_size(),
                absl::GetFlag(FLAGS_failed) ? " whose effect failed" : "");
    return 0;
  }
  if ((action != "release" && action != "skip") || args.size() != 4 ||
      absl::GetFlag(FLAGS_reason).empty()) {
    std::fprintf(stderr,
                 "usage: outboxctl held [--failed] | held release|skip "
                 "EVENT_ID --reason TEXT\n");
    return 2;
  }
  grpc::ClientContext ctx;
  Deadline(&ctx);
  outbox::v1::HeldEventActionRequest req;
  req.set_event_id(args[3]);
  req.set_reason(absl::GetFlag(FLAGS_reason));
  outbox::v1::HeldEventActionResponse resp;
  grpc::Status st = action == "release"
                        ? stub->ReleaseHeldEvent(&ctx, req, &resp)
                        : stub->SkipHeldEvent(&ctx, req, &resp);
  if (!st.ok()) return Fail(absl::StrCat("held ", action), st);
  if (action == "release" && !resp.applied()) {
    std::printf("%s still held: %s\n", resp.event_id().c_str(),
                resp.last_error().c_str());
    return 1;
  }
  std::printf(
      "%s %s: aggregate %s applied through seq %lld, %lld behind it "
      "drained, %lld still held\n",
      resp.event_id().c_str(),
      action == "release" ? "applied" : "skipped (its effect never applied)",
      resp.aggregate_id().c_str(), static_cast<long long>(resp.cursor()),
      static_cast<long long>(resp.drained()),
      static_cast<long long>(resp.held_left()));
  return 0;
}

// outboxctl subscriptions | subscriptions pause|resume|drop|log|rows NAME
// --reason TEXT [--force]: every subscription of the orders database, what
// it owes, how it is delivered and what pins retention; an operator's
// actions on one (log and rows move it onto the outbox log and off it).
int Subscriptions(const std::vector<char*>& args) {
  auto stub = RelayAdmin::NewStub(Channel(absl::GetFlag(FLAGS_relay)));
  const std::string action = args.size() > 2 ? args[2] : "";
  if (action.empty() || action == "list") {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    outbox::v1::ListSubscriptionsResponse resp;
    grpc::Status st = stub->ListSubscriptions(&ctx, {}, &resp);
    if (!st.ok()) return Fail("subscriptions", st);
    int pinning = 0, healing = 0;
    for (const auto& s : resp.subscriptions()) {
      std::printf(
          "%s%s: %lld pending (oldest %.0f s), %lld dead, %lld diverged; %lld "
          "relay(s) alive; delivery %s\n",
          s.name().c_str(),
          s.paused() ? absl::StrCat(" [PAUSED by ", s.paused_by(), ": ",
                                    s.paused_reason(), "]")
                           .c_str()
                     : "",
          static_cast<long long>(s.pending()), s.oldest_pending_seconds(),
          static_cast<long long>(s.dead_letters()),
          static_cast<long long>(s.diverged()),
          static_cast<long long>(s.relays_alive()), s.delivery().c_str());
      if (!s.pins().empty()) {
        ++pinning;
        std::printf("  pins retention: %s\n", s.pins().c_str());
      }
      if (!s.heal_due().empty()) {
        ++healing;
        std::printf(
            "  heal due: %s (a relay delivering it runs it; until then "
            "retention deletes nothing and verify cannot tell what was "
            "lost)\n",
            s.heal_due().c_str());
      }
    }
    std::printf(
        "%d subscription(s); retention %s%s%s\n", resp.subscriptions_size(),
        resp.retention().c_str(),
        pinning > 0 ? absl::StrCat(", pinned by ", pinning).c_str() : "",
        healing > 0 ? absl::StrCat(", ", healing, " heal(s) due").c_str() : "");
    return pinning > 0 ? 1 : 0;
  }
  if ((action != "pause" && action != "resume" && action != "drop" &&
       action != "log" && action != "rows") ||
      args.size() != 4 || absl::GetFlag(FLAGS_reason).empty()) {
    std::fprintf(stderr,
                 "usage: outboxctl subscriptions | subscriptions "
                 "pause|resume|drop|log|rows NAME --reason TEXT [--force]\n");
    return 2;
  }
  grpc::ClientContext ctx;
  Deadline(&ctx);
  outbox::v1::SubscriptionActionRequest req;
  req.set_subscription(args[3]);
  req.set_reason(absl::GetFlag(FLAGS_reason));
  req.set_force(absl::GetFlag(FLAGS_force));
  outbox::v1::Subscription info;
  outbox::v1::DropSubscriptionResponse dropped;
  grpc::Status st =
      action == "pause"    ? stub->PauseSubscription(&ctx, req, &info)
      : action == "resume" ? stub->ResumeSubscription(&ctx, req, &info)
      : action == "log"    ? stub->MoveSubscriptionToLog(&ctx, req, &info)
      : action == "rows"   ? stub->MoveSubscriptionToRows(&ctx, req, &info)
                           : stub->DropSubscription(&ctx, req, &dropped);
  if (!st.ok()) return Fail(absl::StrCat("subscriptions ", action), st);
  if (action == "drop") {
    std::printf("dropped %s (%s)\n", args[3], dropped.detail().c_str());
  } else if (action == "log" || action == "rows") {
    std::printf(
        "%s is delivered from %s now (%s); its relays follow at their next "
        "rebalance round (--rebalance_interval)\n",
        info.name().c_str(),
        info.delivery() == "log" ? "the outbox log" : "delivery rows",
        info.action_detail().c_str());
  } else {
    std::printf("%s %s\n", info.name().c_str(),
                info.paused() ? "paused: its relays claim nothing until resumed"
                              : "resumed");
  }
  return 0;
}

// The load flags of `command` (load, demo), or nullopt after saying on
// stderr which flag is wrong.
std::optional<outbox::tools::LoadOptions> LoadFlags(const char* command) {
  outbox::tools::LoadOptions o;
  o.producer = absl::GetFlag(FLAGS_producer);
  o.orders = absl::GetFlag(FLAGS_orders);
  o.concurrency = absl::GetFlag(FLAGS_concurrency);
  o.connections = absl::GetFlag(FLAGS_connections);
  o.pay_fraction = absl::GetFlag(FLAGS_pay_fraction);
  o.cancel_fraction = absl::GetFlag(FLAGS_cancel_fraction);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.call_timeout = absl::GetFlag(FLAGS_timeout);
  o.duration = absl::GetFlag(FLAGS_duration);
  o.only = absl::GetFlag(FLAGS_only);
  o.rate = absl::GetFlag(FLAGS_rate);
  o.max_tries = absl::GetFlag(FLAGS_max_tries);
  o.idempotency_keys = absl::GetFlag(FLAGS_idempotency_keys);
  o.tls = TlsFromFlags();
  if (absl::Status s = outbox::tools::CheckLoadOptions(o); !s.ok()) {
    std::fprintf(stderr, "outboxctl: %s: %s\n", command,
                 std::string(s.message()).c_str());
    return std::nullopt;
  }
  return o;
}

int Verify() {
  auto report =
      outbox::tools::Check(OrdersDb(), BillingDb(), absl::GetFlag(FLAGS_wait),
                           outbox::DbSessionFromFlags(),
                           absl::GetFlag(FLAGS_subscription).empty()
                               ? "billing"
                               : absl::GetFlag(FLAGS_subscription));
  if (!report.ok()) {
    std::fprintf(stderr, "outboxctl: verify: %s\n",
                 report.status().ToString().c_str());
    return 1;
  }
  std::printf("%s", absl::GetFlag(FLAGS_format) == "json"
                        ? report->Json().c_str()
                        : report->Summary().c_str());
  return report->ok() ? 0 : 1;
}

// Exit 0: every event of the window is applied; 1: some are not (listed
// with why); 3: a database could not be read. A CronJob alarms on non-zero.
int ReconcileCommand() {
  outbox::tools::ReconcileOptions o;
  if (!absl::GetFlag(FLAGS_subscription).empty()) {
    o.subscription = absl::GetFlag(FLAGS_subscription);
  }
  o.window = absl::GetFlag(FLAGS_window);
  o.grace = absl::GetFlag(FLAGS_grace);
  if (absl::GetFlag(FLAGS_limit) < 0) {
    std::fprintf(stderr,
                 "outboxctl: reconcile: --limit must be 0 or more, not %d\n",
                 absl::GetFlag(FLAGS_limit));
    return 2;
  }
  o.max_listed = absl::GetFlag(FLAGS_limit);
  if (o.window <= o.grace || o.grace < absl::ZeroDuration()) {
    std::fprintf(stderr,
                 "outboxctl: reconcile: --window must be longer than --grace "
                 "(and --grace not negative)\n");
    return 2;
  }
  auto report = outbox::tools::Reconcile(OrdersDb(), BillingDb(), o,
                                         outbox::DbSessionFromFlags());
  if (!report.ok()) {
    std::fprintf(stderr, "outboxctl: reconcile: %s\n",
                 report.status().ToString().c_str());
    return 3;
  }
  std::printf("%s", absl::GetFlag(FLAGS_format) == "json"
                        ? report->Json().c_str()
                        : report->Summary().c_str());
  return report->ok() ? 0 : 1;
}

int Demo() {
  const std::optional<outbox::tools::LoadOptions> o = LoadFlags("demo");
  if (!o) return 2;
  std::printf("demo: %d orders through producer %s, relay %s, consumer %s\n",
              absl::GetFlag(FLAGS_orders),
              absl::GetFlag(FLAGS_producer).c_str(),
              absl::GetFlag(FLAGS_relay).c_str(),
              absl::GetFlag(FLAGS_consumer).c_str());
  outbox::tools::LoadReport load = outbox::tools::RunLoad(*o);
  std::printf("\n-- load --\n%s", load.Summary().c_str());
  std::printf("\n-- waiting for every event to be applied --\n");
  std::fflush(stdout);
  auto report =
      outbox::tools::Check(OrdersDb(), BillingDb(), absl::GetFlag(FLAGS_wait),
                           outbox::DbSessionFromFlags());
  if (!report.ok()) {
    std::fprintf(stderr, "demo: %s\n", report.status().ToString().c_str());
    return 1;
  }
  auto stub = BillingQuery::NewStub(Channel(absl::GetFlag(FLAGS_consumer)));
  grpc::ClientContext ctx;
  Deadline(&ctx);
  outbox::v1::ConsumerStats stats;
  const bool have_stats = stub->GetStats(&ctx, {}, &stats).ok();
  std::printf("\n-- summary --\norders             %lld\n%s",
              static_cast<long long>(load.created), report->Summary().c_str());
  if (have_stats) {
    std::printf(
        "duplicates absorbed %lld, held on arrival %lld (consumer "
        "counters)\n",
        static_cast<long long>(stats.duplicates_by_process()),
        static_cast<long long>(stats.held_by_process()));
  }
  return report->ok() && load.gave_up == 0 ? 0 : 1;
}

int Load() {
  const std::optional<outbox::tools::LoadOptions> o = LoadFlags("load");
  if (!o) return 2;
  outbox::tools::LoadReport r = outbox::tools::RunLoad(*o);
  std::printf("%s", absl::GetFlag(FLAGS_format) == "json"
                        ? r.Json().c_str()
                        : r.Summary().c_str());
  return r.gave_up == 0 ? 0 : 1;
}

// Makes the orders database's outbox partitioned by seq range, so that
// --retention empties whole children (rotation) instead of deleting rows.
// Exit 0: partitioned (now or before); 1: the database refused or is
// away; 2: a bad flag.
int PartitionOutbox() {
  const int64_t span = absl::GetFlag(FLAGS_span);
  const int ahead = absl::GetFlag(FLAGS_ahead);
  const absl::Duration span_time = absl::GetFlag(FLAGS_span_time);
  if (span < 1000 || ahead < 1 || span_time < absl::ZeroDuration()) {
    std::fprintf(stderr,
                 "outboxctl: partition-outbox: need --span of at least 1000 "
                 "seqs, --ahead of at least 1 and --span_time of 0 or more, "
                 "not %lld, %d and %s\n",
                 static_cast<long long>(span), ahead,
                 absl::FormatDuration(span_time).c_str());
    return 2;
  }
  const outbox::DbSession session = outbox::DbSessionFromFlags();
  // The function comes with the outbox's migrations.
  absl::Status s = outbox::Migrate(OrdersDb(), outbox::OutboxSchema().name,
                                   *outbox::OutboxSchema().migrations,
                                   absl::GetFlag(FLAGS_timeout), session);
  if (!s.ok()) return Fail("partition-outbox", s);
  auto conn = outbox::Connect(OrdersDb(), "outboxctl", session);
  if (!conn.ok()) return Fail("partition-outbox", conn.status());
  bool bounded = false;  // a bound prepared by this run, not used yet
  try {
    // First a bound on the old table's seqs, checked by a scan that holds
    // up nobody, so that the conversion need not scan it under its lock.
    // The old table takes one span more. If the writers draw half of it
    // before the conversion, the relays drop the bound and the conversion
    // scans instead (a span of seqs drawn during a scan of the table: a
    // span far too small for the outbox's size).
    std::optional<int64_t> bound;
    {
      pqxx::work tx(**conn);
      tx.exec("SET LOCAL lock_timeout = '10s'");
      const pqxx::row r =
          tx.exec_params1("SELECT outbox_partition_prepare($1)", span);
      if (!r[0].is_null()) bound = r[0].as<int64_t>();
      tx.commit();
    }
    if (bound.has_value()) {
      bounded = true;
      std::printf(
          "partition-outbox: checking that every seq of the outbox lies "
          "below %lld (a scan; writers and readers go on)...\n",
          static_cast<long long>(*bound));
      std::fflush(stdout);
      pqxx::work tx(**conn);
      tx.exec("SET LOCAL lock_timeout = '10s'");
      tx.exec("SET LOCAL statement_timeout = 0");
      tx.exec("ALTER TABLE outbox VALIDATE CONSTRAINT outbox_s0_bound");
      tx.commit();
      // The parent's event_id index (not unique: a partitioned table's
      // unique keys must hold the partition column) wants one like it on
      // each child: built here, without a lock that stops anyone, ATTACH
      // takes it instead of building it under its own.
      std::printf(
          "partition-outbox: building the index of event_id the new outbox "
          "wants on each child (concurrently; writers and readers go "
          "on)...\n");
      std::fflush(stdout);
      pqxx::nontransaction index(**conn);
      // Not in a transaction block, so not SET LOCAL: a session of its own
      // when direct (behind a pooler the session's limits are per
      // transaction, and this statement has none).
      if (!outbox::IsPooled(**conn)) index.exec("SET statement_timeout = 0");
      if (index
              .exec1("SELECT coalesce((SELECT NOT indisvalid FROM pg_index "
                     "WHERE indexrelid = "
                     "to_regclass('outbox_s0_event_id_idx')), false)")[0]
              .as<bool>()) {
        // Left invalid by a build that was stopped: ATTACH would not use it.
        index.exec("DROP INDEX CONCURRENTLY outbox_s0_event_id_idx");
      }
      index.exec(
          "CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_s0_event_id_idx ON "
          "outbox (event_id)");
    }
    pqxx::work tx(**conn);
    // The conversion holds the outbox exclusively for a moment: it waits
    // for the writers and readers of the moment, not for ever.
    tx.exec("SET LOCAL lock_timeout = '10s'");
    tx.exec("SET LOCAL statement_timeout = 0");
    const std::string said =
        tx.exec_params1(
              "SELECT outbox_partition_outbox($1, $2, NULLIF($3::float8, 0) "
              "* interval '1 second')",
              span, ahead, absl::ToDoubleSeconds(span_time))[0]
            .as<std::string>();
    tx.commit();
    std::printf("partition-outbox: %s\n", said.c_str());
    return 0;
  } catch (const std::exception& e) {
    const absl::Status failed = outbox::StatusFromException(e);
    if (bounded) {
      // Not left for a writer to meet: the next run prepares another.
      absl::Status dropped =
          outbox::InUnit(**conn, [](pqxx::transaction_base& tx) {
            tx.exec("SELECT outbox_partition_bound_expire(true)");
          });
      if (!dropped.ok()) {
        std::fprintf(stderr,
                     "outboxctl: partition-outbox: the bound it put on the "
                     "outbox stays (the relays drop it before a writer could "
                     "reach it): %s\n",
                     std::string(dropped.message()).c_str());
      }
    }
    return Fail("partition-outbox", failed);
  }
}

// Exit 0: every case passed (or was skipped); 1: a case failed or the sink
// was unreachable; 2: a bad flag.
int Conformance() {
  outbox::tools::ConformanceOptions o;
  o.sink = absl::GetFlag(FLAGS_sink);
  o.tls = TlsFromFlags();
  o.wrong_cert = absl::GetFlag(FLAGS_wrong_cert);
  o.wrong_key = absl::GetFlag(FLAGS_wrong_key);
  o.timeout = absl::GetFlag(FLAGS_timeout);
  o.max_batch_events = absl::GetFlag(FLAGS_max_batch_events);
  o.protocol = absl::GetFlag(FLAGS_protocol);
  if (!absl::GetFlag(FLAGS_aggregate_type).empty()) {
    o.aggregate_type = absl::GetFlag(FLAGS_aggregate_type);
  }
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_cases), ',',
                                            absl::SkipWhitespace())) {
    o.cases.insert(std::string(absl::StripAsciiWhitespace(c)));
  }
  if (absl::Status s = outbox::tools::CheckConformanceOptions(o); !s.ok()) {
    std::fprintf(stderr, "outboxctl: conformance: %s\n",
                 std::string(s.message()).c_str());
    return 2;
  }
  std::printf("conformance: EventSink at %s (%s, outbox-protocol %d)\n",
              o.sink.c_str(), o.tls.tls() ? "TLS" : "plaintext", o.protocol);
  std::fflush(stdout);
  outbox::tools::ConformanceReport report =
      outbox::tools::RunConformance(o, [](const outbox::tools::CaseResult& c) {
        std::printf("%s\n", c.Line().c_str());
        std::fflush(stdout);
      });
  std::printf("%s", report.Summary().c_str());
  return report.ok() ? 0 : 1;
}

// What is wrong with the duration flags that any command reads, or "": each
// out-of-range value would otherwise be taken for another (a --timeout of 0
// or less fails every call, a negative --wait waits not at all, a negative
// --since requeues every dead letter).
std::string BadDurationFlag() {
  const struct {
    const char* name;
    absl::Duration value;
    bool zero_ok;
  } flags[] = {
      {"--timeout", absl::GetFlag(FLAGS_timeout), false},
      {"--wait", absl::GetFlag(FLAGS_wait), true},
      {"--since", absl::GetFlag(FLAGS_since), true},
      {"--until", absl::GetFlag(FLAGS_until), true},
  };
  for (const auto& f : flags) {
    if (f.value > absl::ZeroDuration() ||
        (f.zero_ok && f.value == absl::ZeroDuration())) {
      continue;
    }
    return absl::StrCat(f.name, " must be ",
                        f.zero_ok ? "0 or more" : "positive", ", not ",
                        absl::FormatDuration(f.value));
  }
  return "";
}

}  // namespace

// "--all-dead" -> "--all_dead": flags may be spelt with hyphens.
void UnderscoreFlagNames(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--", 2) != 0) continue;
    if (argv[i][2] == '\0') break;  // "--": the rest is positional
    for (char* p = argv[i] + 2; *p != '\0' && *p != '='; ++p) {
      if (*p == '-') *p = '_';
    }
  }
}

int main(int argc, char** argv) {
  UnderscoreFlagNames(argc, argv);
  static constexpr char kUsage[] =
      "outboxctl COMMAND [flags]\n"
      "commands: stats, dead-letters, requeue EVENT_ID|--aggregate ID|"
      "--all-dead [--since D] [--error TEXT], "
      "show EVENT_ID,\n  load --orders N --concurrency C [--only "
      "create|pay|cancel|get] "
      "[--rate R], verify, demo --orders N,\n  reconcile [--window 1h] "
      "[--grace 5m] [--subscription S],\n  replay --event ID|--aggregate "
      "ID|--from_seq N [--to_seq M]|--since D [--until D],\n  diverged "
      "[--all], resolve --aggregate ID|--all [--parallel N] --reason TEXT,\n  "
      "held "
      "[--failed], held release|skip EVENT_ID --reason TEXT,\n  "
      "subscriptions, subscriptions pause|resume|drop|log|rows NAME --reason "
      "TEXT "
      "[--force],\n  conformance --sink HOST:PORT [--cases C,...] "
      "[--wrong_cert F --wrong_key F],\n  partition-outbox [--span N] "
      "[--ahead K] [--span_time D]";
  // Asking for help is not a mistake: the usage and outboxctl's own flags,
  // exit 0 (abseil's --help exits 1).
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-help" || a == "-h" || (i == 1 && a == "help")) {
      absl::flags_internal::SetProgramInvocationName("outboxctl");
      absl::flags_internal::FlagsHelp(
          std::cout, "outboxctl",
          absl::flags_internal::HelpFormat::kHumanReadable, kUsage);
      std::cout << "\nEvery flag: outboxctl --helpfull\n";
      return 0;
    }
  }
  std::vector<char*> args = outbox::InitProcess(argc, argv, kUsage);
  const std::string cmd = args.size() > 1 ? args[1] : "";
  if (absl::Status s =
          outbox::CheckClientTls(TlsFromFlags(), {"--ca", "--cert", "--key"});
      !s.ok()) {
    std::fprintf(stderr, "outboxctl: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (std::string bad = BadDurationFlag(); !bad.empty()) {
    std::fprintf(stderr, "outboxctl: %s\n", bad.c_str());
    return 2;
  }
  if (cmd == "stats") return Stats();
  if (cmd == "dead-letters") return DeadLetters();
  if (cmd == "requeue") return Requeue(args);
  if (cmd == "show") return Show(args);
  if (cmd == "load") return Load();
  if (cmd == "verify") return Verify();
  if (cmd == "demo") return Demo();
  if (cmd == "reconcile") return ReconcileCommand();
  if (cmd == "replay") return ReplayCommand();
  if (cmd == "diverged") return Diverged();
  if (cmd == "resolve") return Resolve();
  if (cmd == "held") return Held(args);
  if (cmd == "subscriptions") return Subscriptions(args);
  if (cmd == "conformance") return Conformance();
  if (cmd == "partition-outbox") return PartitionOutbox();
  std::fprintf(
      stderr,
      "usage: outboxctl stats | dead-letters | requeue EVENT_ID | "
      "requeue --aggregate ID | requeue --all-dead [--since D] "
      "[--error TEXT] | show EVENT_ID | load --orders N "
      "--concurrency C | verify | demo --orders N | reconcile | "
      "replay --event ID|--aggregate ID|--from_seq N|--since D | "
      "diverged | resolve --aggregate ID|--all [--parallel N] --reason TEXT | "
      "held [--failed] | held release|skip EVENT_ID --reason "
      "TEXT | subscriptions | subscriptions pause|resume|drop|log|rows NAME "
      "--reason TEXT [--force] | conformance --sink HOST:PORT | "
      "partition-outbox [--span N] [--ahead K]\n");
  return 2;
}
