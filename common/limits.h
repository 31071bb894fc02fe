#pragma once
// What one message may cost, in one place: the relay fills delivery batches
// and the servers refuse larger messages by the same numbers.

#include <cstddef>

namespace outbox {

// Requests of the public and admin APIs (OrderService, RelayAdmin,
// BillingQuery): an order of 100 items is about 10 KiB.
inline constexpr int kMaxApiMessageBytes = 64 << 10;

// The relay stops adding events to a delivery batch past this size...
inline constexpr size_t kMaxDeliveryBatchBytes = 1 << 20;
// ...and never sends one event larger than this: such an event can never be
// delivered and is rejected at the relay.
inline constexpr size_t kMaxEventBytes = (3 << 20) - (64 << 10);
// So a batch is at most this large, which EventSink accepts.
inline constexpr int kMaxDeliverMessageBytes = 4 << 20;
static_assert(kMaxDeliveryBatchBytes + kMaxEventBytes + (64 << 10) <=
              static_cast<size_t>(kMaxDeliverMessageBytes));

// A listing of events (RelayAdmin.ListDeadLetters) stops adding rows past
// this much payload, so its answer stays under gRPC's default 4 MiB that
// clients (grpcurl, outboxctl) accept, whatever its limit.
inline constexpr size_t kMaxListingPayloadBytes = 512 << 10;
static_assert(kMaxListingPayloadBytes + kMaxEventBytes + (64 << 10) <=
              static_cast<size_t>(4 << 20));

}  // namespace outbox
