#pragma once
// A load generator that behaves like a careful client: it creates orders
// with idempotency keys, pays some and cancels some (so aggregates carry one
// to three events), and retries a call whose outcome is unknown the way a
// real client would: CreateOrder with the same key, Pay/Cancel after
// re-reading the order. Outcomes it cannot know are counted as
// indeterminate, never guessed.
//
// For benchmarks it can also exercise one call alone (`only`): CreateOrder
// only, or PayOrder / CancelOrder / GetOrder only on orders it first creates
// in a setup phase that the report does not count; and it can pace its calls
// (`rate`). For fault tests it can be a careless client instead: one try
// per call (`max_tries` 1) and no idempotency keys.

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/tls.h"

namespace outbox::tools {

struct LoadOptions {
  std::string producer = "127.0.0.1:50051";
  int orders = 100;         // at most
  absl::Duration duration;  // if set, no new order starts after it
  int concurrency = 8;      // client threads, each with one call at a time
  // Connections to the producer, shared round-robin by the client threads;
  // 0: one per thread, as pgbench's clients each have their own.
  int connections = 0;
  double pay_fraction = 0.7;     // of created orders
  double cancel_fraction = 0.3;  // of created orders (paid ones get refunds)
  absl::Duration call_timeout = absl::Seconds(5);
  int max_tries = 20;  // per call, then the operation gives up
  uint64_t seed = 1;
  std::string key_prefix;  // idempotency keys: prefix + index
  // false: CreateOrder without an idempotency key, as a client that cannot
  // retry it safely (meant with max_tries 1: a retry may create the order
  // twice).
  bool idempotency_keys = true;
  bool progress = true;  // a line a second on stderr
  ClientTlsFiles tls;    // none: plaintext
  // "": the mix above. "create": CreateOrder only. "pay" / "cancel" /
  // "get": first creates `orders` orders (the setup phase: not paced, not
  // in the report's calls, rate or latencies), then pays / cancels / reads
  // each of them (expected_version 1) until done or `duration` passes.
  std::string only;
  // Calls started per second at most, all workers together (retries
  // included); 0: as fast as the workers go.
  double rate = 0;
};

struct LoadReport {
  int64_t created = 0, paid = 0, cancelled = 0, read = 0;
  int64_t calls = 0, retries = 0;
  // Every call of the measured phase by its status, e.g. "OK",
  // "DEADLINE_EXCEEDED" (codes no call ended with left out).
  std::map<std::string, int64_t> codes;
  int64_t indeterminate = 0;  // calls whose outcome stayed unknown
  int64_t gave_up = 0;        // operations abandoned after max_tries
  absl::Duration elapsed;
  double call_p50_ms = 0, call_p99_ms = 0;
  // The uncounted setup phase of only=pay|cancel.
  int64_t setup_created = 0;
  absl::Duration setup_elapsed;
  std::string only;
  double cpu_seconds = 0;  // this process's CPU time (user + system) in
                           // the measured phase
  std::string Summary() const;
  std::string Json() const;  // one line
};

// OK, or INVALID_ARGUMENT naming the first option (by its outboxctl flag)
// that RunLoad cannot honour: a negative count, a share outside [0, 1], an
// unknown `only`, a timeout that is not positive, fewer than one try.
absl::Status CheckLoadOptions(const LoadOptions& options);

// Runs the load that `options` (as CheckLoadOptions accepts them) describe.
LoadReport RunLoad(const LoadOptions& options);

}  // namespace outbox::tools
