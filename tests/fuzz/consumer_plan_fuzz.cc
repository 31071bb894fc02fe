// Fuzzes the consumer's decisions (inbox/batch_plan.h) on arbitrary
// delivery sequences: a few aggregates' true chains, delivered in any
// order, in batches of any size, with duplicates; optionally mixed with
// forged events (a reused position, a fork, garbage) and invalid ones. The
// planner runs against an in-memory billing database that a model writer
// updates as the real applier would (including its second try when the
// inbox knows an id the plan did not), and checked after every batch:
//   - one answer per event, for that event;
//   - no event applied twice, no position applied twice;
//   - every aggregate applied in chain order (each applied event's prev_seq
//     is the aggregate's last applied seq);
//   - held events are above their cursor, one per link and position, and
//     each aggregate's held count is exact;
//   - APPLIED/DUPLICATE/HELD answers match what the database then holds;
//     DEFERRED only follows a rejected, diverged or deferred event of its
//     aggregate in the same batch, and writes nothing; DIVERGED (another
//     history: a reused position, a broken chain) needs a forgery, writes
//     nothing and says where the aggregate stands.
// Without forgeries, no true event is ever REJECTED, and once every true
// event has been delivered in order at the end, all are applied and
// nothing is held.

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "inbox/batch_plan.h"

namespace {

using outbox::inbox::AggregateState;
using outbox::inbox::Plan;
using outbox::inbox::Snapshot;
using outbox::v1::Event;
using Key = std::pair<std::string, int64_t>;

// Fails the run, saying which property broke.
#define Require(cond)                                                   \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "%s:%d: violated: %s\n", __FILE__, __LINE__, \
                   #cond);                                              \
      std::abort();                                                     \
    }                                                                   \
  } while (0)

// The billing database as the applier leaves it.
struct Store {
  std::map<std::string, AggregateState> cursors;
  std::map<std::string, Event> held;  // by event id
  std::map<std::string, outbox::inbox::InboxPlace> inbox;
  std::set<Key> inbox_positions;

  const Event* HeldAtLink(const std::string& agg, int64_t prev) const {
    for (const auto& [id, e] : held) {
      if (outbox::ChainKeyOf(e) == agg && e.prev_seq() == prev) return &e;
    }
    return nullptr;
  }
};

// What the applier reads under the cursor locks, answered from `store`.
Snapshot Read(const Store& store, const std::vector<const Event*>& batch,
              const std::vector<std::string>& invalid, bool ask_all) {
  Snapshot snap;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!invalid[i].empty()) continue;
    auto it = store.cursors.find(outbox::ChainKeyOf(*batch[i]));
    snap.aggregates[outbox::ChainKeyOf(*batch[i])] =
        it == store.cursors.end() ? AggregateState{} : it->second;
  }
  const auto q = outbox::inbox::HeldQuestions(batch, invalid, snap);
  if (!q.empty()) {
    for (auto [agg, pos] : q.links) {  // the chain from each link
      while (const Event* h = store.HeldAtLink(agg, pos)) {
        snap.held.push_back(*h);
        pos = h->seq();
      }
    }
    for (const auto& [id, e] : store.held) {
      if (std::count(q.ids.begin(), q.ids.end(), id) ||
          std::count(q.positions.begin(), q.positions.end(),
                     Key{outbox::ChainKeyOf(e), e.seq()})) {
        snap.held.push_back(e);
      }
    }
  }
  for (const std::string& id :
       outbox::inbox::InboxQuestions(batch, invalid, snap, ask_all)) {
    if (auto it = store.inbox.find(id); it != store.inbox.end()) {
      snap.in_inbox[id] = it->second;
    }
  }
  return snap;
}

// Writes `plan` as the applier would; false when the inbox insert collides
// (the transaction then rolls back and nothing changes).
bool Write(Store* store, const Plan& plan) {
  std::set<std::string> ids;
  std::set<Key> positions;
  for (const Event* e : plan.apply) {
    Key pos{outbox::ChainKeyOf(*e), e->seq()};
    if (store->inbox.count(e->event_id()) ||
        store->inbox_positions.count(pos) ||
        !ids.insert(e->event_id()).second || !positions.insert(pos).second) {
      return false;
    }
  }
  // Chain order: every applied event follows the aggregate's last one.
  std::map<std::string, int64_t> last;
  for (const auto& [agg, st] : store->cursors) last[agg] = st.cursor;
  for (const Event* e : plan.apply) {
    Require(e->prev_seq() == last[outbox::ChainKeyOf(*e)]);
    last[outbox::ChainKeyOf(*e)] = e->seq();
  }
  for (const Event* e : plan.apply) {
    store->inbox[e->event_id()] = {e->aggregate_id(), e->seq()};
    store->inbox_positions.insert({outbox::ChainKeyOf(*e), e->seq()});
  }
  for (const std::string& id : plan.unhold) Require(store->held.erase(id) == 1);
  for (const Event* e : plan.hold) {
    // The unique indexes on held_events: one event per id, link, position.
    Require(!store->held.count(e->event_id()));
    for (const auto& [id, h] : store->held) {
      Require(!(outbox::ChainKeyOf(h) == outbox::ChainKeyOf(*e) &&
                (h.prev_seq() == e->prev_seq() || h.seq() == e->seq())));
    }
    store->held[e->event_id()] = *e;
  }
  for (const auto& [agg, st] : plan.changed) {
    store->cursors[agg] = st;
    // The writer's delete of held events the chain passed (forks).
    for (auto it = store->held.begin(); it != store->held.end();) {
      if (outbox::ChainKeyOf(it->second) == agg && it->second.seq() <= st.cursor) {
        --store->cursors[agg].held_count;
        it = store->held.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const auto& [agg, l] : last) {
    Require(store->cursors[agg].cursor == l);
  }
  return true;
}

void CheckStore(const Store& store) {
  std::map<std::string, int64_t> count;
  for (const auto& [id, e] : store.held) {
    ++count[outbox::ChainKeyOf(e)];
    auto it = store.cursors.find(outbox::ChainKeyOf(e));
    Require(it != store.cursors.end() && e.seq() > it->second.cursor);
    // A held event never waits at its aggregate's cursor: it would have
    // been drained.
    Require(e.prev_seq() != it->second.cursor);
  }
  for (const auto& [agg, st] : store.cursors) {
    Require(st.held_count == (count.count(agg) ? count.at(agg) : 0));
  }
}

// OUTBOX_FUZZ_TRACE=1 prints every batch and its answers (to replay a
// failing input: consumer_plan_fuzz crash-...).
bool Tracing() {
  static const bool on = std::getenv("OUTBOX_FUZZ_TRACE") != nullptr;
  return on;
}

// One delivered batch through read, plan and write, with the applier's
// second try; checks the answers.
void Deliver(Store* store, const std::vector<Event>& batch_events,
             const std::vector<std::string>& invalid,
             const std::set<std::string>& true_ids, bool forgeries) {
  std::vector<const Event*> batch;
  for (const Event& e : batch_events) batch.push_back(&e);
  const auto inbox_before = store->inbox;
  Snapshot snap = Read(*store, batch, invalid, false);
  Plan plan = outbox::inbox::PlanBatch(batch, invalid, snap, {8});
  if (!Write(store, plan)) {
    snap = Read(*store, batch, invalid, true);
    plan = outbox::inbox::PlanBatch(batch, invalid, snap, {8});
    Require(Write(store, plan));
  }
  Require(plan.results.size() == batch.size());
  if (Tracing()) {
    for (size_t i = 0; i < batch.size(); ++i) {
      std::fprintf(
          stderr, "  %s %s seq %lld prev %lld -> %s %s\n",
          batch[i]->aggregate_id().c_str(), batch[i]->event_id().c_str(),
          static_cast<long long>(batch[i]->seq()),
          static_cast<long long>(batch[i]->prev_seq()),
          outbox::v1::DeliveryOutcome_Name(plan.results[i].outcome()).c_str(),
          plan.results[i].reason().c_str());
    }
    for (const auto& [agg, st] : store->cursors) {
      std::fprintf(stderr, "  = %s cursor %lld held %lld\n", agg.c_str(),
                   static_cast<long long>(st.cursor),
                   static_cast<long long>(st.held_count));
    }
    std::fprintf(stderr, "--\n");
  }
  // The answer of event i wrote nothing of it: it is not in the inbox, or
  // was before, or the same event is applied again elsewhere in the batch.
  const auto NothingWritten = [&](size_t i) {
    const std::string& id = batch[i]->event_id();
    for (size_t j = 0; j < batch.size(); ++j) {
      if (j != i && batch[j]->event_id() == id &&
          plan.results[j].outcome() == outbox::v1::APPLIED) {
        return true;
      }
    }
    return !store->inbox.count(id) || inbox_before.count(id) > 0;
  };
  const auto CursorOf = [&](const std::string& aggregate) -> int64_t {
    auto it = store->cursors.find(aggregate);
    return it == store->cursors.end() ? 0 : it->second.cursor;
  };
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& r = plan.results[i];
    const Event& e = *batch[i];
    Require(r.event_id() == e.event_id() && r.seq() == e.seq());
    switch (r.outcome()) {
      case outbox::v1::APPLIED:
        Require(store->inbox.count(e.event_id()) &&
                !inbox_before.count(e.event_id()));
        break;
      case outbox::v1::DUPLICATE:
        Require(store->inbox.count(e.event_id()));
        break;
      case outbox::v1::HELD:
        Require(store->held.count(e.event_id()) ||
                store->inbox.count(e.event_id()));
        break;
      case outbox::v1::REJECTED:
        Require(!r.reason().empty());
        if (!forgeries && invalid[i].empty())
          Require(!true_ids.count(e.event_id()));
        break;
      case outbox::v1::DIVERGED:
        // Another history of the aggregate (a reused position, a broken
        // chain): not the event's fault, never a true event's unless a
        // forgery came first, nothing of it written, and the answer says
        // where the aggregate stands.
        Require(forgeries);
        Require(!r.reason().empty());
        Require(NothingWritten(i));
        Require(r.applied_seq() == CursorOf(outbox::ChainKeyOf(e)));
        break;
      case outbox::v1::DEFERRED: {
        // Only behind an earlier event of its aggregate in this batch that
        // was rejected, diverged or deferred; nothing of it written.
        Require(forgeries);
        bool behind = false;
        for (size_t j = 0; j < i; ++j) {
          behind |= outbox::ChainKeyOf(*batch[j]) == outbox::ChainKeyOf(e) &&
                    (plan.results[j].outcome() == outbox::v1::REJECTED ||
                     plan.results[j].outcome() == outbox::v1::DIVERGED ||
                     plan.results[j].outcome() == outbox::v1::DEFERRED);
        }
        Require(behind);
        Require(NothingWritten(i));
        break;
      }
      default:
        Require(false);
    }
  }
  CheckStore(*store);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const bool forgeries = in.ConsumeBool();
  const int aggregates = in.ConsumeIntegralInRange(1, 4);
  std::vector<int> left(aggregates);
  for (int& n : left) n = in.ConsumeIntegralInRange(1, 8);
  // The true chains, interleaved by global seq, with gaps.
  std::vector<Event> truth;
  std::vector<int64_t> tail(aggregates, 0);
  std::vector<std::vector<size_t>> chain(aggregates);
  int64_t seq = 0;
  for (;;) {
    std::vector<int> open;
    for (int a = 0; a < aggregates; ++a) {
      if (left[a] > 0) open.push_back(a);
    }
    if (open.empty()) break;
    const int a = open[in.ConsumeIntegralInRange<size_t>(0, open.size() - 1)];
    seq += 1 + in.ConsumeIntegralInRange(0, 3);
    Event e;
    // Aggregates 2k and 2k+1 share an id under two types: two chains.
    e.set_aggregate_id(absl::StrCat("agg-", a / 2));
    e.set_aggregate_type(a % 2 == 0 ? "order" : "parcel");
    e.set_event_id(absl::StrCat("e-", a, "-", chain[a].size()));
    e.set_seq(seq);
    e.set_prev_seq(tail[a]);
    tail[a] = seq;
    --left[a];
    chain[a].push_back(truth.size());
    truth.push_back(e);
  }
  std::set<std::string> true_ids;
  for (const Event& e : truth) true_ids.insert(e.event_id());

  Store store;
  int forged = 0;
  const int batches = in.ConsumeIntegralInRange(1, 12);
  for (int b = 0; b < batches && in.remaining_bytes() > 0; ++b) {
    std::vector<Event> batch;
    std::vector<std::string> invalid;
    const int n = in.ConsumeIntegralInRange(1, 8);
    for (int i = 0; i < n; ++i) {
      Event e = truth[in.ConsumeIntegralInRange<size_t>(0, truth.size() - 1)];
      std::string why;
      if (forgeries && in.ConsumeIntegralInRange(0, 3) == 0) {
        e.set_event_id(absl::StrCat("forged-", forged++));
        switch (in.ConsumeIntegralInRange(0, 3)) {
          case 0:  // a restored backup: a new event at a true position
            break;
          case 1:  // a fork: a new event for a true link
            e.set_seq(seq + 1000 + forged);
            break;
          case 2: {  // anything, with prev_seq < seq
            const int64_t s = in.ConsumeIntegralInRange<int64_t>(1, seq + 10);
            e.set_seq(s);
            e.set_prev_seq(in.ConsumeIntegralInRange<int64_t>(0, s - 1));
            break;
          }
          default:
            why = "fuzz: invalid";
        }
      }
      batch.push_back(e);
      invalid.push_back(why);
    }
    Deliver(&store, batch, invalid, true_ids, forgeries);
  }
  // Finally every true event, each aggregate's chain in order.
  for (const auto& c : chain) {
    std::vector<Event> batch;
    for (size_t i : c) batch.push_back(truth[i]);
    Deliver(&store, batch, std::vector<std::string>(batch.size()), true_ids,
            forgeries);
  }
  if (!forgeries) {
    for (const Event& e : truth) Require(store.inbox.count(e.event_id()));
    Require(store.held.empty());
  }
  return 0;
}
