#!/usr/bin/env bash
# The three binaries as separate processes with the contract's flags: every
# port answers reflection and health; orders flow end to end while one of
# two relays is killed with SIGKILL and the consumer is restarted; the
# invariant checker then finds nothing lost, doubled or out of order. Then
# each retention runs during a load of its own (the relay restarted with
# --retention=1s, then the consumer with --inbox_retention=1s, each deleting
# what the loads before left): the checker counts what they deleted as
# pruned, and still finds every invariant intact.
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
relay2=$LAST_PID
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
# Mid-load: once events are being applied.
deadline=$((SECONDS + 60))
until [ "$(psql "$billing_db" -qAtc "SELECT count(*) FROM inbox")" -gt 0 ]; do
  [ $SECONDS -lt $deadline ] || fail "nothing applied within 60s of the load's start"
  sleep 0.1
done
kill -KILL "$relay1"
pass "relay 1 killed mid-load"
kill -TERM "$consumer"
wait "$consumer" || true
start consumer2 outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db"
consumer2=$LAST_PID
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

# Both retentions during a run. Each binary prunes as it starts, while a
# load's events are delivered and applied; the checker must then count what
# it deleted as pruned and find no violation. Both delete oldest first, so
# the relay goes first (events left only in the inbox: pruned from the
# outbox), then the consumer (events left only in the outbox: pruned from
# the inbox), the relay then restarted without --retention so that it does
# not delete those too.
counter() { curl -sf "http://127.0.0.1:$1/metrics" | sed -n "s/^$2\\({[^}]*}\\)\\{0,1\\} //p"; }
# pruned_during PORT COUNTER SEED: a load runs while the binary whose
# metrics are on PORT prunes; waits until COUNTER moved and the load ended.
pruned_during() {
  "$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=300 --concurrency=4 \
    --timeout=3s --seed="$3" >"$WORK/load$3.out" 2>"$WORK/load$3.err" &
  local load=$! deadline=$((SECONDS + 60)) n
  until n=$(counter "$1" "$2") && [ -n "$n" ] && [ "${n%.*}" -gt 0 ]; do
    [ $SECONDS -lt $deadline ] || fail "$2 still ${n:-unread} 60s after the start"
    sleep 0.3
  done
  wait "$load" || fail "load $3 gave up on operations: $(cat "$WORK/load$3.out")"
}
# verified KEY: outboxctl verify holds every invariant and counts rows KEY.
verified() {
  "$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
    --wait=60s --format=json >"$WORK/verify-$1.json" ||
    fail "invariants violated with retention: $(cat "$WORK/verify-$1.json")"
  local n
  n=$(grep -o "\"$1\":[0-9]*" "$WORK/verify-$1.json" | cut -d: -f2)
  [ "${n:-0}" -gt 0 ] || fail "verify counted no rows $1: $(cat "$WORK/verify-$1.json")"
  echo "$1 $n"
}
RM=$(free_port)
kill -TERM "$relay2"
wait "$relay2" || true
start relay3 outbox-relay --listen="127.0.0.1:$R2" "${relay_flags[@]}" --retention=1s \
  --metrics_listen="127.0.0.1:$RM"
relay3=$LAST_PID
wait_serving "$R2"
pruned_during "$RM" outbox_relay_pruned_total 2
got=$(verified pruned_from_outbox)  # set -e: a failed check ends the test here
pass "relay --retention=1s during a load: every invariant holds, $got"

CM=$(free_port)
kill -TERM "$relay3" "$consumer2"
wait "$relay3" "$consumer2" || true
start relay4 outbox-relay --listen="127.0.0.1:$R2" "${relay_flags[@]}"
start consumer3 outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db" \
  --inbox_retention=1s --metrics_listen="127.0.0.1:$CM"
for port in "$R2" "$C"; do wait_serving "$port"; done
pruned_during "$CM" outbox_consumer_inbox_pruned_total 3
got=$(verified pruned_from_inbox)
pass "consumer --inbox_retention=1s during a load: every invariant holds, $got"
