#!/usr/bin/env bash
# Gray failures with the real binaries: every process stays up while the
# database misbehaves. A rogue session locks a table each loop needs for
# longer than --lock_timeout: the stalled binary reports NOT_SERVING while
# it lasts and SERVING again after, and no event is lost or dead-lettered.
# Then dead letters made by hand are recovered in bulk with
# `outboxctl requeue --all-dead`.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir gray

orders_db=$(new_db gray_orders)
billing_db=$(new_db gray_billing)
P=$(free_port) R=$(free_port) C=$(free_port)
limits=(--lock_timeout=300ms --stall_timeout=2s)
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db" "${limits[@]}"
start producer outbox-producer --listen="127.0.0.1:$P" --db="$orders_db" "${limits[@]}"
start relay outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" \
  --consumer="127.0.0.1:$C" --poll_interval=200ms --retry_max=500ms "${limits[@]}"
relay=$LAST_PID
for port in "$P" "$R" "$C"; do wait_serving "$port"; done

health() { rpc "$1" grpc.health.v1.Health/Check | json_field status; }

# lock_for DB TABLE SECONDS: a rogue session holds an exclusive lock.
lock_for() {
  psql "$1" -qc "BEGIN; LOCK TABLE $2 IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep($3); COMMIT;" \
    >/dev/null &
  LOCK_PID=$!
}

# saw_not_serving PORT SECONDS: polls health; true once NOT_SERVING is seen.
saw_not_serving() {
  local deadline=$((SECONDS + $2))
  while [ $SECONDS -lt $deadline ]; do
    [ "$(health "$1")" = NOT_SERVING ] && return 0
    sleep 0.3
  done
  return 1
}

load() {
  "$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders="$1" --concurrency=2 \
    --timeout=2s >>"$WORK/load.out" 2>>"$WORK/load.err"
}

# 1. The consumer's inbox is locked: batches fail with lock timeouts, the
# relay backs off and resends, the consumer's health tells. The locks last
# 10 s: a binary turns NOT_SERVING after 2 s of failing work
# (--stall_timeout), once a batch reaches it, and each health probe starts
# a client of its own; on a busy machine 6 s left too little of the lock
# for a probe to see it.
load 50
lock_for "$billing_db" inbox 10
load 50 &
loader=$!
saw_not_serving "$C" 10 || fail "consumer stayed SERVING while its inbox was locked"
pass "consumer NOT_SERVING while a rogue lock holds its inbox"
wait "$LOCK_PID"
wait "$loader" || fail "load gave up: $(tail -3 "$WORK/load.out")"
wait_serving "$C" 15
pass "consumer SERVING again once the lock is gone"

# 2. The outbox is locked: the relay's claims and marks time out (and the
# producer's writes); both report NOT_SERVING, then recover.
lock_for "$orders_db" outbox 10
saw_not_serving "$R" 10 || fail "relay stayed SERVING while the outbox was locked"
pass "relay NOT_SERVING while a rogue lock holds the outbox"
wait "$LOCK_PID"
wait_serving "$R" 15
pass "relay SERVING again once the lock is gone"

"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify.out" || fail "invariants: $(cat "$WORK/verify.out")"
grep -q "dead letters       0 " "$WORK/verify.out" ||
  fail "dead letters after the locks: $(cat "$WORK/verify.out")"
pass "every event applied exactly once, in order, and no dead letter"

# 3. Dead letters recovered in bulk. With the relay stopped, twenty new
# events are given up on (as a bad deploy of the consumer would have it).
kill -TERM "$relay"
wait "$relay" || true
load 20
# What billing is owed becomes rows (exceptions, on the outbox log), and
# every row dead.
psql "$orders_db" -qc "INSERT INTO outbox_delivery (subscription, seq, aggregate_id, partition)
  SELECT 'billing', o.seq, o.aggregate_id, o.partition FROM outbox o
   WHERE outbox_log_owed('billing', o.seq, o.xid, o.partition) ON CONFLICT DO NOTHING" >/dev/null
psql "$orders_db" -qc "UPDATE outbox_delivery SET status = 'dead', attempts = 5, dead_at = now(),
  last_error = 'consumer bug #12: cannot apply' WHERE status = 'pending'" >/dev/null
dead=$(psql "$orders_db" -qAtc "SELECT count(*) FROM outbox_delivery WHERE status = 'dead'")
[ "$dead" -gt 0 ] || fail "no dead letters made"
start relay2 outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" \
  --consumer="127.0.0.1:$C" --poll_interval=200ms "${limits[@]}"
wait_serving "$R"
out=$("$BIN/outboxctl" requeue --relay="127.0.0.1:$R" --all-dead --since=1h --error="bug #12")
[ "$out" = "requeued $dead dead letters" ] || fail "requeue said: $out (dead: $dead)"
pass "outboxctl requeue --all-dead: $out"
"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify2.out" || fail "invariants: $(cat "$WORK/verify2.out")"
grep -q "dead letters       0 " "$WORK/verify2.out" || fail "$(cat "$WORK/verify2.out")"
pass "the requeued events were applied; nothing lost, doubled or reordered"
