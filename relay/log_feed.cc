#include "relay/log_feed.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "common/db.h"
#include "relay/fence.h"
#include "relay/outbox_log.h"

namespace outbox::relay {

LogFeed::LogFeed(LogFeedOptions options) : options_(std::move(options)) {}

bool LogFeed::BeginRound(absl::Time now, std::optional<absl::Time> heard) {
  if (heard.has_value()) must_show_ = std::max(must_show_, *heard);
  exceptions_round_ = false;
  if (!exceptions_ && now < next_exception_claim_) return false;
  next_exception_claim_ = now + options_.poll_interval;
  return true;
}

void LogFeed::Owed() {
  exceptions_ = exceptions_round_ = true;
  if (reader_ != nullptr) reader_->ExceptionsOwed();
}

absl::Time LogFeed::MustShow(absl::Time now, bool listening) {
  // An idle relay asks for a tick once per poll_interval at most.
  if (!listening || active_) must_show_ = std::max(must_show_, now);
  if (now >= next_poll_) {
    must_show_ = std::max(must_show_, now);
    next_poll_ = now + options_.poll_interval;
  }
  return must_show_;
}

void LogFeed::Observe(const LogSend& read, absl::Time now) {
  active_ = !read.events.empty() || read.diverted > 0;
  exceptions_round_ |= read.exceptions;
  if (read.shows_before >= must_show_) {
    must_show_ = absl::InfinitePast();
    retry_at_ = absl::InfiniteFuture();
    return;
  }
  // Still owed. A retry that came due is served by this read, which may
  // have set the next one (a read that wanted no new range sets none: its
  // answers wake the worker, and the next read asks).
  if (retry_at_ <= now) retry_at_ = absl::InfiniteFuture();
  if (read.retry_in > absl::ZeroDuration()) {
    retry_at_ = std::min(retry_at_, now + read.retry_in);
  }
}

absl::StatusOr<LogSend> LogFeed::Read(pqxx::connection& conn,
                                      const std::vector<int>& partitions,
                                      int limit, bool listening) {
  if (reader_ == nullptr)
    reader_ = std::make_unique<LogReader>(options_.reader);
  const absl::Time must_show = MustShow(absl::Now(), listening);
  absl::StatusOr<LogSend> read =
      reader_->Next(conn, partitions, limit, must_show);
  if (!read.ok()) return read;
  Observe(*read, absl::Now());
  if (options_.fenced && !read->events.empty()) {
    try {
      auto unit = OpenUnit(conn);
      read->lsn = WalPastVisibleCommits(*unit);
      unit->commit();
    } catch (const std::exception& e) {
      // Its events would stay in flight with no batch to answer them.
      Rewind();
      return StatusFromException(e);
    }
  }
  return read;
}

absl::Status LogFeed::Rebase(pqxx::connection_base& conn) {
  try {
    pqxx::work tx(conn);
    ApplyLimits(tx);
    absl::StatusOr<Rebased> r = RebaseLog(tx);
    if (!r.ok()) return r.status();
    tx.commit();
    if (r->rebased) {
      spdlog::error(
          "relay: the outbox's transaction ids lie behind its log's (a dump "
          "restored into another cluster?): {} events the log had not "
          "delivered are owed as exceptions, and the log restarts at tick {}",
          r->owed, r->tick);
    }
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  Owed();
  Reset();
  return absl::OkStatus();
}

bool LogFeed::FlushDue(absl::Time now, bool force) {
  if (reader_ == nullptr || !reader_->moved()) return false;
  if (!force && now < next_flush_) return false;
  next_flush_ = now + options_.flush_interval;
  return true;
}

absl::StatusOr<std::vector<int>> LogFeed::Flush(pqxx::connection& conn) {
  if (reader_ == nullptr) return std::vector<int>{};
  return reader_->Flush(conn);
}

absl::Duration LogFeed::RetryWait(absl::Time now) const {
  if (retry_at_ == absl::InfiniteFuture()) return absl::InfiniteDuration();
  return std::max(absl::ZeroDuration(), retry_at_ - now);
}

void LogFeed::Settle(int64_t seq) {
  if (reader_ != nullptr) reader_->Settle(seq);
}

void LogFeed::Rewind() {
  if (reader_ != nullptr) reader_->Rewind();
}

void LogFeed::Forget(const std::vector<int>& partitions) {
  if (reader_ != nullptr) reader_->Forget(partitions);
}

}  // namespace outbox::relay
