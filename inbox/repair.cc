#include "inbox/repair.h"

#include <spdlog/spdlog.h>

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "inbox/engine.h"

namespace outbox::inbox {
namespace {

constexpr int kMaxCursors = 5000;

// Each cursor of source $1 (and those without a source, if it took such
// rows over: inbox_legacy_source) with the inbox's event at its position (a probe
// by the unique chain and position index), by name in CursorFromRow.
constexpr char kCursorColumns[] =
    "SELECT c.source::text AS source, c.aggregate_type::text AS "
    "aggregate_type, c.aggregate_id::text AS aggregate_id, c.last_seq, "
    "coalesce(i.event_id::text, '') AS event_id, c.pruned_through, "
    "c.held_count FROM aggregate_cursors c LEFT JOIN LATERAL (SELECT "
    "event_id FROM inbox WHERE source = c.source AND aggregate_type = "
    "c.aggregate_type AND aggregate_id = c.aggregate_id AND seq = "
    "c.last_seq LIMIT 1) i ON true WHERE (c.source = $1 OR (c.source = '' "
    "AND EXISTS (SELECT 1 FROM inbox_legacy_source l WHERE l.source = "
    "$1))) ";

Cursor CursorFromRow(const pqxx::row& row) {
  Cursor c;
  c.source = row["source"].as<std::string>();
  c.aggregate_type = row["aggregate_type"].as<std::string>();
  c.aggregate_id = row["aggregate_id"].as<std::string>();
  c.applied_seq = row["last_seq"].as<int64_t>();
  c.applied_event_id = row["event_id"].as<std::string>();
  c.pruned_through = row["pruned_through"].as<int64_t>();
  c.held = row["held_count"].as<int64_t>();
  return c;
}

}  // namespace

InboxRepair::InboxRepair(Database* db, Handler* handler)
    : db_(db), handler_(handler) {}

absl::StatusOr<CursorPage> InboxRepair::Cursors(const CursorQuery& q) {
  if (q.only.empty() && (q.limit < 1 || q.limit > kMaxCursors)) {
    return absl::InvalidArgumentError(
        absl::StrCat("limit: must be 1-", kMaxCursors, ", not ", q.limit));
  }
  if (q.only.size() > static_cast<size_t>(kMaxCursors)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "aggregate_ids: at most ", kMaxCursors, ", not ", q.only.size()));
  }
  CursorPage page;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    page = CursorPage{};
    if (const SessionInfo* info = SessionOf(c)) page.identity = info->identity;
    pqxx::read_transaction tx(c);
    ApplyLimits(tx);
    pqxx::result r =
        q.only.empty()
            // Without after_type, after every chain of the id `after`.
            ? tx.exec_params(
                  absl::StrCat(kCursorColumns,
                               "AND (c.aggregate_id > $2 OR (c.aggregate_id "
                               "= $2 AND $3 <> '' AND c.aggregate_type > $3)) "
                               "ORDER BY c.aggregate_id, c.aggregate_type, "
                               "c.source LIMIT $4"),
                  q.source, q.after, q.after_type, q.limit + 1)
            : tx.exec_params(absl::StrCat(kCursorColumns,
                                          "AND c.aggregate_id = "
                                          "ANY($2::text[]) ORDER BY "
                                          "c.aggregate_id, c.aggregate_type, "
                                          "c.source"),
                             q.source, ArrayLiteral(q.only).str());
    for (const auto& row : r) page.cursors.push_back(CursorFromRow(row));
    if (q.only.empty() && page.cursors.size() > static_cast<size_t>(q.limit)) {
      page.cursors.pop_back();
      page.more = true;
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return page;
}

absl::StatusOr<RewindResult> InboxRepair::Rewind(RewindRequest req) {
  if (req.aggregate_id.empty() || req.aggregate_id.size() > 128) {
    return absl::InvalidArgumentError("aggregate_id: must be 1-128 bytes");
  }
  if (req.reason.empty() || req.reason.size() > 2000) {
    return absl::InvalidArgumentError("reason: must be 1-2000 bytes");
  }
  if (req.operator_name.empty()) {
    return absl::InvalidArgumentError("operator: must be given");
  }
  if (req.shared_through_seq < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared_through_seq: must be 0 or more, not ",
                     req.shared_through_seq));
  }
  std::set<std::string> keep;
  for (const std::string& id : req.keep_event_ids) {
    if (!IsUuid(id)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "keep_event_ids: \"", id.substr(0, 64), "\" is not a UUID"));
    }
    keep.insert(absl::AsciiStrToLower(id));
  }
  std::string chain;
  RewindResult out;
  absl::Status s = db_->Run([&](pqxx::connection& c) -> absl::Status {
    out = RewindResult{};
    pqxx::work tx(c);
    ApplyLimits(tx);
    // Every chain of the id shares its lock: taken before the chain is
    // chosen, so no batch takes a chain over meanwhile.
    LockAggregates(tx, {ChainKey("", "", req.aggregate_id)});
    if (req.aggregate_type.empty()) {
      // The source's one chain of that id (or one without a source that
      // it took over).
      const pqxx::result types = tx.exec_params(
          "SELECT aggregate_type, source FROM aggregate_cursors WHERE "
          "aggregate_id = $1 AND (source = $2 OR (source = '' AND EXISTS "
          "(SELECT 1 FROM inbox_legacy_source WHERE source = $2)))",
          req.aggregate_id, req.source);
      if (types.size() > 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "aggregate_type: ", types.size(), " chains of aggregate ",
            req.aggregate_id, " are here; name the type to rewind"));
      }
      if (types.size() == 1) {
        req.aggregate_type = types[0]["aggregate_type"].as<std::string>();
        req.source = types[0]["source"].as<std::string>();
      }
    }
    chain = ChainKey(req.source, req.aggregate_type, req.aggregate_id);
    int64_t pruned_through = 0;
    if (pqxx::result cur = tx.exec_params(
            "SELECT pruned_through FROM aggregate_cursors WHERE source = $2 "
            "AND aggregate_type = $3 AND aggregate_id = $1",
            req.aggregate_id, req.source, req.aggregate_type);
        !cur.empty()) {
      pruned_through = cur[0][0].as<int64_t>();
    }
    const pqxx::result rows = tx.exec_params(
        "SELECT event_id::text AS event_id, seq, event_type, "
        "(extract(epoch FROM applied_at) * 1000000)::bigint AS applied_us "
        "FROM inbox "
        "WHERE source = $2 AND aggregate_type = $3 AND aggregate_id = $1 "
        "ORDER BY seq",
        req.aggregate_id, req.source, req.aggregate_type);
    // The shared history is the longest prefix of the applied chain whose
    // events the producer holds, or held until its retention deleted them
    // (up to shared_through_seq); rows below pruned_through are gone and
    // count as shared (retention deletes only old, settled rows).
    auto seq_of = [&](size_t i) { return rows[i]["seq"].as<int64_t>(); };
    auto id_of = [&](size_t i) {
      return rows[i]["event_id"].as<std::string>();
    };
    size_t k = 0;
    while (k < rows.size() &&
           (seq_of(k) <= req.shared_through_seq || keep.count(id_of(k)))) {
      ++k;
    }
    out.applied_seq = k > 0 ? seq_of(k - 1) : pruned_through;
    std::vector<AppliedEvent> kept, gone;
    for (size_t i = 0; i < rows.size(); ++i) {
      (i < k ? kept : gone)
          .push_back(
              {id_of(i), seq_of(i), rows[i]["event_type"].as<std::string>()});
    }
    ArrayLiteral ids;
    for (size_t i = k; i < rows.size(); ++i) {
      Superseded e;
      e.event_id = id_of(i);
      e.seq = seq_of(i);
      e.event_type = rows[i]["event_type"].as<std::string>();
      e.applied_at = absl::FromUnixMicros(rows[i]["applied_us"].as<int64_t>());
      ids.Add(e.event_id);
      out.superseded.push_back(std::move(e));
    }
    if (!out.superseded.empty()) {
      tx.exec_params(
          "INSERT INTO inbox_superseded (event_id, source, aggregate_type, "
          "aggregate_id, seq, event_type, applied_at, operator, reason) "
          "SELECT event_id, source, aggregate_type, aggregate_id, seq, "
          "event_type, applied_at, $2, $3 FROM inbox WHERE "
          "event_id = ANY($1::uuid[])",
          ids.str(), req.operator_name, req.reason);
      tx.exec_params("DELETE FROM inbox WHERE event_id = ANY($1::uuid[])",
                     ids.str());
    }
    out.held_dropped =
        tx.exec_params("DELETE FROM held_events WHERE source = $2 AND "
                       "aggregate_type = $3 AND aggregate_id = $1",
                       req.aggregate_id, req.source, req.aggregate_type)
            .affected_rows();
    tx.exec_params(
        "INSERT INTO aggregate_cursors (source, aggregate_type, aggregate_id, "
        "last_seq, held_count) VALUES ($3, $4, $1, $2, 0) ON CONFLICT "
        "(source, aggregate_type, aggregate_id) DO UPDATE SET "
        "last_seq = EXCLUDED.last_seq, held_count = 0, updated_at = now()",
        req.aggregate_id, out.applied_seq, req.source, req.aggregate_type);
    if (handler_ != nullptr && !gone.empty()) {
      handler_->Rewound(tx, req.aggregate_id, kept, gone);
    }
    tx.commit();
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  spdlog::warn(
      "consumer: aggregate {} rewound to seq {} by {} ({}): {} applied "
      "events superseded, {} held events dropped",
      ChainLabel(chain), out.applied_seq, req.operator_name, req.reason,
      out.superseded.size(), out.held_dropped);
  return out;
}

}  // namespace outbox::inbox
