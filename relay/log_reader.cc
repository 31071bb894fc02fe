#include "relay/log_reader.h"

#include <algorithm>
#include <cassert>
#include <tuple>

#include "absl/time/clock.h"
#include "common/db.h"
#include "relay/delivery_store.h"

namespace outbox::relay {

namespace {

bool SamePosition(const LogPosition& a, const LogPosition& b) {
  return a.done == b.done && a.reading == b.reading &&
         a.after_seq == b.after_seq;
}

std::tuple<int64_t, int64_t, int64_t> KeyOf(const LogPosition& p) {
  return {p.done, p.reading, p.after_seq};
}

}  // namespace

LogPosition LogReader::Group::Position() const {
  LogPosition pos = at;
  for (const Span& s : spans) {
    if (s.progress.done()) {
      pos = LogPosition{.done = s.range.to};
      continue;
    }
    const int64_t settled = s.progress.position();
    if (settled > s.range.after_seq) {
      pos = LogPosition{
          .done = s.range.from, .reading = s.range.to, .after_seq = settled};
    }
    break;  // nothing gained yet here: as the span before left it
  }
  return pos;
}

LogPosition LogReader::Group::End() const {
  if (spans.empty()) return at;
  return LogPosition{.done = spans.back().range.to};
}

bool LogReader::Group::idle() const {
  for (const Span& s : spans) {
    if (s.progress.in_flight() > 0) return false;
  }
  return true;
}

LogReader::Span* LogReader::Group::Find(int64_t span) {
  for (Span& s : spans) {
    if (s.id == span) return &s;
  }
  return nullptr;
}

LogReader::LogReader(LogReaderOptions options) : options_(std::move(options)) {}

void LogReader::Regroup(const std::set<int>& wanted) {
  // (position, inside `wanted`) -> partitions
  std::map<std::pair<std::tuple<int64_t, int64_t, int64_t>, bool>,
           std::pair<LogPosition, std::set<int>>>
      idle;
  for (auto it = groups_.begin(); it != groups_.end();) {
    Group& g = it->second;
    if (!g.idle()) {
      ++it;
      continue;
    }
    const LogPosition at = g.Position();
    for (int p : g.partitions) {
      auto& slot = idle[{KeyOf(at), wanted.count(p) > 0}];
      slot.first = at;
      slot.second.insert(p);
    }
    it = groups_.erase(it);
  }
  for (auto& [key, value] : idle) {
    const int id = next_group_++;
    Group& g = groups_[id];
    g.at = value.first;
    g.partitions = std::move(value.second);
    for (int p : g.partitions) partition_group_[p] = id;
  }
  // Ticks below every group's start are needed no more.
  int64_t low = INT64_MAX;
  for (const auto& [id, g] : groups_) low = std::min(low, g.at.done);
  ticks_.erase(ticks_.begin(), ticks_.lower_bound(low));
}

absl::StatusOr<Tick> LogReader::TickOf(pqxx::transaction_base& tx, int64_t id) {
  auto it = ticks_.find(id);
  if (it != ticks_.end()) return it->second;
  absl::StatusOr<Tick> t = ReadTick(tx, id);
  if (t.ok()) ticks_[id] = *t;
  return t;
}

absl::StatusOr<LogSend> LogReader::Next(pqxx::connection& conn,
                                        const std::vector<int>& partitions,
                                        int limit, absl::Time must_show) {
  const std::set<int> wanted(partitions.begin(), partitions.end());
  LogSend out;
  try {
    std::vector<int> unknown;
    for (int p : wanted) {
      if (partition_group_.count(p) == 0) unknown.push_back(p);
    }
    if (!unknown.empty()) {
      pqxx::work tx(conn);
      ApplyLimits(tx);
      std::map<int, LogPosition> read;
      for (int p : unknown) {
        absl::StatusOr<LogPosition> at =
            ReadPosition(tx, options_.subscription, p);
        if (!at.ok()) return at.status();
        read[p] = *at;
      }
      tx.commit();
      for (const auto& [p, at] : read) {
        clear_.erase(p);  // what was seen of it before is not to be trusted
        const int id = next_group_++;
        groups_[id].at = at;
        groups_[id].partitions = {p};
        partition_group_[p] = id;
        stored_[p] = at;
      }
    }
    Regroup(wanted);

    // The groups to read: wholly wanted (a group in flight that straddles
    // `wanted` waits until it is idle and split).
    std::vector<int> mine;
    for (const auto& [id, g] : groups_) {
      if (std::includes(wanted.begin(), wanted.end(), g.partitions.begin(),
                        g.partitions.end())) {
        mine.push_back(id);
      }
    }
    // Which groups read on into a new range: those with none begun, and
    // (pipelining) those whose newest range is read to its end, unless
    // another group is about to stand at the same tick while answers are
    // still coming: those wait until all are answered and merge (Regroup),
    // so that partitions read together again.
    std::map<int64_t, int> ending;  // next range's start -> groups
    std::set<int64_t> busy_end;     // ... of which one is in flight
    for (const auto& [id, g] : groups_) {
      const LogPosition end = g.End();
      if (end.reading != 0) continue;
      ++ending[end.done];
      if (!g.idle()) busy_end.insert(end.done);
    }
    std::vector<int> extend;
    for (int id : mine) {
      const Group& g = groups_.at(id);
      if (!g.spans.empty() && !g.spans.back().progress.read_all()) continue;
      if (g.spans.empty() && g.at.reading != 0) {
        extend.push_back(id);  // a begun range: read to its own end
        continue;
      }
      if (static_cast<int>(g.spans.size()) >= options_.max_ranges) continue;
      const int64_t end = g.End().done;
      if (ending[end] > 1 && busy_end.count(end) > 0) continue;
      extend.push_back(id);
    }
    // The newest tick, for the groups that begin a range (a begun range
    // is read to its own end: it needs none).
    bool wants_range = false;
    for (int id : extend) {
      wants_range |= groups_.at(id).End().reading == 0;
    }
    Tick latest;
    if (wants_range) {
      // Whether there are exceptions is asked for every partition the
      // reader knows: the other lanes' reads, which ask for no tick while
      // this one is new, know it too.
      absl::StatusOr<Tick> newest = NewestTick(conn, known(), must_show, &out);
      if (!newest.ok()) return newest.status();
      latest = *std::move(newest);
    }
    for (int id : extend) {
      Group& g = groups_.at(id);
      std::optional<RangeToRead> range = NextRange(g.End(), latest.id);
      if (!range.has_value()) continue;
      g.spans.push_back(Span{.id = next_span_++,
                             .range = *range,
                             .progress = RangeProgress(range->after_seq)});
    }
    std::vector<int> readable;
    for (int id : mine) {
      const Group& g = groups_.at(id);
      if (!g.spans.empty() && !g.spans.back().progress.read_all()) {
        readable.push_back(id);
      }
    }
    out.shows_before =
        newest_.has_value() ? newest_->shows_before : absl::InfinitePast();
    out.exceptions = !Clear(partitions);
    if (readable.empty()) return out;

    // Statements of their own: what they read counts only once the events
    // of chains with exceptions are owed (a failure, or a crash, before
    // then reads it all again; owing twice writes nothing).
    struct Read {
      int group;
      LogBatch batch;
    };
    std::vector<Read> reads;
    auto unit = OpenUnit(conn);
    pqxx::transaction_base& tx = *unit;
    int left = limit;
    int64_t budget = options_.payload_budget;
    std::vector<int> read_partitions;
    for (int id : readable) {
      if (left <= 0 || budget <= 0) {
        out.more = true;
        break;
      }
      const Span& span = groups_.at(id).spans.back();
      absl::StatusOr<Tick> from = TickOf(tx, span.range.from);
      if (!from.ok()) return from.status();
      absl::StatusOr<Tick> to = TickOf(tx, span.range.to);
      if (!to.ok()) return to.status();
      const Group& g = groups_.at(id);
      LogRead read{.from = *from,
                   .to = *to,
                   .after_seq = span.progress.read_through(),
                   .partitions = {g.partitions.begin(), g.partitions.end()},
                   .limit = left,
                   .payload_budget = budget};
      absl::StatusOr<LogBatch> batch = ReadLog(tx, read);
      if (!batch.ok()) return batch.status();
      for (const LogEvent& e : batch->events) {
        budget -= static_cast<int64_t>(e.event.ByteSizeLong());
      }
      left -= static_cast<int>(batch->events.size());
      out.more |= !batch->range_done;
      read_partitions.insert(read_partitions.end(), g.partitions.begin(),
                             g.partitions.end());
      reads.push_back({id, *std::move(batch)});
    }
    std::set<std::string> excepted;
    bool any = false;
    for (const Read& r : reads) any |= !r.batch.events.empty();
    if (any && !Clear(read_partitions)) {
      absl::StatusOr<std::set<std::string>> chains =
          ExceptedChains(tx, options_.subscription, read_partitions);
      if (!chains.ok()) return chains.status();
      excepted = *std::move(chains);
      SawExceptions(read_partitions, !excepted.empty());
    }
    std::vector<BatchPlan> plans;
    std::vector<int64_t> diverted;
    for (const Read& r : reads) {
      std::vector<PlannedEvent> planned;
      planned.reserve(r.batch.events.size());
      for (const LogEvent& e : r.batch.events) {
        planned.push_back({e.event.seq(), OutboxChain(e.event.aggregate_type(),
                                                      e.event.aggregate_id())});
      }
      plans.push_back(PlanBatch(planned, excepted));
      diverted.insert(diverted.end(), plans.back().divert.begin(),
                      plans.back().divert.end());
    }
    if (!diverted.empty()) {
      absl::StatusOr<int64_t> owed =
          OweExceptions(tx, options_.subscription, diverted);
      if (!owed.ok()) return owed.status();
    }
    unit->commit();
    if (!diverted.empty()) SawExceptions(read_partitions, true);

    // Owed: now it counts.
    for (size_t i = 0; i < reads.size(); ++i) {
      Span& span = groups_.at(reads[i].group).spans.back();
      std::vector<int64_t> seqs;
      seqs.reserve(reads[i].batch.events.size());
      for (const LogEvent& e : reads[i].batch.events) {
        seqs.push_back(e.event.seq());
      }
      span.progress.Read(seqs, reads[i].batch.last_seq,
                         reads[i].batch.range_done);
      for (int64_t seq : plans[i].divert) span.progress.Settle(seq);
      out.diverted += static_cast<int64_t>(plans[i].divert.size());
      std::set<int64_t> send(plans[i].send.begin(), plans[i].send.end());
      for (LogEvent& e : reads[i].batch.events) {
        if (send.count(e.event.seq()) == 0) continue;
        seq_group_[e.event.seq()] = {reads[i].group, span.id};
        out.events.push_back(std::move(e));
      }
      Compact(groups_.at(reads[i].group));
    }
    out.exceptions = !Clear(partitions);
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  return out;
}

absl::StatusOr<Tick> LogReader::NewestTick(pqxx::connection& conn,
                                           const std::vector<int>& partitions,
                                           absl::Time must_show,
                                           LogSend* out) {
  const absl::Time now = absl::Now();
  if (must_show == absl::InfiniteFuture()) must_show = now;
  if (newest_.has_value() && must_show <= newest_->shows_before) {
    return newest_->tick;
  }
  if (newest_.has_value() &&
      now - newest_->shows_before < options_.tick_interval) {
    // Too young to replace: any tick asked for now would be it, or one
    // as young that another relay made (read then, at the latest).
    out->retry_in = options_.tick_interval - (now - newest_->shows_before);
    return newest_->tick;
  }
  absl::StatusOr<TickAndExceptions> asked;
  {
    auto unit = OpenUnit(conn);
    asked = TickSince(*unit, options_.tick_interval, options_.subscription,
                      partitions);
    if (!asked.ok()) return asked.status();
    unit->commit();
  }
  SawExceptions(partitions, asked->exceptions);
  const Tick& t = asked->tick;
  // Its snapshot was taken after `now` if the statement made it, else no
  // earlier than `now` minus its age (measured within the statement,
  // which began after `now`).
  const absl::Time made = asked->made ? now : now - t.age;
  if (!newest_.has_value() || t.id > newest_->tick.id) {
    newest_ = HeldTick{.tick = t, .shows_before = made};
  } else if (t.id == newest_->tick.id) {
    newest_->shows_before = std::max(newest_->shows_before, made);
  }
  ticks_[newest_->tick.id] = newest_->tick;
  if (must_show > newest_->shows_before) {
    // The newest was younger than tick_interval, made before must_show.
    out->retry_in = std::max(absl::Microseconds(100),
                             options_.tick_interval - t.age);
  }
  return newest_->tick;
}

bool LogReader::Clear(const std::vector<int>& partitions) const {
  for (int p : partitions) {
    if (clear_.count(p) == 0) return false;
  }
  return true;
}

void LogReader::SawExceptions(const std::vector<int>& partitions, bool any) {
  for (int p : partitions) {
    if (any) {
      clear_.erase(p);
    } else {
      clear_.insert(p);
    }
  }
}

bool LogReader::Settle(int64_t seq) {
  auto it = seq_group_.find(seq);
  if (it == seq_group_.end()) return false;
  Group& g = groups_.at(it->second.first);
  Span* span = g.Find(it->second.second);
  assert(span != nullptr);
  const bool settled = span->progress.Settle(seq);
  assert(settled);
  seq_group_.erase(it);
  Compact(g);
  return settled;
}

void LogReader::Compact(Group& g) {
  while (!g.spans.empty() && g.spans.front().progress.done()) {
    g.at = LogPosition{.done = g.spans.front().range.to};
    g.spans.pop_front();
  }
}

absl::StatusOr<std::vector<int>> LogReader::Flush(pqxx::connection& conn) {
  // (group's position, the stored one) -> partitions
  struct Move {
    LogPosition from, to;
    std::vector<int> partitions;
  };
  std::map<std::pair<std::tuple<int64_t, int64_t, int64_t>,
                     std::tuple<int64_t, int64_t, int64_t>>,
           Move>
      moves;
  for (const auto& [id, g] : groups_) {
    const LogPosition to = g.Position();
    for (int p : g.partitions) {
      const LogPosition& from = stored_.at(p);
      if (SamePosition(from, to)) continue;
      Move& m = moves[{KeyOf(from), KeyOf(to)}];
      m.from = from;
      m.to = to;
      m.partitions.push_back(p);
    }
  }
  std::vector<int> lost;
  if (moves.empty()) return lost;
  std::vector<std::pair<const Move*, std::vector<int>>> moved;
  try {
    pqxx::work tx(conn);
    ApplyLimits(tx);
    for (const auto& [key, m] : moves) {
      absl::StatusOr<std::vector<int>> done =
          MovePositions(tx, options_.subscription, m.partitions,
                        options_.member, m.from, m.to);
      if (!done.ok()) return done.status();
      moved.emplace_back(&m, *std::move(done));
    }
    tx.commit();
  } catch (const std::exception& e) {
    return StatusFromException(e);
  }
  for (const auto& [m, done] : moved) {
    for (int p : m->partitions) {
      if (std::binary_search(done.begin(), done.end(), p)) {
        stored_[p] = m->to;
      } else {
        lost.push_back(p);
      }
    }
  }
  std::sort(lost.begin(), lost.end());
  Forget(lost);
  return lost;
}

void LogReader::DropGroupFlight(int group) {
  Group& g = groups_.at(group);
  // The first span not done is read again from what is settled of it; the
  // later ones go (what they settled is delivered again: the position
  // never counted it).
  Compact(g);
  if (!g.spans.empty()) {
    g.spans.resize(1);
    g.spans.front().progress.Rewind();
  }
  for (auto it = seq_group_.begin(); it != seq_group_.end();) {
    it = it->second.first == group ? seq_group_.erase(it) : std::next(it);
  }
}

void LogReader::Rewind() {
  for (auto& [id, g] : groups_) {
    if (!g.idle()) DropGroupFlight(id);
  }
}

void LogReader::Forget(const std::vector<int>& partitions) {
  for (int p : partitions) {
    clear_.erase(p);  // whoever has it next may write exceptions in it
    auto it = partition_group_.find(p);
    if (it == partition_group_.end()) continue;
    const int id = it->second;
    Group& g = groups_.at(id);
    if (!g.idle()) DropGroupFlight(id);
    g.partitions.erase(p);
    if (g.partitions.empty()) groups_.erase(id);
    partition_group_.erase(it);
    stored_.erase(p);
  }
}

bool LogReader::moved() const {
  for (const auto& [id, g] : groups_) {
    const LogPosition at = g.Position();
    for (int p : g.partitions) {
      if (!SamePosition(stored_.at(p), at)) return true;
    }
  }
  return false;
}

std::vector<int> LogReader::known() const {
  std::vector<int> out;
  for (const auto& [p, id] : partition_group_) out.push_back(p);
  return out;
}

std::optional<LogPosition> LogReader::position(int partition) const {
  auto it = partition_group_.find(partition);
  if (it == partition_group_.end()) return std::nullopt;
  return groups_.at(it->second).Position();
}

}  // namespace outbox::relay
