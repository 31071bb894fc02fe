#include "writer/notifier.h"

#include <spdlog/spdlog.h>

#include <pqxx/pqxx>

#include "absl/synchronization/mutex.h"
#include "common/db.h"
#include "common/schema.h"

namespace outbox {

Notifier::Notifier(std::string db_url, DbSession session)
    : db_url_(std::move(db_url)),
      session_(session),
      thread_([this] { Run(); }) {}

Notifier::~Notifier() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  thread_.join();
}

void Notifier::Poke() {
  absl::MutexLock lock(&mu_);
  if (!poked_) {
    poked_ = true;
    cv_.SignalAll();
  }
}

void Notifier::Run() {
  std::unique_ptr<Connection> conn;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      while (!(poked_ || stop_)) cv_.Wait(&mu_);
      if (stop_) return;
      poked_ = false;  // pokes from now on ask for the next NOTIFY
    }
    if (conn == nullptr) {
      auto c = Connect(db_url_, "outbox-writer-notify", session_);
      if (!c.ok()) {
        spdlog::warn("outbox writer: cannot NOTIFY relays ({}); they will poll",
                     std::string(c.status().message()));
        absl::MutexLock lock(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Seconds(1));
        continue;
      }
      conn = std::move(*c);
    }
    try {
      pqxx::nontransaction tx(*conn);
      tx.exec(std::string("NOTIFY ") + kNotifyChannel);
      // At most one NOTIFY per 2 ms: under load, commits in that window
      // share it (each costs the server a transaction and a global lock).
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(2));
    } catch (const std::exception& e) {
      spdlog::warn("outbox writer: NOTIFY failed ({}); relays will poll",
                   std::string(StatusFromException(e).message()));
      conn.reset();
    }
  }
}

}  // namespace outbox
