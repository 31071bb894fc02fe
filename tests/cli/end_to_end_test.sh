#!/usr/bin/env bash
# The three binaries as separate processes with the contract's flags: every
# port answers reflection and health; orders flow end to end while one of
# two relays is killed with SIGKILL and the consumer is restarted; the
# invariant checker then finds nothing lost, doubled or out of order.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir e2e

orders_db=$(new_db e2e_orders)
billing_db=$(new_db e2e_billing)
P=$(free_port) R1=$(free_port) R2=$(free_port) C=$(free_port)
relay_flags=(--db="$orders_db" --consumer="127.0.0.1:$C" --ack_timeout=3s
  --poll_interval=200ms --retry_max=500ms)
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db" \
  --metrics_listen="127.0.0.1:$(free_port)"
consumer=$LAST_PID
start producer outbox-producer --listen="127.0.0.1:$P" --db="$orders_db" \
  --metrics_listen="127.0.0.1:$(free_port)"
start relay1 outbox-relay --listen="127.0.0.1:$R1" "${relay_flags[@]}" \
  --metrics_listen="127.0.0.1:$(free_port)"
relay1=$LAST_PID
start relay2 outbox-relay --listen="127.0.0.1:$R2" "${relay_flags[@]}"
for port in "$P" "$R1" "$R2" "$C"; do wait_serving "$port"; done
for pair in "$P:outbox.v1.OrderService" "$R1:outbox.v1.RelayAdmin" \
  "$C:outbox.v1.EventSink" "$C:outbox.v1.BillingQuery"; do
  "$BUF" curl --protocol grpc --http2-prior-knowledge --list-services \
    "http://127.0.0.1:${pair%%:*}" | grep -x "${pair#*:}" >/dev/null ||
    fail "reflection on ${pair%%:*} does not list ${pair#*:}"
done
pass "reflection and health on all four ports"

"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=600 --concurrency=4 \
  --timeout=3s >"$WORK/load.out" 2>"$WORK/load.err" &
load=$!
sleep 0.5
kill -KILL "$relay1"
pass "relay 1 killed mid-load"
kill -TERM "$consumer"
wait "$consumer" || true
start consumer2 outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db"
wait_serving "$C"
pass "consumer restarted mid-load"
wait "$load" || fail "load gave up on operations: $(cat "$WORK/load.out")"
cat "$WORK/load.out"

"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s | tee "$WORK/verify.out" || fail "invariants violated"
owned=$("$BIN/outboxctl" stats --relay="127.0.0.1:$R2" --consumer="127.0.0.1:$C" |
  grep -o 'partitions owned [0-9]* of [0-9]*')
[ "$owned" = "partitions owned 32 of 32" ] || fail "surviving relay: $owned"
pass "the surviving relay took over every partition; every invariant holds"
