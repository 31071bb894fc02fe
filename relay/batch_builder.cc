#include "relay/batch_builder.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "common/log.h"
#include "relay/delivery_store.h"

namespace outbox::relay {

std::string Undeliverable(bool parsed, size_t size) {
  if (!parsed) return "payload: not a valid outbox.v1.Event";
  if (size > kMaxEventBytes) {
    return absl::StrCat("payload: the event takes ", size, " bytes; at most ",
                        kMaxEventBytes, " can be delivered");
  }
  return "";
}

BuiltBatch BuildBatch(std::vector<Candidate> candidates,
                      const BatchRules& rules) {
  BuiltBatch out;
  out.batch.batch_id = rules.batch_id;
  out.batch.from_log = rules.from_log;
  out.request.set_batch_id(rules.batch_id);
  // Whether each aggregate goes, decided by its first event here.
  std::map<std::string, bool> goes;
  // Aggregates whose later events here wait: one was rejected or owed.
  std::set<std::string> cut;
  size_t bytes = 0;  // of the request, kept as events are added
  for (Candidate& c : candidates) {
    v1::Event& e = c.event;
    const int64_t seq = e.seq();
    const std::string chain = OutboxChain(e.aggregate_type(), e.aggregate_id());
    auto [first, fresh] = goes.try_emplace(chain, c.goes);
    if (fresh && rules.busy && rules.busy(chain)) first->second = false;
    e.set_source(rules.source);
    if (e.prev_seq() < rules.chain_from) e.set_prev_seq(0);
    if (!first->second || cut.count(chain) > 0) {
      if (rules.from_log) {
        // Behind one out or one that cannot go: it waits for that one's
        // fate among the exceptions.
        out.marks.push_back({.seq = seq,
                             .event_id = e.event_id(),
                             .chain = chain,
                             .kind = Mark::kOwed,
                             .log_fields = FieldsOf(e),
                             .from_log = true});
        out.busy.push_back(chain);
      }
      continue;  // a claimed row stays pending
    }
    if (!rules.from_log && bytes > rules.max_bytes) {
      // Below the consumer's message limit, whatever --batch_size says.
      out.cut_by_bytes = true;
      break;
    }
    const size_t size = c.parsed ? e.ByteSizeLong() : 0;
    out.busy.push_back(chain);
    if (std::string bad = Undeliverable(c.parsed, size); !bad.empty()) {
      // Its successors must not overtake it: they wait for its fate.
      out.marks.push_back({.seq = seq,
                           .event_id = e.event_id(),
                           .chain = chain,
                           .kind = Mark::kRejected,
                           .reason = std::move(bad),
                           .log_fields = FieldsOf(e),
                           .from_log = rules.from_log});
      cut.insert(chain);
      continue;
    }
    bytes += size + 8;  // the event, its tag and length
    out.batch.seqs.push_back(seq);
    out.batch.partitions.push_back(c.partition);
    out.batch.events.push_back(FieldsOf(e));
    out.batch.prev_seqs.push_back(e.prev_seq());
    out.sent_through = std::max(out.sent_through, seq);
    *out.request.add_events() = std::move(e);
  }
  out.cut_by_bytes |= !rules.from_log && bytes >= rules.max_bytes;
  return out;
}

}  // namespace outbox::relay
