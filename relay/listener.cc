#include "relay/listener.h"

#include <spdlog/spdlog.h>

#include <optional>
#include <pqxx/pqxx>

#include "absl/synchronization/mutex.h"
#include "common/schema.h"

namespace outbox::relay {

namespace {

class Wakeup : public pqxx::notification_receiver {
 public:
  Wakeup(pqxx::connection_base& c, std::function<void()> wake)
      : pqxx::notification_receiver(c, kNotifyChannel),
        wake_(std::move(wake)) {}
  void operator()(const std::string&, int) override {
    spdlog::debug("relay: NOTIFY received");
    wake_();
  }

 private:
  std::function<void()> wake_;
};

// NOTIFYs heard in a row while the worker wanted none (one it wants
// resets the count, so a moderate load, whose waits for answers are
// short, keeps listening); this many and the load is steady: stop
// listening until the worker wants wakes again.
constexpr int kIgnoredBeforeUnlisten = 16;

}  // namespace

CommitListener::CommitListener(Options options)
    : options_(std::move(options)) {}

CommitListener::~CommitListener() { Stop(); }

void CommitListener::Start() {
  thread_ = std::thread([this] { Run(); });
}

void CommitListener::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void CommitListener::Heard() {
  heard_at_ = absl::ToUnixNanos(absl::Now());
}

std::optional<absl::Time> CommitListener::TakeHeard() {
  const int64_t at = heard_at_.exchange(0);
  if (at == 0) return std::nullopt;
  return absl::FromUnixNanos(at);
}

void CommitListener::WantWakes(bool want) {
  if (!want) {
    wants_wakes_ = false;
    return;
  }
  if (wants_wakes_) return;
  absl::MutexLock lock(&mu_);
  wants_wakes_ = true;
  cv_.SignalAll();  // a listener that stopped listening resumes
}

void CommitListener::Run() {
  const auto wake = [this] {
    if (options_.wake) options_.wake();
  };
  bool told = false;
  while (!stop_) {
    auto conn = Connect(options_.url, "outbox-relay-listen", options_.session);
    if (!conn.ok()) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      continue;
    }
    if ((*conn)->info().pooled) {
      if (!told) {
        spdlog::warn(
            "relay: the database is reached through a transaction pooler, "
            "where LISTEN cannot hear NOTIFY; polling every {} instead "
            "(give --notify_db a URL that reaches PostgreSQL directly)",
            absl::FormatDuration(options_.fast_poll_interval));
        told = true;
      }
      works_ = false;
      wake();
      // Looked at again now and then: the address may change.
      for (int i = 0; i < 600 && !stop_; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      continue;
    }
    works_ = true;
    try {
      int ignored = 0;
      std::optional<Wakeup> wakeup;
      while (!stop_) {
        if (!wakeup.has_value()) {
          wakeup.emplace(**conn, [this, &ignored, &wake] {
            // First the note, then the test: the worker calls WantWakes,
            // then heard(), so one of the two always sees the other.
            Heard();
            if (wants_wakes_) {
              ignored = 0;
              wake();
            } else {
              ++ignored;
            }
          });
          // Rows committed while we were not listening: heard as if
          // announced now, and the claims this wakes find them.
          Heard();
          hearing_ = true;
          if (options_.on_listening) options_.on_listening(true);
          wake();
        }
        (*conn)->await_notification(0, 200000);
        if (ignored < kIgnoredBeforeUnlisten) continue;
        ignored = 0;
        hearing_ = false;
        wakeup.reset();  // UNLISTEN
        if (options_.on_listening) options_.on_listening(false);
        absl::MutexLock lock(&mu_);
        while (!(wants_wakes_ || stop_)) cv_.Wait(&mu_);
      }
      hearing_ = false;  // stopped
    } catch (const std::exception& e) {
      hearing_ = false;
      spdlog::warn(
          "relay: LISTEN connection lost ({}); polling until it is back",
          std::string(StatusFromException(e).message()));
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  }
}

}  // namespace outbox::relay
