#include "inbox/batch_plan.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace outbox::inbox {
namespace {

using Key = std::pair<std::string, int64_t>;  // (chain, position)

v1::EventResult Result(const v1::Event& e, v1::DeliveryOutcome outcome,
                       std::string reason = "") {
  v1::EventResult r;
  r.set_event_id(e.event_id());
  r.set_seq(e.seq());
  r.set_outcome(outcome);
  r.set_reason(std::move(reason));
  return r;
}

// Whether two events with one id sit at the same place of one chain.
bool SamePlace(const v1::Event& a, const v1::Event& b) {
  return a.aggregate_id() == b.aggregate_id() &&
         a.aggregate_type() == b.aggregate_type() &&
         a.source() == b.source() && a.seq() == b.seq() &&
         a.prev_seq() == b.prev_seq();
}

bool Valid(const std::vector<std::string>& invalid, size_t i) {
  return invalid.empty() || invalid[i].empty();
}

// The held events of the snapshot and of this batch, by link (aggregate,
// prev_seq), by position (aggregate, seq) and by id. An event leaves every
// index when it drains.
class HeldIndex {
 public:
  void Add(const v1::Event* e) {
    // A legacy fork (two rows for one link) keeps the lowest seq.
    const std::string chain = ChainKeyOf(*e);
    auto [it, inserted] = by_link_.emplace(Key{chain, e->prev_seq()}, e);
    if (!inserted && e->seq() < it->second->seq()) it->second = e;
    by_position_.emplace(Key{chain, e->seq()}, e);
    by_id_.emplace(e->event_id(), e);
  }
  void Remove(const v1::Event* e) {
    const std::string chain = ChainKeyOf(*e);
    auto link = by_link_.find({chain, e->prev_seq()});
    if (link != by_link_.end() && link->second == e) by_link_.erase(link);
    auto pos = by_position_.find({chain, e->seq()});
    if (pos != by_position_.end() && pos->second == e) by_position_.erase(pos);
    auto id = by_id_.find(e->event_id());
    if (id != by_id_.end() && id->second == e) by_id_.erase(id);
  }
  const v1::Event* AtLink(const std::string& agg, int64_t prev) const {
    auto it = by_link_.find({agg, prev});
    return it == by_link_.end() ? nullptr : it->second;
  }
  const v1::Event* AtPosition(const std::string& agg, int64_t seq) const {
    auto it = by_position_.find({agg, seq});
    return it == by_position_.end() ? nullptr : it->second;
  }
  const v1::Event* WithId(const std::string& id) const {
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second;
  }
  std::vector<const v1::Event*> All() const {
    std::vector<const v1::Event*> out;
    for (const auto& [id, e] : by_id_) out.push_back(e);
    return out;
  }

 private:
  std::map<Key, const v1::Event*> by_link_;
  std::map<Key, const v1::Event*> by_position_;
  std::map<std::string, const v1::Event*> by_id_;
};

}  // namespace

Plan PlanBatch(const std::vector<const v1::Event*>& batch,
               const std::vector<std::string>& invalid,
               const Snapshot& snapshot, const PlanOptions& options) {
  Plan plan;
  plan.results.resize(batch.size());
  std::map<std::string, AggregateState> state = snapshot.aggregates;
  HeldIndex held;
  std::set<const v1::Event*> from_snapshot;
  for (const v1::Event& h : snapshot.held) {
    if (held.WithId(h.event_id()) != nullptr) continue;  // read twice
    held.Add(&h);
    from_snapshot.insert(&h);
  }
  std::map<const v1::Event*, size_t> batch_index;  // held in this batch
  // Ids applied in this batch, with the event applied under each.
  std::map<std::string, const v1::Event*> applied_here;
  std::set<const v1::Event*> drained_here;         // batch holds drained

  auto apply_one = [&](const v1::Event* e, AggregateState* st) {
    plan.apply.push_back(e);
    applied_here.emplace(e->event_id(), e);
    st->cursor = e->seq();
  };
  // Applies the held successors of the aggregate's cursor, in chain order.
  auto drain = [&](const std::string& agg, AggregateState* st) {
    while (const v1::Event* h = held.AtLink(agg, st->cursor)) {
      held.Remove(h);
      --st->held_count;
      if (from_snapshot.count(h)) {
        plan.unhold.push_back(h->event_id());
        if (snapshot.in_inbox.count(h->event_id())) {
          // Applied before at another position: a forged or corrupt row
          // that was answered HELD. It can never apply; the chain waits
          // for the real event of this link.
          ++plan.discarded;
          continue;
        }
        ++plan.drained;
      } else {
        // Held earlier in this batch: answered APPLIED, never written.
        const size_t i = batch_index.at(h);
        plan.results[i] = Result(*h, v1::APPLIED);
        drained_here.insert(h);
        --plan.held;
        ++plan.applied;
      }
      apply_one(h, st);
    }
  };
  for (const std::string& agg : snapshot.drain) {
    auto it = state.find(agg);
    if (it != state.end()) drain(agg, &it->second);
  }
  std::set<std::string> rejected_aggregates;  // a REJECTED event in this batch
  auto reject = [&](size_t i, std::string reason) {
    plan.results[i] = Result(*batch[i], v1::REJECTED, std::move(reason));
    rejected_aggregates.insert(ChainKeyOf(*batch[i]));
    ++plan.rejected;
  };
  // Not the event's fault: this database holds another history of its
  // aggregate. Later events of the aggregate in the batch defer, as after
  // a rejection.
  auto diverge = [&](size_t i, std::string reason) {
    plan.results[i] = Result(*batch[i], v1::DIVERGED, std::move(reason));
    rejected_aggregates.insert(ChainKeyOf(*batch[i]));
    ++plan.diverged;
  };

  for (size_t i = 0; i < batch.size(); ++i) {
    const v1::Event& e = *batch[i];
    if (!Valid(invalid, i)) {
      reject(i, invalid[i]);
      continue;
    }
    const std::string agg = ChainKeyOf(e);
    auto name = [&] { return ChainLabel(agg); };  // for people, when needed
    AggregateState& st = state.at(agg);
    // The same id applied earlier in this batch at another place: a
    // different event under a reused id, whatever its own position says.
    const auto here = applied_here.find(e.event_id());
    if (here != applied_here.end() && !SamePlace(*here->second, e)) {
      reject(i, absl::StrCat("event_id ", e.event_id(), " is applied in this "
                             "batch as seq ", here->second->seq(),
                             " of aggregate ",
                             ChainLabel(ChainKeyOf(*here->second)), "; seq ",
                             e.seq(), " of aggregate ", name(),
                             " reuses it"));
      continue;
    }
    if (e.seq() <= st.cursor) {
      const auto applied = snapshot.in_inbox.find(e.event_id());
      if (here != applied_here.end() ||
          (applied != snapshot.in_inbox.end() &&
           applied->second.aggregate_id == e.aggregate_id() &&
           applied->second.seq == e.seq())) {
        plan.results[i] = Result(e, v1::DUPLICATE);
        ++plan.duplicates;
      } else if (applied != snapshot.in_inbox.end()) {
        // Not this event: a DUPLICATE would tell the relay that it took
        // effect here.
        reject(i, absl::StrCat("event_id ", e.event_id(),
                               " was applied as seq ", applied->second.seq,
                               " of aggregate ", applied->second.aggregate_id,
                               "; seq ", e.seq(), " of aggregate ", name(),
                               " reuses it"));
      } else if (e.seq() <= st.pruned_through) {
        // Its inbox row is gone, so its identity cannot be checked: the
        // position was applied, and a redelivery is what arrives there.
        plan.results[i] = Result(e, v1::DUPLICATE);
        ++plan.duplicates;
        ++plan.pruned_duplicates;
      } else {
        ++plan.position_reused;
        diverge(i, absl::StrCat(
                       "position reused: seq ", e.seq(), " of aggregate ", name(),
                       " is at or below its applied position ", st.cursor,
                       ", but event ", e.event_id(),
                       " was never applied here; the outbox reused a position "
                       "(a restored backup or a failover that lost writes?)"));
      }
      continue;
    }
    if (snapshot.in_inbox.count(e.event_id())) {
      reject(i, absl::StrCat("event_id ", e.event_id(),
                             " was applied before at another position; seq ",
                             e.seq(), " reuses it"));
      continue;
    }
    if (const v1::Event* same = held.WithId(e.event_id())) {
      if (SamePlace(*same, e)) {
        plan.results[i] = Result(e, v1::HELD);  // a copy of a held event
        ++plan.held;
      } else {
        ++plan.forks;
        reject(i, absl::StrCat("fork: event_id ", e.event_id(),
                               " is held already as seq ", same->seq(),
                               " (prev_seq ", same->prev_seq(), ")"));
      }
      continue;
    }
    if (e.prev_seq() < st.cursor) {
      // The outbox's chain left this one before its last applied event:
      // that event is not in the outbox's history (lost by a failover of
      // the outbox database, or this database was restored from another).
      diverge(i, absl::StrCat("chain broken: prev_seq ", e.prev_seq(),
                              " is behind the applied position ", st.cursor,
                              " while seq ", e.seq(),
                              " is ahead of it: the outbox's history of "
                              "aggregate ",
                              name(), " differs from the one applied here"));
      continue;
    }
    const v1::Event* link = held.AtLink(agg, e.prev_seq());
    const v1::Event* position = held.AtPosition(agg, e.seq());
    if (link != nullptr || position != nullptr) {
      const v1::Event* other = link != nullptr ? link : position;
      ++plan.forks;
      reject(i, absl::StrCat("fork: aggregate ", name(), " already holds event ",
                             other->event_id(), " (seq ", other->seq(),
                             ", prev_seq ", other->prev_seq(), ") for ",
                             link != nullptr ? "prev_seq " : "seq ",
                             link != nullptr ? e.prev_seq() : e.seq(),
                             "; a second event for it forks the chain"));
      continue;
    }
    if (e.prev_seq() == st.cursor) {
      apply_one(&e, &st);
      plan.results[i] = Result(e, v1::APPLIED);
      ++plan.applied;
      drain(agg, &st);
      continue;
    }
    if (rejected_aggregates.count(agg)) {
      plan.results[i] = Result(e, v1::DEFERRED,
                               "an earlier event of its aggregate in this "
                               "batch was rejected");
      ++plan.deferred;
      continue;
    }
    if (st.held_count >= options.max_held_per_aggregate) {
      ++plan.over_cap;
      reject(i, absl::StrCat("aggregate ", name(), " holds ", st.held_count,
                             " events waiting for seq ", st.cursor,
                             "'s successor (--max_held_per_aggregate=",
                             options.max_held_per_aggregate, ")"));
      continue;
    }
    held.Add(&e);
    batch_index[&e] = i;
    ++st.held_count;
    plan.results[i] = Result(e, v1::HELD);
    ++plan.held;
  }

  // What the sender needs to tell what is missing: the applied position.
  for (size_t i = 0; i < batch.size(); ++i) {
    v1::EventResult& r = plan.results[i];
    if (r.outcome() != v1::HELD && r.outcome() != v1::DIVERGED) continue;
    auto it = state.find(ChainKeyOf(*batch[i]));
    if (it != state.end()) r.set_applied_seq(it->second.cursor);
  }

  // A copy of a held event answered HELD before a later event of the batch
  // drained it: it is applied now.
  for (v1::EventResult& r : plan.results) {
    if (r.outcome() == v1::HELD && applied_here.count(r.event_id())) {
      r.set_outcome(v1::APPLIED);
      --plan.held;
      ++plan.applied;
    }
  }
  // Held events that their chain passed with another event (a fork held
  // first): they can never apply. Those the plan knows leave now, and every
  // HELD answer for one becomes REJECTED; the writer deletes any others.
  std::map<std::string, std::string> passed;  // event id -> why
  for (const v1::Event* h : held.All()) {
    const std::string chain = ChainKeyOf(*h);
    AggregateState& st = state.at(chain);
    if (h->seq() > st.cursor) continue;
    passed[h->event_id()] =
        absl::StrCat("fork: aggregate ", ChainLabel(chain), " reached seq ",
                     st.cursor, " by another event; this event (seq ", h->seq(),
                     ", prev_seq ", h->prev_seq(), ") can never apply");
    held.Remove(h);
    --st.held_count;
    if (from_snapshot.count(h)) {
      plan.unhold.push_back(h->event_id());
      ++plan.discarded;
    }
  }
  for (size_t i = 0; i < plan.results.size(); ++i) {
    auto it = passed.find(plan.results[i].event_id());
    if (it == passed.end() || plan.results[i].outcome() != v1::HELD) continue;
    --plan.held;
    ++plan.forks;
    reject(i, it->second);
  }
  for (const auto& [e, i] : batch_index) {
    if (!drained_here.count(e) && !passed.count(e->event_id())) {
      plan.hold.push_back(e);
    }
  }
  std::sort(plan.hold.begin(), plan.hold.end(),
            [&](const v1::Event* a, const v1::Event* b) {
              return batch_index.at(a) < batch_index.at(b);
            });
  for (const auto& [agg, st] : state) {
    if (!(st == snapshot.aggregates.at(agg))) plan.changed[agg] = st;
  }
  return plan;
}

std::vector<std::string> InboxQuestions(
    const std::vector<const v1::Event*>& batch,
    const std::vector<std::string>& invalid, const Snapshot& snapshot,
    bool all) {
  std::vector<std::string> ids;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!Valid(invalid, i)) continue;
    const v1::Event& e = *batch[i];
    if (all || e.seq() <= snapshot.aggregates.at(ChainKeyOf(e)).cursor) {
      ids.push_back(e.event_id());
    }
  }
  if (all) {
    for (const v1::Event& h : snapshot.held) ids.push_back(h.event_id());
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

HeldQuery HeldQuestions(const std::vector<const v1::Event*>& batch,
                        const std::vector<std::string>& invalid,
                        const Snapshot& snapshot) {
  HeldQuery q;
  std::set<std::string> holding;
  for (const auto& [agg, st] : snapshot.aggregates) {
    if (st.held_count > 0) {
      holding.insert(agg);
      q.links.push_back({agg, st.cursor});
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!Valid(invalid, i)) continue;
    const v1::Event& e = *batch[i];
    const std::string chain = ChainKeyOf(e);
    if (!holding.count(chain)) continue;
    q.links.push_back({chain, e.seq()});
    q.links.push_back({chain, e.prev_seq()});
    q.positions.push_back({chain, e.seq()});
    q.ids.push_back(e.event_id());
  }
  for (auto* v : {&q.links, &q.positions}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  return q;
}

std::optional<Foreseen> Foresee(const std::vector<const v1::Event*>& batch,
                                const std::vector<std::string>& invalid) {
  if (batch.empty()) return std::nullopt;
  Foreseen f;
  std::set<std::string> ids;
  for (size_t i = 0; i < batch.size(); ++i) {
    const v1::Event& e = *batch[i];
    if (!Valid(invalid, i) || !ids.insert(e.event_id()).second ||
        e.seq() <= e.prev_seq()) {
      return std::nullopt;
    }
    auto [it, first] = f.chains.try_emplace(
        ChainKeyOf(e), Foreseen::Chain{e.prev_seq(), e.seq()});
    if (!first) {
      if (e.prev_seq() != it->second.through) return std::nullopt;
      it->second.through = e.seq();
    }
  }
  return f;
}

bool PlanIsForeseen(const Plan& plan,
                    const std::vector<const v1::Event*>& batch,
                    const Foreseen& foreseen) {
  if (plan.apply != batch || !plan.hold.empty() || !plan.unhold.empty() ||
      plan.results.size() != batch.size() ||
      plan.changed.size() != foreseen.chains.size()) {
    return false;
  }
  for (const v1::EventResult& r : plan.results) {
    if (r.outcome() != v1::APPLIED) return false;
  }
  for (const auto& [chain, c] : foreseen.chains) {
    auto it = plan.changed.find(chain);
    if (it == plan.changed.end() || it->second.cursor != c.through ||
        it->second.held_count != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace outbox::inbox
