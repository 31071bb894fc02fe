#include "relay/busy_chains.h"

#include <cassert>

namespace outbox::relay {

void BusyChains::Remove(const std::string& chain) {
  auto it = events_.find(chain);
  if (it == events_.end()) return;
  assert(it->second > 0);
  if (--it->second == 0) {
    events_.erase(it);
    ++freed_;
  }
}

void BusyChains::Clear() {
  events_.clear();
  ++freed_;
}

std::vector<std::string> BusyChains::BusyAfter(
    const std::map<std::string, int>& riding) const {
  std::vector<std::string> busy;
  for (const auto& [chain, n] : events_) {
    auto it = riding.find(chain);
    if (n > (it == riding.end() ? 0 : it->second)) busy.push_back(chain);
  }
  return busy;
}

bool BusyChains::Frees(const std::map<std::string, int>& riding) const {
  for (const auto& [chain, n] : riding) {
    auto it = events_.find(chain);
    if (it == events_.end() || it->second <= n) return true;
  }
  return false;
}

}  // namespace outbox::relay
