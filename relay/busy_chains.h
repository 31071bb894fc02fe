#pragma once
// The chains (aggregates, as OutboxChain keys) with events in flight, or
// answered and not yet marked. No later event of a busy chain is claimed
// until those are marked, so that an aggregate's events reach the consumer
// in order (I2) and a rejected event's successors wait for its fate at
// the relay, never at the consumer (I6). It counts the events of each
// chain, and how many times a chain stopped being busy: a claim that
// passed busy chains over looks again from the start once one is freed.
//
// Pure; not thread-safe (the relay's worker owns it).
//
// Example:
//   BusyChains busy;
//   busy.Add(chain);        // claimed or read: its event is out
//   ... answered, marked:
//   busy.Remove(chain);     // freed() moves on when its last one goes

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace outbox::relay {

class BusyChains {
 public:
  // One more event of `chain` is out.
  void Add(const std::string& chain) { ++events_[chain]; }
  // One event of `chain` is marked. A chain not busy is left as it is (its
  // events were dropped with everything: Clear).
  void Remove(const std::string& chain);
  // Everything out was dropped: no chain is busy.
  void Clear();

  bool busy(const std::string& chain) const { return events_.count(chain) > 0; }
  // The events of `chain` out (0: not busy).
  int events(const std::string& chain) const {
    auto it = events_.find(chain);
    return it == events_.end() ? 0 : it->second;
  }
  size_t size() const { return events_.size(); }
  // How many times a chain stopped being busy (or all did: Clear).
  uint64_t freed() const { return freed_; }

  // `riding`: the events of each chain whose marks ride with the next
  // claim (as if marked before it began). The chains still busy then,
  // which that claim leaves out.
  std::vector<std::string> BusyAfter(
      const std::map<std::string, int>& riding) const;
  // Whether those marks free a chain (or mark one not busy).
  bool Frees(const std::map<std::string, int>& riding) const;

 private:
  std::map<std::string, int> events_;  // > 0 each
  uint64_t freed_ = 0;
};

}  // namespace outbox::relay
