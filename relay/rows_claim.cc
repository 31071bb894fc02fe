#include "relay/rows_claim.h"

#include <map>
#include <utility>

#include "common/db.h"
#include "common/fault.h"
#include "common/ids.h"
#include "relay/marks.h"

namespace outbox::relay {

RowsClaim::RowsClaim(RowsClaimOptions options, Settlement* settlement)
    : options_(std::move(options)), settlement_(settlement) {}

absl::Status RowsClaim::Round(pqxx::connection_base& conn, const Lane& lane,
                              bool* ran) {
  try {
    // Answered deliveries (only those: Settlement::RideWithClaim) are deleted
    // by the next claim statement, which frees their aggregates unless more
    // of their events are out: as if marked before this claim began.
    std::map<std::string, int> riding = settlement_->Riding();
    const BusyChains& busy = settlement_->busy();
    ClaimWalk walk(
        lane.cursor,
        {.outstanding =
             lane.in_flight + static_cast<int64_t>(settlement_->marks().size()),
         .batch_size = options_.batch_size,
         .freed = busy.freed(),
         .riding_frees = busy.Frees(riding),
         .now = absl::Now(),
         .poll_interval = options_.poll_interval});
    for (;;) {
      const int limit = lane.limit();
      if (limit == 0) break;
      *ran = true;
      // Only the first statement carries them: later ones of this round
      // find no marks, or the rejections of rows it could not read, which
      // the worker writes on their own (WriteMarks).
      const bool ride = !riding.empty();
      ClaimQuery query{.subscription = options_.subscription,
                       .partitions = lane.partitions,
                       .limit = limit,
                       .after = walk.after(),
                       .mark = ride,
                       .member = options_.member,
                       .lsn = options_.fenced};
      if (ride) {
        // Those from the log have no row: Written settles them.
        MarkPlan marking = PlanMarks(settlement_->marks());
        query.delivered = std::move(marking.delivered);
        query.delivered_ids = std::move(marking.delivered_ids);
      }
      // By id: a busy chain keeps the other chains of its id (other types)
      // out of this claim too, which only delays them.
      for (const std::string& chain : busy.BusyAfter(riding)) {
        query.excluded_ids.emplace_back(ChainIdOf(chain));
      }
      const absl::Time t0 = absl::Now();
      if (ride) {
        // As before a mark of its own: answered, not yet marked; nothing
        // written.
        MaybeCrash("relay.after_send_before_mark");
        MaybeCrash("relay.before_mark_commit");
      }
      Claimed claimed;
      {
        auto tx = OpenUnit(conn);
        claimed = ClaimPending(*tx, query);
        tx->commit();
      }
      const size_t rows = claimed.candidates.size();
      if (options_.claimed) options_.claimed(rows, absl::Now() - t0);
      if (ride) {
        MaybeCrash("relay.after_mark_commit");
        const Settled settled = settlement_->Written({});
        if (options_.settled) options_.settled(settled);
        riding.clear();
      }
      const ClaimWalk::Next next =
          walk.Claimed(rows, claimed.last_seq, !query.excluded_ids.empty(),
                       busy.freed(), absl::Now());
      if (next == ClaimWalk::kDone) break;
      if (next == ClaimWalk::kAgain) continue;
      const bool cut = lane.send(std::move(claimed), limit);
      if (!walk.Continue(rows, limit, cut, absl::Now())) break;
    }
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
}

}  // namespace outbox::relay
