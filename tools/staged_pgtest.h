#pragma once
// What a clean run of the pipeline leaves in both databases, staged by SQL
// on databases made by the real migrations, for the tools that read them
// (the checker, reconcile): tests break it the way each fault would.
//
// Orders a (created, paid), b (created, paid, cancelled with a refund) and
// c (created), all delivered and applied, with their charges and views.

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/schema.h"
#include "consumer/billing.h"
#include "outbox/v1/event.pb.h"
#include "outbox/v1/order.pb.h"
#include "producer/order_schema.h"
#include "tests/testing/pg.h"

namespace outbox::tools {

inline consumer::BillingHandler* Billing() {
  static consumer::BillingHandler handler;
  return &handler;
}

// One committed event as the checker reads it.
struct Staged {
  int64_t seq;
  std::string event_id;
  std::string aggregate_id;
  std::string type;
};

class StagedPipelineTest : public ::testing::Test {
 protected:
  // `name` prefixes the two databases (tests of one binary may run at once
  // with another's).
  explicit StagedPipelineTest(const std::string& name)
      : orders_(name + "_orders", producer::OrdersSchemas()),
        billing_(name + "_billing",
                 {InboxSchema(), {"billing", &Billing()->migrations()}}) {
    orders_.Exec("INSERT INTO subscriptions (name) VALUES ('billing')");
    orders_.Exec(
        "INSERT INTO outbox_source (name, recorded_by) VALUES ('shard-1', "
        "'checker_pgtest')");
    // Order a: created and paid. Order b: created, paid and cancelled
    // with a refund. Order c: created only. All delivered and applied.
    a_ = NewUuid();
    b_ = NewUuid();
    c_ = NewUuid();
    a1_ = Commit(a_, "OrderCreated");
    a2_ = Commit(a_, "OrderPaid");
    b1_ = Commit(b_, "OrderCreated");
    c1_ = Commit(c_, "OrderCreated");
    b2_ = Commit(b_, "OrderPaid");
    b3_ = Commit(b_, "OrderCancelled", 700);
    orders_.Exec("DELETE FROM outbox_delivery");  // every one delivered
    for (const Staged* e : {&a1_, &b1_, &a2_, &c1_, &b2_, &b3_}) Apply(*e);
    Charge(a2_, "charge");
    Charge(b2_, "charge");
    Charge(b3_, "refund");
    Order(a_, "PAID");
    Order(b_, "CANCELLED");
    Order(c_, "CREATED");
  }

  // Appends an event of `agg` to the outbox after its last one.
  Staged Commit(const std::string& agg, const std::string& type,
                int64_t refund_cents = 0) {
    v1::Event e;
    e.set_event_id(NewUuid());
    e.set_aggregate_type("order");
    e.set_aggregate_id(agg);
    e.set_event_type(type);
    e.set_schema_version(1);
    if (type == "OrderCancelled") {
      v1::OrderCancelled cancelled;
      cancelled.set_order_id(agg);
      cancelled.set_refund_cents(refund_cents);
      e.mutable_payload()->PackFrom(cancelled);
    }
    const std::string hex = ToHex(e.SerializeAsString());
    const int64_t seq = orders_.Scalar(absl::StrCat(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, "
        "prev_seq, event_type, schema_version, payload, partition) VALUES ('",
        e.event_id(), "', 'order', '", agg,
        "', coalesce((SELECT max(seq) FROM outbox WHERE aggregate_id = '", agg,
        "'), 0), '", type, "', 1, decode('", hex, "', 'hex'), ",
        PartitionOf(agg), ") RETURNING seq"));
    return {seq, e.event_id(), agg, type};
  }

  static std::string ToHex(const std::string& bytes) {
    static const char kHex[] = "0123456789abcdef";
    std::string out;
    for (unsigned char c : bytes) {
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
    return out;
  }

  // The consumer applied `e` (its inbox row, next in apply order, and its
  // aggregate's cursor), as the source of the orders database names it.
  void Apply(const Staged& e) {
    billing_.Exec(absl::StrCat(
        "INSERT INTO inbox (event_id, source, aggregate_type, aggregate_id, "
        "seq, event_type) VALUES ('",
        e.event_id, "', '", source_, "', 'order', '", e.aggregate_id, "', ",
        e.seq, ", '", e.type,
        "'); INSERT INTO aggregate_cursors (source, aggregate_type, "
        "aggregate_id, last_seq) VALUES ('",
        source_, "', 'order', '", e.aggregate_id, "', ", e.seq,
        ") ON CONFLICT (source, aggregate_type, aggregate_id) DO UPDATE SET "
        "last_seq = EXCLUDED.last_seq"));
  }
  std::string source_ = "shard-1";
  void Charge(const Staged& e, const std::string& kind) {
    billing_.Exec(absl::StrCat(
        "INSERT INTO charges (event_id, order_id, kind, amount_cents, "
        "currency) VALUES ('",
        e.event_id, "', '", e.aggregate_id, "', '", kind, "', 700, 'EUR')"));
  }
  // The order as the producer and the consumer's view both have it.
  void Order(const std::string& id, const std::string& status) {
    orders_.Exec(absl::StrCat(
        "INSERT INTO orders (order_id, customer_id, items, currency, "
        "total_cents, status, version) VALUES ('",
        id, "', 'c', '[]', 'EUR', 700, '", status, "', 1)"));
    billing_.Exec(absl::StrCat(
        "INSERT INTO order_view (order_id, customer_id, status, total_cents, "
        "currency, last_seq) VALUES ('",
        id, "', 'c', '", status, "', 700, 'EUR', 0)"));
  }

  testing::TestDatabase orders_, billing_;
  std::string a_, b_, c_;
  Staged a1_, a2_, b1_, b2_, b3_, c1_;
};

}  // namespace outbox::tools
