#pragma once
// The order demo's own tables in the orders database. The outbox tables
// beside them belong to the outbox writer (common/schema.h), applied first.

#include <vector>

#include "common/schema.h"

namespace outbox::producer {

const std::vector<Migration>& OrdersMigrations();

// Everything the producer's database needs, in the order to apply it.
inline std::vector<Schema> OrdersSchemas() {
  return {OutboxSchema(), {"orders", &OrdersMigrations()}};
}

}  // namespace outbox::producer
