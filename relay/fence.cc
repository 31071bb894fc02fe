#include "relay/fence.h"

#include <algorithm>
#include <pqxx/pqxx>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/db.h"

namespace outbox::relay {

std::optional<uint64_t> ParseLsn(absl::string_view lsn) {
  const size_t slash = lsn.find('/');
  if (slash == absl::string_view::npos || slash == 0 ||
      slash + 1 == lsn.size()) {
    return std::nullopt;
  }
  uint64_t hi = 0, lo = 0;
  if (!absl::SimpleHexAtoi(lsn.substr(0, slash), &hi) ||
      !absl::SimpleHexAtoi(lsn.substr(slash + 1), &lo) || hi > 0xffffffffu ||
      lo > 0xffffffffu) {
    return std::nullopt;
  }
  return (hi << 32) | lo;
}

FenceState FenceOf(const std::vector<StandbyPosition>& standbys,
                   const FenceOptions& options) {
  FenceState state;
  std::vector<uint64_t> flushed;
  bool hidden = false;
  for (const StandbyPosition& s : standbys) {
    if (!options.names.empty() && !options.names.count(s.name)) continue;
    if (s.hidden) {
      hidden = true;
      continue;
    }
    if (!s.streaming || !s.flushed.has_value()) continue;
    flushed.push_back(*s.flushed);
  }
  state.eligible = static_cast<int>(flushed.size());
  if (state.eligible >= options.standbys && options.standbys > 0) {
    std::sort(flushed.rbegin(), flushed.rend());
    state.flushed = flushed[options.standbys - 1];
    return state;
  }
  if (hidden && flushed.empty()) {
    state.readable = false;
    state.why_waiting =
        "the standbys' flush positions are hidden from this role "
        "(pg_stat_replication needs pg_monitor or pg_read_all_stats)";
    return state;
  }
  state.why_waiting = absl::StrCat(
      "replication fence: ", state.eligible, " of the ", options.standbys,
      " standbys required are streaming",
      options.names.empty()
          ? std::string()
          : absl::StrCat(" (of ", absl::StrJoin(options.names, ", "), ")"));
  return state;
}

std::string WalPastVisibleCommits(pqxx::transaction_base& tx) {
  return tx.exec1("SELECT pg_current_wal_insert_lsn()::text AS lsn")["lsn"]
      .as<std::string>();
}

FenceState ReplicationFence::Read(pqxx::transaction_base& tx) const {
  std::vector<StandbyPosition> standbys;
  for (const auto& row :
       tx.exec("SELECT coalesce(application_name, '') AS name, "
               "flush_lsn::text AS flushed, coalesce(state = 'streaming', "
               "false) AS streaming, state IS NULL AS hidden FROM "
               "pg_stat_replication")) {
    StandbyPosition s;
    s.name = row["name"].as<std::string>();
    if (!row["flushed"].is_null()) {
      s.flushed = ParseLsn(row["flushed"].as<std::string>());
    }
    s.streaming = row["streaming"].as<bool>();
    s.hidden = row["hidden"].as<bool>();
    standbys.push_back(std::move(s));
  }
  return FenceOf(standbys, options_);
}

absl::StatusOr<FenceState> ReplicationFence::Read(
    pqxx::connection_base& conn) const {
  FenceState state;
  absl::Status s =
      InUnit(conn, [&](pqxx::transaction_base& tx) { state = Read(tx); });
  if (!s.ok()) return s;
  return state;
}

bool ReplicationFence::Note(const FenceState& state, bool holding,
                            absl::Time now) {
  std::string waiting;
  if (holding) {
    waiting =
        state.why_waiting.empty()
            ? absl::StrCat("replication fence: waiting for ", options_.standbys,
                           " standbys to flush the claimed events")
            : state.why_waiting;
  }
  const bool warn = !state.why_waiting.empty() && holding &&
                    (waiting != waiting_ || now >= next_warning_);
  if (warn) next_warning_ = now + absl::Seconds(10);
  waiting_ = std::move(waiting);
  return warn;
}

}  // namespace outbox::relay
