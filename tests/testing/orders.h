#pragma once
// Orders made through the producer's store, for tests of what follows it
// (relays, sinks, consumers): order i is created for customer "c<i>" with
// 1 + i % 3 items, paid when i is even and cancelled when i % 3 == 0, so
// that aggregates carry one to three events.
//
//   std::vector<std::string> ids = testing::MakeOrders(store, 60);

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "producer/order_logic.h"
#include "producer/order_store.h"

namespace outbox::testing {

// Orders `first` .. `first + n - 1`; their ids (fewer, and a test failure,
// if the store refused one).
inline std::vector<std::string> MakeOrders(producer::OrderStore& store, int n,
                                           int first = 0) {
  std::vector<std::string> ids;
  for (int i = first; i < first + n; ++i) {
    v1::CreateOrderRequest req;
    req.set_customer_id(absl::StrCat("c", i));
    req.set_currency("EUR");
    auto* item = req.add_items();
    item->set_sku("sku");
    item->set_quantity(1 + i % 3);
    item->set_unit_price_cents(100);
    auto order = store.Create(req, *producer::ValidateCreate(req), "");
    EXPECT_TRUE(order.ok()) << order.status();
    if (!order.ok()) break;
    ids.push_back(order->order_id());
    if (i % 2 == 0) {
      v1::PayOrderRequest pay;
      pay.set_order_id(order->order_id());
      pay.set_amount_cents(order->total_cents());
      EXPECT_TRUE(store.Pay(pay, "").ok());
    }
    if (i % 3 == 0) {
      v1::CancelOrderRequest cancel;
      cancel.set_order_id(order->order_id());
      EXPECT_TRUE(store.Cancel(cancel, "").ok());
    }
  }
  return ids;
}

}  // namespace outbox::testing
