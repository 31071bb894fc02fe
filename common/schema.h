#pragma once
// The database schemas, as versioned migrations. The orders database
// (producer and relay) holds `orders` and `outbox`; the billing database
// (consumer) holds `inbox`, cursors, held events and the billing effects.
// Table and column names named in DESIGN.md section 3 are a public contract.

#include <vector>

#include "common/db.h"

namespace outbox {

// The channel relays LISTEN on; a NOTIFY on it means "new pending rows".
inline constexpr char kNotifyChannel[] = "outbox_events";

const std::vector<Migration>& OrdersMigrations();
const std::vector<Migration>& BillingMigrations();

}  // namespace outbox
