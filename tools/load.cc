#include "tools/load.h"

#include <grpcpp/grpcpp.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/ids.h"
#include "outbox/v1/order.grpc.pb.h"

namespace outbox::tools {
namespace {

bool Retryable(grpc::StatusCode c) {
  return c == grpc::StatusCode::UNAVAILABLE ||
         c == grpc::StatusCode::DEADLINE_EXCEEDED ||
         c == grpc::StatusCode::RESOURCE_EXHAUSTED ||
         c == grpc::StatusCode::INTERNAL || c == grpc::StatusCode::UNKNOWN ||
         c == grpc::StatusCode::CANCELLED;
}

// A call that reached the server may have committed: its outcome is unknown.
bool Indeterminate(grpc::StatusCode c) {
  return c == grpc::StatusCode::DEADLINE_EXCEEDED ||
         c == grpc::StatusCode::UNAVAILABLE ||
         c == grpc::StatusCode::INTERNAL || c == grpc::StatusCode::UNKNOWN ||
         c == grpc::StatusCode::CANCELLED;
}

// Spaces the calls of every worker `1/rate` apart (none if rate is 0): call
// k may start at start + k / rate. A worker that falls behind catches up
// at once, so the long-run rate holds as long as the workers can keep up.
class Pacer {
 public:
  Pacer(double rate, absl::Time start) : rate_(rate), start_(start) {}
  void Wait() {
    if (rate_ <= 0) return;
    const int64_t k = next_.fetch_add(1);
    const absl::Time at =
        start_ + absl::Seconds(static_cast<double>(k) / rate_);
    const absl::Time now = absl::Now();
    if (at > now) absl::SleepFor(at - now);
  }

 private:
  const double rate_;
  const absl::Time start_;
  std::atomic<int64_t> next_{0};
};

// Calls by status code (grpc::StatusCode, 0 to 16).
using CodeCounts = std::array<std::atomic<int64_t>, 17>;

class Client {
 public:
  Client(const LoadOptions& o, std::shared_ptr<grpc::Channel> channel,
         std::atomic<int64_t>* calls, std::atomic<int64_t>* retries,
         std::atomic<int64_t>* indeterminate, CodeCounts* codes)
      : o_(o),
        calls_(calls),
        retries_(retries),
        indeterminate_(indeterminate),
        codes_(codes),
        stub_(v1::OrderService::NewStub(std::move(channel))) {}

  // Calls from now on wait for `pacer` (may be null: no pacing).
  void set_pacer(Pacer* pacer) { pacer_ = pacer; }

  // Runs `call` until it succeeds, fails for good, or max_tries pass.
  template <typename F>
  grpc::Status Retry(F&& call) {
    grpc::Status s;
    for (int attempt = 0; attempt < o_.max_tries; ++attempt) {
      if (attempt > 0) {
        retries_->fetch_add(1);
        std::this_thread::sleep_for(std::chrono::milliseconds(
            std::min(1000, 50 << std::min(attempt, 5))));
      }
      if (pacer_ != nullptr) pacer_->Wait();
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(o_.call_timeout));
      ctx.set_wait_for_ready(true);
      const absl::Time t0 = absl::Now();
      s = call(&ctx);
      calls_->fetch_add(1);
      const size_t code = static_cast<size_t>(s.error_code());
      (*codes_)[code < codes_->size() ? code : 2 /* UNKNOWN */].fetch_add(1);
      {
        absl::MutexLock lock(&mu_);
        latencies_.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      }
      if (s.ok() || !Retryable(s.error_code())) return s;
      if (Indeterminate(s.error_code())) indeterminate_->fetch_add(1);
    }
    return s;
  }

  v1::OrderService::Stub* stub() { return stub_.get(); }
  std::vector<double> TakeLatencies() {
    absl::MutexLock lock(&mu_);
    return std::move(latencies_);
  }

 private:
  const LoadOptions& o_;
  std::atomic<int64_t>* calls_;
  std::atomic<int64_t>* retries_;
  std::atomic<int64_t>* indeterminate_;
  CodeCounts* codes_;
  Pacer* pacer_ = nullptr;
  std::unique_ptr<v1::OrderService::Stub> stub_;
  absl::Mutex mu_;
  std::vector<double> latencies_ ABSL_GUARDED_BY(mu_);
};

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

}  // namespace

std::string LoadReport::Summary() const {
  std::string out;
  if (setup_created > 0 || only == "pay" || only == "cancel" || only == "get") {
    out =
        absl::StrFormat("setup (not counted below): orders created %d in %s\n",
                        setup_created, absl::FormatDuration(setup_elapsed));
  }
  return out +
         absl::StrFormat(
             "orders created %d, paid %d, cancelled %d in %s (%.0f calls/s)\n"
             "calls %d, retries %d, indeterminate outcomes %d, operations "
             "given up "
             "%d\ncall latency p50 %.1f ms  p99 %.1f ms\n",
             created, paid, cancelled, absl::FormatDuration(elapsed),
             calls / std::max(1e-3, absl::ToDoubleSeconds(elapsed)), calls,
             retries, indeterminate, gave_up, call_p50_ms, call_p99_ms) +
         (only == "get" ? absl::StrFormat("orders read %d\n", read) : "") +
         "calls by status: " +
         absl::StrJoin(codes, ", ", absl::PairFormatter(" ")) + "\n";
}

std::string LoadReport::Json() const {
  return absl::StrFormat(
      "{\"only\":\"%s\",\"created\":%d,\"paid\":%d,\"cancelled\":%d,"
      "\"calls\":%d,\"retries\":%d,\"indeterminate\":%d,\"gave_up\":%d,"
      "\"elapsed_s\":%.6f,\"calls_per_s\":%.3f,\"call_p50_ms\":%.3f,"
      "\"call_p99_ms\":%.3f,\"setup_created\":%d,\"setup_elapsed_s\":%.6f,"
      "\"cpu_s\":%.3f,\"read\":%d,\"codes\":{%s}}\n",
      only.empty() ? "mix" : only, created, paid, cancelled, calls, retries,
      indeterminate, gave_up, absl::ToDoubleSeconds(elapsed),
      calls / std::max(1e-3, absl::ToDoubleSeconds(elapsed)), call_p50_ms,
      call_p99_ms, setup_created, absl::ToDoubleSeconds(setup_elapsed),
      cpu_seconds, read,
      absl::StrJoin(codes, ",", [](std::string* out, const auto& code) {
        absl::StrAppend(out, "\"", code.first, "\":", code.second);
      }));
}

absl::Status CheckLoadOptions(const LoadOptions& o) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(parts...));
  };
  if (o.orders < 0) return bad("--orders must not be negative, not ", o.orders);
  if (o.concurrency < 1) {
    return bad("--concurrency must be at least 1, not ", o.concurrency);
  }
  if (o.connections < 0) {
    return bad("--connections must not be negative, not ", o.connections);
  }
  // Written so that NaN fails too.
  if (!(o.pay_fraction >= 0 && o.pay_fraction <= 1)) {
    return bad("--pay_fraction must be within [0, 1], not ", o.pay_fraction);
  }
  if (!(o.cancel_fraction >= 0 && o.cancel_fraction <= 1)) {
    return bad("--cancel_fraction must be within [0, 1], not ",
               o.cancel_fraction);
  }
  if (!(std::isfinite(o.rate) && o.rate >= 0)) {
    return bad(
        "--rate must be a finite number of calls per second, 0 or more"
        " (0: unpaced), not ",
        o.rate);
  }
  if (o.call_timeout <= absl::ZeroDuration()) {
    return bad("--timeout must be positive, not ",
               absl::FormatDuration(o.call_timeout));
  }
  if (o.duration < absl::ZeroDuration()) {
    return bad("--duration must not be negative (0: run to --orders), not ",
               absl::FormatDuration(o.duration));
  }
  if (o.max_tries < 1) {
    return bad("--max_tries must be at least 1 (1: no retry), not ",
               o.max_tries);
  }
  if (!o.only.empty() && o.only != "create" && o.only != "pay" &&
      o.only != "cancel" && o.only != "get") {
    return bad("--only: create, pay, cancel or get (or empty: the mix), not \"",
               o.only.substr(0, 32), "\"");
  }
  return absl::OkStatus();
}

LoadReport RunLoad(const LoadOptions& o) {
  std::atomic<int64_t> calls{0}, retries{0}, indeterminate{0};
  std::atomic<int64_t> created{0}, paid{0}, cancelled{0}, read{0}, gave_up{0};
  CodeCounts codes{};
  std::atomic<int> next{0};
  const std::string prefix =
      o.key_prefix.empty() ? NewUuid().substr(0, 8) + "-" : o.key_prefix;
  std::vector<double> latencies;
  const bool setup = o.only == "pay" || o.only == "cancel" || o.only == "get";
  const double pay_fraction = o.only.empty() ? o.pay_fraction : 0;
  const double cancel_fraction = o.only.empty() ? o.cancel_fraction : 0;
  // Orders of the setup phase, by index (unset if not created).
  std::vector<v1::Order> made(setup ? std::max(0, o.orders) : 0);
  absl::Time start = absl::Now();
  std::unique_ptr<Pacer> pacer;
  std::atomic<bool> in_setup{setup};

  // Each channel has a subchannel pool of its own, hence its own TCP
  // connection: gRPC would otherwise put every channel to the same address
  // on one connection, whose reads and writes one thread at a time handles
  // on either side.
  const int clients_n = std::max(1, o.concurrency);
  const int channels_n =
      o.connections > 0 ? std::min(o.connections, clients_n) : clients_n;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < channels_n; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    channels.push_back(grpc::CreateCustomChannel(
        o.producer, MakeChannelCredentials(o.tls), args));
  }
  std::vector<std::unique_ptr<Client>> clients;
  for (int w = 0; w < clients_n; ++w) {
    clients.push_back(std::make_unique<Client>(o, channels[w % channels.size()],
                                               &calls, &retries, &indeterminate,
                                               &codes));
  }

  // Pays `order`; true if it is paid (by this call or an earlier try whose
  // answer was lost). `order` follows what the server said.
  auto pay_op = [&](Client& client, v1::Order& order, auto&& reread) {
    v1::PayOrderRequest p;
    p.set_order_id(order.order_id());
    p.set_expected_version(order.version());
    p.set_amount_cents(order.total_cents());
    v1::PayOrderResponse pr;
    grpc::Status s = client.Retry([&](grpc::ClientContext* ctx) {
      return client.stub()->PayOrder(ctx, p, &pr);
    });
    if (s.ok()) {
      order = pr.order();
      ++paid;
    } else if (reread() && order.status() == v1::ORDER_STATUS_PAID) {
      ++paid;  // an earlier try committed; its answer was lost
    } else {
      ++gave_up;
    }
  };
  auto cancel_op = [&](Client& client, v1::Order& order, auto&& reread) {
    v1::CancelOrderRequest c;
    c.set_order_id(order.order_id());
    c.set_expected_version(order.version());
    c.set_reason("load test");
    v1::CancelOrderResponse cr;
    grpc::Status s = client.Retry([&](grpc::ClientContext* ctx) {
      return client.stub()->CancelOrder(ctx, c, &cr);
    });
    if (s.ok() || (reread() && order.status() == v1::ORDER_STATUS_CANCELLED)) {
      ++cancelled;
    } else {
      ++gave_up;
    }
  };
  // Re-reads the order: what a client does after an unknown outcome.
  auto rereader = [](Client& client, v1::Order& order) {
    return [&client, &order] {
      v1::GetOrderRequest get;
      get.set_order_id(order.order_id());
      v1::GetOrderResponse got;
      grpc::Status g = client.Retry([&](grpc::ClientContext* ctx) {
        return client.stub()->GetOrder(ctx, get, &got);
      });
      if (g.ok()) order = got.order();
      return g.ok();
    };
  };

  // The mix (or CreateOrder only, or the setup phase's creates).
  auto worker = [&](int w) {
    Client& client = *clients[w];
    std::mt19937_64 rng(o.seed * 1000003 + w);
    std::uniform_real_distribution<double> coin(0, 1);
    for (int i; (i = next.fetch_add(1)) < o.orders;) {
      if (!setup && o.duration > absl::ZeroDuration() &&
          absl::Now() - start > o.duration) {
        break;
      }
      v1::CreateOrderRequest req;
      req.set_customer_id(absl::StrCat("customer-", i % 97));
      req.set_currency("EUR");
      if (o.idempotency_keys) req.set_idempotency_key(absl::StrCat(prefix, i));
      const int items = 1 + rng() % 3;
      for (int k = 0; k < items; ++k) {
        auto* item = req.add_items();
        item->set_sku(absl::StrCat("sku-", rng() % 50));
        item->set_quantity(1 + rng() % 5);
        item->set_unit_price_cents(100 + rng() % 10000);
      }
      v1::CreateOrderResponse created_resp;
      grpc::Status s = client.Retry([&](grpc::ClientContext* ctx) {
        return client.stub()->CreateOrder(ctx, req, &created_resp);
      });
      if (!s.ok()) {
        ++gave_up;
        continue;
      }
      ++created;
      v1::Order order = created_resp.order();
      if (setup) {
        // Only what a pay or cancel needs: tens of thousands of orders
        // with their items would cost tens of MB.
        made[i].set_order_id(order.order_id());
        made[i].set_version(order.version());
        made[i].set_total_cents(order.total_cents());
        made[i].set_status(order.status());
        continue;
      }
      const bool pay = coin(rng) < pay_fraction;
      const bool cancel = coin(rng) < cancel_fraction;
      auto reread = rereader(client, order);
      if (pay) pay_op(client, order, reread);
      if (cancel) cancel_op(client, order, reread);
    }
  };
  // only=pay|cancel|get, after the setup: each created order once.
  auto change_worker = [&](int w) {
    Client& client = *clients[w];
    for (int i; (i = next.fetch_add(1)) < o.orders;) {
      if (o.duration > absl::ZeroDuration() &&
          absl::Now() - start > o.duration) {
        break;
      }
      v1::Order order = made[i];
      if (order.order_id().empty()) continue;  // its create gave up
      auto reread = rereader(client, order);
      if (o.only == "pay") {
        pay_op(client, order, reread);
      } else if (o.only == "cancel") {
        cancel_op(client, order, reread);
      } else if (reread()) {
        ++read;
      } else {
        ++gave_up;
      }
    }
  };

  std::atomic<bool> done{false};
  std::thread progress([&] {
    while (!done) {
      for (int t = 0; t < 10 && !done; ++t) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (!done && o.progress) {
        std::fprintf(
            stderr, "load: %s%d/%d orders started, %lld calls, %lld retries\n",
            in_setup ? "setup: " : "", std::min<int>(next.load(), o.orders),
            o.orders, static_cast<long long>(calls.load()),
            static_cast<long long>(retries.load()));
      }
    }
  });
  auto run_workers = [&](auto&& fn) {
    std::vector<std::thread> workers;
    for (int w = 0; w < static_cast<int>(clients.size()); ++w) {
      workers.emplace_back(fn, w);
    }
    for (auto& t : workers) t.join();
  };
  LoadReport r;
  r.only = o.only;
  if (setup) {
    run_workers(worker);
    r.setup_created = created.exchange(0);
    r.setup_elapsed = absl::Now() - start;
    // The measured phase starts here, from zero.
    calls = 0;
    retries = 0;
    indeterminate = 0;
    for (auto& c : codes) c = 0;
    for (auto& c : clients) c->TakeLatencies();
    next = 0;
    in_setup = false;
    start = absl::Now();
  }
  const double cpu_start = ProcessCpuSeconds();
  pacer = std::make_unique<Pacer>(o.rate, start);
  for (auto& c : clients) c->set_pacer(pacer.get());
  if (setup) {
    run_workers(change_worker);
  } else {
    run_workers(worker);
  }
  done = true;
  progress.join();
  for (auto& c : clients) {
    auto mine = c->TakeLatencies();
    latencies.insert(latencies.end(), mine.begin(), mine.end());
  }

  r.created = created;
  r.paid = paid;
  r.cancelled = cancelled;
  r.read = read;
  for (size_t c = 0; c < codes.size(); ++c) {
    if (codes[c] > 0) {
      r.codes[absl::StatusCodeToString(static_cast<absl::StatusCode>(c))] =
          codes[c];
    }
  }
  r.calls = calls;
  r.retries = retries;
  r.indeterminate = indeterminate;
  r.gave_up = gave_up;
  r.elapsed = absl::Now() - start;
  r.cpu_seconds = ProcessCpuSeconds() - cpu_start;
  std::sort(latencies.begin(), latencies.end());
  if (!latencies.empty()) {
    r.call_p50_ms = latencies[latencies.size() / 2];
    r.call_p99_ms =
        latencies[std::min(latencies.size() - 1, latencies.size() * 99 / 100)];
  }
  return r;
}

}  // namespace outbox::tools
