#include "writer/notifier.h"

#include <spdlog/spdlog.h>

#include <pqxx/pqxx>

#include "common/db.h"
#include "common/schema.h"

namespace outbox {

Notifier::Notifier(std::string db_url, DbSession session)
    : db_url_(std::move(db_url)),
      session_(session),
      thread_([this] { Run(); }) {}

Notifier::~Notifier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  thread_.join();
}

void Notifier::Poke() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!poked_) {
    poked_ = true;
    cv_.notify_all();
  }
}

void Notifier::Run() {
  std::unique_ptr<Connection> conn;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return poked_ || stop_; });
      if (stop_) return;
      poked_ = false;  // pokes from now on ask for the next NOTIFY
    }
    if (conn == nullptr) {
      auto c = Connect(db_url_, "outbox-writer-notify", session_);
      if (!c.ok()) {
        spdlog::warn("outbox writer: cannot NOTIFY relays ({}); they will poll",
                     std::string(c.status().message()));
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::seconds(1), [&] { return stop_; });
        continue;
      }
      conn = std::move(*c);
    }
    try {
      pqxx::nontransaction tx(*conn);
      tx.exec(std::string("NOTIFY ") + kNotifyChannel);
      // At most one NOTIFY per 2 ms: under load, commits in that window
      // share it (each costs the server a transaction and a global lock).
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(2), [&] { return stop_; });
    } catch (const std::exception& e) {
      spdlog::warn("outbox writer: NOTIFY failed ({}); relays will poll",
                   std::string(StatusFromException(e).message()));
      conn.reset();
    }
  }
}

}  // namespace outbox
