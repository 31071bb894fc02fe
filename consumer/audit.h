#pragma once
// The audit handler: records every event it receives, of any aggregate
// type and domain, in audit_log, with its envelope and its payload as
// delivered. A second subscriber beside billing, and the smallest example
// of a Handler.

#include "inbox/handler.h"

namespace outbox::consumer {

class AuditHandler final : public inbox::Handler {
 public:
  std::string name() const override { return "audit"; }
  const std::vector<Migration>& migrations() const override;
  // Every event with a sound envelope is recorded.
  absl::Status Validate(const v1::Event& event) const override;
  std::vector<inbox::Rejection> Apply(
      pqxx::work& tx, const std::vector<const v1::Event*>& events) override;
};

}  // namespace outbox::consumer
