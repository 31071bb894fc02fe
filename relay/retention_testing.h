#pragma once
// For the tests of retention (row deletes and rotation): one step as the
// relay's housekeeping takes it, checked to leave what went a prefix of
// the outbox.

#include <gtest/gtest.h>

#include <cstdint>
#include <pqxx/pqxx>
#include <set>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "relay/retention.h"

namespace outbox::relay {

// The seqs the outbox holds.
inline std::set<int64_t> OutboxSeqs(pqxx::connection& conn) {
  pqxx::nontransaction tx(conn);
  std::set<int64_t> seqs;
  for (const auto& row : tx.exec("SELECT seq FROM outbox")) {
    seqs.insert(row[0].as<int64_t>());
  }
  return seqs;
}

// One step of retention on `conn`, in a transaction of its own, with a
// mark of its own (at most one per 50 ms is taken, so it waits 55 ms
// first); then checks that every event that went lies below all that is
// retained. Returns what PruneOutbox returned.
inline int64_t RetentionStep(pqxx::connection& conn, absl::Duration retention,
                             std::string* held_back = nullptr) {
  absl::SleepFor(absl::Milliseconds(55));
  const std::set<int64_t> before = OutboxSeqs(conn);
  int64_t n;
  {
    pqxx::work tx(conn);
    n = PruneOutbox(tx, retention, 1000, held_back);
    tx.commit();
  }
  const std::set<int64_t> after = OutboxSeqs(conn);
  for (int64_t seq : before) {
    if (after.count(seq) == 0 && !after.empty()) {
      EXPECT_LT(seq, *after.begin())
          << "retention removed an event above a retained one";
    }
  }
  return n;
}

}  // namespace outbox::relay
