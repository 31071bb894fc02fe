#!/usr/bin/env bash
# The producer binary as grpcurl users meet it: reflection and health with no
# proto files, CreateOrder from JSON, an error with the field named, and a
# clean exit on SIGTERM. The client is buf curl, which this project did not
# write.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir producer-cli

db=$(new_db cli)
port=$(free_port)
metrics=$(free_port)
start producer outbox-producer --listen="127.0.0.1:$port" --db="$db" \
  --metrics_listen="127.0.0.1:$metrics" --log_format=json
producer=$LAST_PID
wait_serving "$port"

services=$("$BUF" curl --protocol grpc --http2-prior-knowledge --list-services \
  "http://127.0.0.1:$port")
for s in outbox.v1.OrderService grpc.health.v1.Health; do
  grep -qx "$s" <<<"$services" || fail "reflection does not list $s: $services"
done
pass "reflection lists the services"

created=$(rpc "$port" outbox.v1.OrderService/CreateOrder \
  '{"customerId":"c1","items":[{"sku":"book","quantity":2,"unitPriceCents":1250}],"currency":"EUR","idempotencyKey":"cli-1"}')
order_id=$(json_field orderId <<<"$created")
[ -n "$order_id" ] || fail "CreateOrder: $created"
grep -q '"totalCents": "2500"' <<<"$created" || fail "total: $created"
grep -q ORDER_STATUS_CREATED <<<"$created" || fail "status: $created"
again=$(rpc "$port" outbox.v1.OrderService/CreateOrder \
  '{"customerId":"c1","items":[{"sku":"book","quantity":2,"unitPriceCents":1250}],"currency":"EUR","idempotencyKey":"cli-1"}')
[ "$(json_field orderId <<<"$again")" = "$order_id" ] || fail "retry gave another order: $again"
pass "CreateOrder from JSON, retried with its key: $order_id"

paid=$(rpc "$port" outbox.v1.OrderService/PayOrder \
  "{\"orderId\":\"$order_id\",\"expectedVersion\":1,\"amountCents\":2500}")
grep -q ORDER_STATUS_PAID <<<"$paid" || fail "PayOrder: $paid"
got=$(rpc "$port" outbox.v1.OrderService/GetOrder "{\"orderId\":\"$order_id\"}")
grep -q '"version": "2"' <<<"$got" || fail "GetOrder: $got"
pass "PayOrder and GetOrder"

bad=$(rpc "$port" outbox.v1.OrderService/CreateOrder \
  '{"customerId":"c1","items":[{"sku":"book","quantity":0,"unitPriceCents":1}],"currency":"EUR"}' || true)
grep -q invalid_argument <<<"$bad" || fail "bad quantity: $bad"
grep -q 'items\[0\].quantity' <<<"$bad" || fail "field not named: $bad"
stale=$(rpc "$port" outbox.v1.OrderService/CancelOrder \
  "{\"orderId\":\"$order_id\",\"expectedVersion\":1}" || true)
grep -q aborted <<<"$stale" || fail "stale version: $stale"
missing=$(rpc "$port" outbox.v1.OrderService/GetOrder \
  '{"orderId":"00000000-0000-4000-8000-000000000000"}' || true)
grep -q not_found <<<"$missing" || fail "unknown order: $missing"
pass "errors carry the contract's codes"

events=$(psql "$db" -qAtc "SELECT count(*) FROM outbox")
[ "$events" = 2 ] || fail "expected 2 outbox events, found $events"
scraped=$(curl -fsS "http://127.0.0.1:$metrics/metrics")
grep -q 'outbox_producer_requests_total{code="OK",method="CreateOrder"} 2' <<<"$scraped" ||
  fail "metrics do not count the calls: $scraped"
pass "2 events written; metrics count the calls"

kill -TERM "$producer"
for _ in $(seq 1 100); do kill -0 "$producer" 2>/dev/null || break; sleep 0.1; done
kill -0 "$producer" 2>/dev/null && fail "producer still running 10s after SIGTERM"
wait "$producer" || fail "producer exited with $? after SIGTERM"
grep -q '"msg":"outbox-producer: stopped"' "$WORK/producer.log" || fail "no clean stop in the log"
pass "SIGTERM stops it cleanly"
