#include "relay/heal.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <map>
#include <pqxx/pqxx>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/db.h"
#include "common/schema.h"
#include "relay/delivery_store.h"

namespace outbox::relay {
namespace {

absl::Status FromGrpc(const grpc::Status& s, const char* what) {
  return absl::UnavailableError(
      absl::StrCat(what, ": ", s.error_message(), " (gRPC code ",
                   static_cast<int>(s.error_code()), ")"));
}

}  // namespace

std::string HealReport::Summary() const {
  return absl::StrFormat(
      "%d aggregates at the consumer, %d in the outbox; %d events of %d "
      "aggregates delivered again; %d aggregates diverged; in %s",
      consumer_aggregates, outbox_aggregates, redelivered,
      redelivered_aggregates, diverged, absl::FormatDuration(took));
}

Healer::Healer(std::string subscription, v1::EventSink::Stub* stub,
               absl::Duration rpc_timeout, int page)
    : subscription_(std::move(subscription)),
      stub_(stub),
      rpc_timeout_(rpc_timeout),
      page_(page) {}

absl::StatusOr<HealReport> Healer::Run(pqxx::connection& conn,
                                       const std::string& source) {
  const absl::Time t0 = absl::Now();
  HealReport report;
  auto cursors =
      [&](v1::GetCursorsRequest req) -> absl::StatusOr<v1::GetCursorsResponse> {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     absl::ToChronoMilliseconds(rpc_timeout_));
    v1::GetCursorsResponse resp;
    req.set_source(source);
    grpc::Status s = stub_->GetCursors(&ctx, req, &resp);
    if (!s.ok()) return FromGrpc(s, "the consumer's cursors");
    return resp;
  };
  try {
    // What is known already: open divergences wait for an operator.
    // By chain (OutboxChain); one recorded before chains had a type is
    // of every chain of its id, as is a consumer's cursor from then.
    std::set<std::string> diverged;
    std::set<std::string> diverged_ids;
    auto is_diverged = [&](const std::string& type, const std::string& id) {
      return diverged.count(OutboxChain(type, id)) ||
             diverged.count(OutboxChain("", id)) ||
             (type.empty() && diverged_ids.count(id));
    };
    int64_t min_retained = 0, start_seq = 0;
    bool on_log = false;
    {
      auto unit = OpenUnit(conn);
      for (const v1::Divergence& d :
           ListDivergences(*unit, subscription_, false, 1000000)) {
        diverged.insert(OutboxChain(d.aggregate_type(), d.aggregate_id()));
        diverged_ids.insert(d.aggregate_id());
      }
      const pqxx::row r = unit->exec_params1(
          absl::StrCat("SELECT ", kMinRetainedSql,
                       " AS min_retained, start_seq, start_tick IS NOT NULL "
                       "AS on_log FROM subscriptions WHERE name = $1"),
          subscription_);
      min_retained = r["min_retained"].as<int64_t>();
      start_seq = r["start_seq"].as<int64_t>();
      on_log = r["on_log"].as<bool>();
      unit->commit();
    }

    // 1. From the consumer back: an applied event the outbox does not hold
    //    (and retention did not delete: it deletes below min_retained).
    v1::GetCursorsRequest page_req;
    page_req.set_limit(page_);
    for (int pages = 0; pages < 100000; ++pages) {
      auto page = cursors(page_req);
      if (!page.ok()) return page.status();
      report.consumer_aggregates += page->cursors_size();
      ArrayLiteral ids;
      for (const v1::AggregateCursor& c : page->cursors()) {
        if (!c.applied_event_id().empty()) ids.Add(c.applied_event_id());
      }
      std::set<std::string> held_here;
      auto unit = OpenUnit(conn);
      for (const auto& row : unit->exec_params(
               "SELECT event_id::text FROM outbox WHERE event_id = "
               "ANY($1::uuid[])",
               ids.str())) {
        held_here.insert(row["event_id"].as<std::string>());
      }
      // Retention may have deleted an applied event since min_retained was
      // read, or since this page's cursors were: looked at again after the
      // lookup above, an event not held there lies below it now, unless
      // it never was in this outbox.
      min_retained = std::max(
          min_retained,
          unit->exec(absl::StrCat("SELECT ", kMinRetainedSql))[0][0]
              .as<int64_t>());
      std::vector<NewDivergence> found;
      for (const v1::AggregateCursor& c : page->cursors()) {
        if (c.applied_event_id().empty() || c.applied_seq() < min_retained ||
            held_here.count(c.applied_event_id()) ||
            is_diverged(c.aggregate_type(), c.aggregate_id())) {
          continue;
        }
        NewDivergence d = NewDivergence::Of(
            subscription_, OutboxChain(c.aggregate_type(), c.aggregate_id()));
        d.kind = "consumer_ahead";
        d.detail = absl::StrCat(
            "the consumer applied event ", c.applied_event_id(), " (seq ",
            c.applied_seq(),
            ") of this aggregate, which the outbox does not hold: it was "
            "committed and delivered, then lost (a failover of the outbox "
            "database to a standby that lacked it?), or the consumer's "
            "database holds another outbox's history");
        d.consumer_seq = c.applied_seq();
        d.consumer_event_id = c.applied_event_id();
        found.push_back(std::move(d));
      }
      // One statement for the page's: one each made a heal after a
      // failover take seconds, during which operators saw only part.
      const std::vector<bool> recorded = RecordDivergences(*unit, found);
      for (size_t i = 0; i < found.size(); ++i) {
        if (!recorded[i]) continue;
        ++report.diverged;
        diverged.insert(
            OutboxChain(found[i].aggregate_type, found[i].aggregate_id));
        diverged_ids.insert(found[i].aggregate_id);
        spdlog::error("relay: heal of {}: aggregate {} diverged: {}",
                      subscription_,
                      ChainLabel(OutboxChain(found[i].aggregate_type,
                                             found[i].aggregate_id)),
                      found[i].detail);
      }
      unit->commit();
      if (!page->more() || page->cursors_size() == 0) break;
      page_req.set_after_aggregate_id(
          page->cursors(page->cursors_size() - 1).aggregate_id());
      page_req.set_after_aggregate_type(
          page->cursors(page->cursors_size() - 1).aggregate_type());
    }

    // 2. From the outbox on: each aggregate's delivered events (its chain
    //    up to the predecessor of its first undelivered one) against the
    //    consumer's cursor; what lies between is owed again. Undelivered:
    //    an event with a delivery row (pending, dead, diverged, or an
    //    exception of a subscription on the log) and, on the log, one its
    //    partition's position has not passed (kDeliveryStatusSql). Taken
    //    for delivered, what the log still owes would all be owed again as
    //    rows: a backlog copied into exceptions, each event sent twice.
    //    The log's statement would serve a subscription on rows too (there
    //    it reduces to `d.seq IS NOT NULL`), but it reads the whole outbox
    //    where the rows' statement reads only that subscription's rows.
    static const std::string kFirstUndeliveredSql =
        "SELECT o.aggregate_type, d.aggregate_id, min(d.seq) AS first "
        "FROM outbox_delivery d JOIN outbox o ON o.seq = d.seq WHERE "
        "d.subscription = $1 GROUP BY 1, 2";
    static const std::string kFirstUndeliveredOnLogSql = absl::StrCat(
        "SELECT o.aggregate_type, o.aggregate_id, min(o.seq) AS first "
        "FROM outbox o JOIN subscriptions s ON s.name = $1 "
        "LEFT JOIN outbox_delivery d ON d.subscription = $1 AND d.seq = o.seq",
        kDeliveryLogJoinsSql, "WHERE d.seq IS NOT NULL OR ",
        kDeliveryStatusSql, " = '", kDeliveryPending, "' GROUP BY 1, 2");
    std::map<std::string, int64_t> first_undelivered;
    {
      auto unit = OpenUnit(conn);
      for (const auto& row : unit->exec_params(
               on_log ? kFirstUndeliveredOnLogSql : kFirstUndeliveredSql,
               subscription_)) {
        first_undelivered[OutboxChain(row["aggregate_type"].as<std::string>(),
                                      row["aggregate_id"].as<std::string>())] =
            row["first"].as<int64_t>();
      }
      unit->commit();
    }
    std::string after_type, after_id;
    for (int pages = 0; pages < 100000; ++pages) {
      std::map<std::string, int64_t> delivered_through;
      {
        auto unit = OpenUnit(conn);
        const pqxx::result heads = unit->exec_params(
            "SELECT aggregate_type, aggregate_id, last_seq FROM outbox_heads "
            "WHERE (aggregate_type, aggregate_id) > ($1, $2) ORDER BY "
            "aggregate_type, aggregate_id LIMIT $3",
            after_type, after_id, page_);
        if (heads.empty()) break;
        after_type =
            heads[heads.size() - 1]["aggregate_type"].as<std::string>();
        after_id = heads[heads.size() - 1]["aggregate_id"].as<std::string>();
        ArrayLiteral firsts;
        for (const auto& h : heads) {
          const std::string agg =
              OutboxChain(h["aggregate_type"].as<std::string>(),
                          h["aggregate_id"].as<std::string>());
          int64_t& d = delivered_through[agg];
          auto f = first_undelivered.find(agg);
          if (f == first_undelivered.end()) {
            d = std::max(d, h["last_seq"].as<int64_t>());
          } else {
            firsts.Add(f->second);
          }
        }
        for (const auto& row : unit->exec_params(
                 "SELECT aggregate_type, aggregate_id, prev_seq FROM outbox "
                 "WHERE seq = ANY($1::bigint[])",
                 firsts.str())) {
          int64_t& d = delivered_through[OutboxChain(
              row["aggregate_type"].as<std::string>(),
              row["aggregate_id"].as<std::string>())];
          d = std::max(d, row["prev_seq"].as<int64_t>());
        }
        unit->commit();
        report.outbox_aggregates += heads.size();
      }
      std::vector<std::string> ask;
      std::set<std::string> ask_ids;
      for (const auto& [agg, through] : delivered_through) {
        ChainId c;
        ParseChainKey(agg, &c);
        if (through >= start_seq && through > 0 && !is_diverged(c.type, c.id)) {
          ask.push_back(agg);
          ask_ids.insert(c.id);
        }
      }
      if (ask.empty()) continue;
      v1::GetCursorsRequest only;
      for (const std::string& a : ask_ids) only.add_aggregate_ids(a);
      auto page = cursors(only);
      if (!page.ok()) return page.status();
      // A cursor recorded before chains had a type (aggregate_type "")
      // stands for each chain of its id that has no cursor of its own.
      std::map<std::string, int64_t> applied;
      for (const v1::AggregateCursor& c : page->cursors()) {
        applied[OutboxChain(c.aggregate_type(), c.aggregate_id())] =
            c.applied_seq();
      }
      std::vector<ChainRange> ranges;
      for (const std::string& a : ask) {
        auto it = applied.find(a);
        if (it == applied.end()) {
          ChainId c;
          ParseChainKey(a, &c);
          it = applied.find(OutboxChain("", c.id));
        }
        const int64_t at = it == applied.end() ? 0 : it->second;
        const int64_t through = delivered_through[a];
        if (at < through) ranges.push_back({a, at, through});
      }
      if (ranges.empty()) continue;
      pqxx::work tx(conn);  // ReOwe holds retention back until the commit
      ApplyLimits(tx);
      const ReOwed owed = ReOwe(tx, subscription_, ranges);
      report.diverged += RecordGaps(tx, subscription_, owed, &applied);
      tx.commit();
      report.redelivered += owed.owed;
      report.redelivered_aggregates += ranges.size();
    }
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  report.took = absl::Now() - t0;
  return report;
}

}  // namespace outbox::relay
