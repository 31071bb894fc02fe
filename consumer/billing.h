#pragma once
// The billing handler, the order demo's consumer side: an order view (one
// row per order) and the money movements (a charge when an order is paid,
// a refund when a paid order is cancelled), committed in the inbox
// engine's transaction with the inbox rows of the events that caused them.

#include <pqxx/pqxx>
#include <vector>

#include "absl/status/statusor.h"
#include "inbox/handler.h"
#include "outbox/v1/order.pb.h"

namespace outbox::consumer {

inline constexpr int kOrderSchemaVersion = 1;

// The order payload of `event`: from its payload, or from the fields that
// events written before the envelope was domain-free carry. InvalidArgument
// when it has none, or not the one its event_type names.
absl::StatusOr<v1::LegacyOrderPayload> DecodeOrderPayload(
    const v1::Event& event);

class BillingHandler final : public inbox::Handler {
 public:
  std::string name() const override { return "billing"; }
  const std::vector<Migration>& migrations() const override;
  // Orders only: aggregate_type "order", a known event type at schema
  // version 1, its payload about this aggregate with sane amounts.
  absl::Status Validate(const v1::Event& event) const override;
  // Reads the order views of the events' aggregates, evolves them by each
  // event, and writes the views and the charges with one statement each.
  std::vector<inbox::Rejection> Apply(
      pqxx::work& tx, const std::vector<const v1::Event*>& events) override;
  // Moves the charges of the superseded events to charges_superseded and
  // sets the order view back to the status of the last kept event (or
  // drops it when nothing is kept).
  void Rewound(pqxx::work& tx, const std::string& aggregate_id,
               const std::vector<inbox::AppliedEvent>& kept,
               const std::vector<inbox::AppliedEvent>& superseded) override;
};

}  // namespace outbox::consumer
