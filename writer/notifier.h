#pragma once
// Wakes relays after commits: one NOTIFY per burst of commits, sent on its
// own connection once the writes have committed. Writing transactions thus
// never take the global lock NOTIFY holds at commit (measured by
// scripts/bench: in-transaction NOTIFY costs about 40% of the producer's
// throughput). The notification is only a hint; relays also poll, so a
// NOTIFY lost to a crash or a broken connection delays delivery by at most
// one poll interval and loses nothing.

#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/db.h"

namespace outbox {

class Notifier {
 public:
  explicit Notifier(std::string db_url, DbSession session = {});
  ~Notifier();  // stops the thread

  // Asks for a NOTIFY soon. Never blocks on the database.
  void Poke();

 private:
  void Run();

  const std::string db_url_;
  const DbSession session_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace outbox
