#pragma once
// The billing domain's side effects of applied events: the order view (one
// row per order) and the money movements (a charge when an order is paid, a
// refund when a paid order is cancelled). They commit in the consumer's
// transaction, with the inbox rows of the same events.

#include <pqxx/pqxx>

#include <vector>

#include "outbox/v1/event.pb.h"

namespace outbox::consumer {

class Billing {
 public:
  // Applies `events` (valid, in apply order: each aggregate's in chain
  // order) inside `tx`: reads the order views of their aggregates, evolves
  // them by each event, and writes the views and the charges with one
  // statement each. Throws what libpqxx throws.
  static void Apply(pqxx::work& tx, const std::vector<const v1::Event*>& events);
};

}  // namespace outbox::consumer
