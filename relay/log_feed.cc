#include "relay/log_feed.h"

#include <algorithm>
#include <utility>

namespace outbox::relay {

LogFeed::LogFeed(LogFeedOptions options) : options_(std::move(options)) {}

bool LogFeed::BeginRound(absl::Time now, bool heard) {
  heard_ = heard;
  exceptions_round_ = false;
  if (!exceptions_ && now < next_exception_claim_) return false;
  next_exception_claim_ = now + options_.poll_interval;
  return true;
}

bool LogFeed::Fresh(absl::Time now, bool listening) {
  // An idle relay makes one tick per poll_interval at most.
  bool fresh = heard_ || active_ || !listening || now >= retry_at_;
  if (now >= next_poll_) {
    fresh = true;
    next_poll_ = now + options_.poll_interval;
  }
  return fresh;
}

void LogFeed::Observe(const LogSend& read, bool fresh, absl::Time now) {
  active_ = !read.events.empty() || read.diverted > 0;
  exceptions_round_ |= read.exceptions;
  if (read.retry_in > absl::ZeroDuration()) {
    retry_at_ = std::min(retry_at_, now + read.retry_in);
  } else if (fresh) {
    retry_at_ = absl::InfiniteFuture();
  }
}

absl::StatusOr<LogSend> LogFeed::Read(pqxx::connection& conn,
                                      const std::vector<int>& partitions,
                                      int limit, bool listening) {
  if (reader_ == nullptr)
    reader_ = std::make_unique<LogReader>(options_.reader);
  const bool fresh = Fresh(absl::Now(), listening);
  absl::StatusOr<LogSend> read = reader_->Next(conn, partitions, limit, fresh);
  if (read.ok()) Observe(*read, fresh, absl::Now());
  return read;
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
