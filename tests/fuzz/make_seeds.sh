#!/usr/bin/env bash
# Writes the seed inputs of the fuzz targets into corpus/<target>/seed-*
# (checked in; run again only to change the seeds). Inputs that once
# crashed a target go to the same folder as crash-<sha1>, by hand.
set -euo pipefail
cd "$(dirname "$0")"
root=../..
enc() {
  local type=$1 files=()
  shift
  for f in "$@"; do files+=("$root/proto/outbox/v1/$f"); done
  protoc -I"$root/proto" --encode="$type" "${files[@]}"
}

d=corpus/order_request_fuzz
mkdir -p "$d"
{ printf '\x00'; enc outbox.v1.CreateOrderRequest order.proto <<'TXT'
customer_id: "c1" currency: "EUR" idempotency_key: "k1"
items { sku: "book" quantity: 2 unit_price_cents: 1250 }
items { sku: "pen" quantity: 10000 unit_price_cents: 1000000000 }
TXT
} >"$d/seed-create"
{ printf '\x01'; enc outbox.v1.PayOrderRequest order.proto <<'TXT'
order_id: "6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e" expected_version: 1 amount_cents: 2500
TXT
} >"$d/seed-pay"
{ printf '\x02'; enc outbox.v1.CancelOrderRequest order.proto <<'TXT'
order_id: "6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e" expected_version: 2 reason: "changed my mind"
TXT
} >"$d/seed-cancel"
{ printf '\x03'; enc outbox.v1.GetOrderRequest order.proto <<'TXT'
order_id: "6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e"
TXT
} >"$d/seed-get"

d=corpus/outbox_payload_fuzz
mkdir -p "$d"
# Events as the writer stores them: the payload packed in an Any.
enc outbox.v1.Event event.proto order.proto >"$d/seed-any-paid" <<'TXT'
event_id: "6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e" aggregate_type: "order"
aggregate_id: "0b9f6f1e-1111-4222-8333-444455556666" prev_seq: 7
event_type: "OrderPaid" schema_version: 1
payload { [type.googleapis.com/outbox.v1.OrderPaid] {
  order_id: "0b9f6f1e-1111-4222-8333-444455556666" amount_cents: 2500 currency: "EUR" } }
TXT
enc outbox.v1.Event event.proto order.proto >"$d/seed-any-created" <<'TXT'
event_id: "6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6f" aggregate_type: "order"
aggregate_id: "0b9f6f1e-1111-4222-8333-444455556666" event_type: "OrderCreated"
schema_version: 1 occurred_at { seconds: 1700000000 }
payload { [type.googleapis.com/outbox.v1.OrderCreated] {
  order_id: "0b9f6f1e-1111-4222-8333-444455556666" customer_id: "c"
  items { sku: "a" quantity: 1 unit_price_cents: 5 } currency: "EUR" total_cents: 5 } }
TXT
# Events as releases before the Any payload stored them: the order
# payload in fields 10-12 of the envelope (LegacyOrderPayload names them).
{ enc outbox.v1.Event event.proto <<'TXT'
event_id: "6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e" aggregate_type: "order"
aggregate_id: "0b9f6f1e-1111-4222-8333-444455556666" prev_seq: 7
event_type: "OrderPaid" schema_version: 1
TXT
  enc outbox.v1.LegacyOrderPayload order.proto <<'TXT'
order_paid { order_id: "0b9f6f1e-1111-4222-8333-444455556666" amount_cents: 2500 currency: "EUR" }
TXT
} >"$d/seed-paid"
{ enc outbox.v1.Event event.proto <<'TXT'
event_id: "6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6f" aggregate_type: "order"
aggregate_id: "0b9f6f1e-1111-4222-8333-444455556666" event_type: "OrderCreated"
schema_version: 1 occurred_at { seconds: 1700000000 }
TXT
  enc outbox.v1.LegacyOrderPayload order.proto <<'TXT'
order_created { order_id: "0b9f6f1e-1111-4222-8333-444455556666" customer_id: "c"
  items { sku: "a" quantity: 1 unit_price_cents: 5 } currency: "EUR" total_cents: 5 }
TXT
} >"$d/seed-created"

d=corpus/traceparent_fuzz
mkdir -p "$d"
printf '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01' >"$d/seed-valid"
printf '00-00000000000000000000000000000000-00f067aa0ba902b7-01' >"$d/seed-zero"
printf '123e4567-e89b-12d3-a456-426614174000' >"$d/seed-uuid"
# Not W3C: upper-case hex, version ff, an all-zero parent id.
printf '00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01' >"$d/seed-upper"
printf 'ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01' >"$d/seed-ff"
printf '00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01' >"$d/seed-zero-parent"

d=corpus/consumer_plan_fuzz
mkdir -p "$d"
# Bytes for FuzzedDataProvider: without and with forgeries.
printf '\x00\x03\x05\x02\x07\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f' >"$d/seed-clean"
printf '\x01\x02\x08\x08\x03\x00\x01\x02\x00\x05\x01\x03\x07\x02\x00\x06\x01\x04\x02\x09' >"$d/seed-forged"
