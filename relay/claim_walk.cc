#include "relay/claim_walk.h"

#include <algorithm>

#include "relay/policy.h"

namespace outbox::relay {

ClaimWalk::ClaimWalk(ClaimCursor* cursor, const Start& start)
    : cursor_(cursor), poll_interval_(start.poll_interval) {
  fresh_ =
      ClaimAboveSent({.outstanding = start.outstanding,
                      .batch_size = start.batch_size,
                      .sent_through = cursor_->sent_through,
                      .full_claim_due = start.now >= cursor_->next_full_claim,
                      .passed_over = cursor_->passed_over,
                      .freed_since = cursor_->freed_at_claim != start.freed ||
                                     start.riding_frees});
  if (!fresh_) cursor_->next_full_claim = start.now + poll_interval_;
  after_ = fresh_ ? cursor_->sent_through : 0;
}

ClaimWalk::Next ClaimWalk::Claimed(size_t rows, int64_t last_seq, bool excluded,
                                   uint64_t freed, absl::Time now) {
  if (fresh_) {
    cursor_->passed_over |= excluded;
    cursor_->freed_at_claim = freed;
  } else {
    cursor_->passed_over = false;  // this claim saw every ready row
  }
  if (rows == 0) {
    if (!fresh_) return kDone;
    FromTheStart(now);
    return kAgain;
  }
  after_ = std::max(after_, last_seq);
  return kBatch;
}

bool ClaimWalk::Continue(size_t rows, int limit, bool cut, absl::Time now) {
  if (cut) return false;
  if (static_cast<int64_t>(rows) < limit) {
    if (!fresh_) return false;
    // The new rows are claimed: now the passed-over ones.
    FromTheStart(now);
  }
  return true;
}

void ClaimWalk::FromTheStart(absl::Time now) {
  fresh_ = false;
  after_ = 0;
  cursor_->next_full_claim = now + poll_interval_;
}

}  // namespace outbox::relay
