#include "relay/consumer_watch.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/db.h"

namespace outbox::relay {

ConsumerWatch::ConsumerWatch(std::string subscription,
                             const RelayCounters* counters)
    : subscription_(std::move(subscription)), counters_(counters) {}

bool ConsumerWatch::Observe(const v1::DeliverResponse& response,
                            int64_t high_at_send) {
  if (response.has_inbox()) {
    const DatabaseIdentity inbox = FromProto(response.inbox());
    if (inbox.known() && inbox != identity_ &&
        !(seen_.has_value() && *seen_ == inbox)) {
      seen_ = inbox;
      inbox_high_ = 0;  // another database: its own numbers
    }
  }
  if (response.applied_from() <= 0) return false;
  bool went_back = false;
  // Everything answered before this batch was sent was numbered before
  // this batch's rows were: a number at or below those went back.
  if (response.applied_from() <= high_at_send && went_back_.empty()) {
    went_back_ = absl::StrCat(
        "numbered an applied event ", response.applied_from(),
        " after it had answered for number ", high_at_send,
        ": the consumer's database went back in time under the same "
        "identity (restored in place?)");
    inbox_high_ = 0;
    went_back = true;
  }
  inbox_high_ = std::max(inbox_high_, response.applied_through());
  return went_back;
}

void ConsumerWatch::Lacks(const std::vector<ChainRange>& ranges) {
  reowe_.insert(reowe_.end(), ranges.begin(), ranges.end());
}

absl::StatusOr<ConsumerWatch::Recorded> ConsumerWatch::Record(
    pqxx::connection_base& conn) {
  Recorded recorded;
  if (!pending()) return recorded;
  std::optional<DatabaseIdentity> old;
  ReOwed owed;
  try {
    // A transaction, also when the session is not pooled: ReOwe holds
    // retention back until the commit.
    auto tx = std::make_unique<pqxx::work>(conn);
    ApplyLimits(*tx);
    if (!went_back_.empty()) {
      RequestHeal(*tx, subscription_, absl::StrCat("the consumer ", went_back_));
    }
    if (seen_.has_value()) {
      old = StoreConsumerIdentity(*tx, subscription_, *seen_);
    }
    if (!reowe_.empty()) owed = ReOwe(*tx, subscription_, reowe_);
    const int64_t gaps = RecordGaps(*tx, subscription_, owed);
    tx->commit();
    if (counters_ != nullptr) counters_->diverged->Add(gaps);
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  if (seen_.has_value()) {
    // What this relay knew, else what the subscription had stored (a
    // replica that stored it first requested the heal).
    const DatabaseIdentity before =
        identity_.known() ? identity_ : old.value_or(DatabaseIdentity{});
    const IdentityChange c = CompareIdentity(before, *seen_);
    if (c.changed()) {
      if (counters_ != nullptr) counters_->ConsumerChanged(c);
      spdlog::error(
          "relay: subscription {}'s consumer database {}; was {}, now {}; {}",
          subscription_, c.Describe(), before.ToString(), seen_->ToString(),
          old.has_value() && old->known()
              ? "a heal compares the consumer's cursors with what was "
                "delivered and delivers again what it lost"
              : "another replica saw it first and requested the heal");
    } else if (!before.known()) {
      spdlog::info("relay: the consumer's database is {}", seen_->ToString());
    }
    identity_ = *seen_;
    seen_.reset();
    recorded.consumer_database = identity_.Key();
  }
  if (!went_back_.empty()) {
    if (counters_ != nullptr) counters_->ConsumerWentBack();
    spdlog::error(
        "relay: subscription {}'s consumer {}; a heal compares its cursors "
        "with what was delivered and delivers again what it lost",
        subscription_, went_back_);
    went_back_.clear();
  }
  if (!reowe_.empty()) {
    std::set<std::string> aggs;
    for (const ChainRange& r : reowe_) aggs.insert(r.chain);
    if (counters_ != nullptr) counters_->redelivered_held->Add(owed.owed);
    spdlog::warn(
        "relay: the consumer answered HELD for events whose predecessors it "
        "had answered before (its database lost commits?): {} events of {} "
        "aggregates owed again",
        owed.owed, aggs.size());
    reowe_.clear();
    recorded.owed = true;
  }
  return recorded;
}

}  // namespace outbox::relay
