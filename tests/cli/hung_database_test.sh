#!/usr/bin/env bash
# A hung database with the real binaries: the test's own PostgreSQL is
# frozen with SIGSTOP (the postmaster and every backend, as a blackholed
# link or a stuck storage volume looks) for about 20 s while a client that
# never retries and sends no idempotency keys floods the producer with
# CreateOrder calls of 200 ms deadlines; relay and consumer run as well.
# Memory stays bounded (peak RSS < 64 MB, each service), and once the
# database is back it has written no more orders than its callers were told
# were written, plus at most the one group per writer (writers x max_group)
# that it was already writing when it found the database hung. It then
# answers normally, nothing crashed, and every event is delivered.
set -euo pipefail
# pg_start/pg_stop from common.sh; both files' free_port lease alike.
# shellcheck source=../../scripts/lib/common.sh
source "$(dirname "$0")/../../scripts/lib/common.sh"
source "$(dirname "$0")/../lib.sh"

WORK=$(mktemp -d /tmp/outbox-hung.XXXXXX)
# Apart from WORK: as root, PostgreSQL runs as `postgres`, which must reach it.
PGDIR=$(mktemp -d /tmp/outbox-hung-pg.XXXXXX)
FROZEN=()
SAMPLER=
FLOOD=

# thaw: SIGCONT to every PostgreSQL process frozen (and, in case one was
# forked meanwhile, to every child of the postmaster).
thaw() {
  [ ${#FROZEN[@]} -gt 0 ] || return 0
  kill -CONT "${FROZEN[@]}" 2>/dev/null || true
  local pm
  pm=$(head -1 "$PGDIR/data/postmaster.pid" 2>/dev/null || true)
  local child
  if [ -n "$pm" ]; then
    for child in $(pgrep -P "$pm" || true); do kill -CONT "$child" 2>/dev/null || true; done
  fi
  FROZEN=()
}
cleanup() {
  local rc=$?
  thaw
  [ -n "$FLOOD" ] && kill -TERM "$FLOOD" 2>/dev/null || true
  [ -n "$SAMPLER" ] && kill -TERM "$SAMPLER" 2>/dev/null || true
  stop_pids
  pg_stop "$PGDIR"
  rm -rf "$PGDIR"
  if [ -n "${KEEP_WORK:-}" ] || [ $rc -ne 0 ]; then
    echo "logs in $WORK"
  else
    rm -rf "$WORK"
  fi
  exit $rc
}
trap cleanup EXIT

# freeze: SIGSTOP to the postmaster first (so that it forks no one new),
# then to each of its children.
freeze() {
  local pm
  pm=$(head -1 "$PGDIR/data/postmaster.pid")
  kill -STOP "$pm"
  FROZEN=("$pm")
  local child
  for child in $(pgrep -P "$pm" || true); do
    kill -STOP "$child" 2>/dev/null && FROZEN+=("$child")
  done
}

pg_start "$PGDIR" >/dev/null
orders_db="$PG_URL/outbox_orders"
billing_db="$PG_URL/outbox_billing"
count_orders() { psql "$orders_db" -qAtc "SELECT count(*) FROM orders"; }

P=$(free_port) R=$(free_port) C=$(free_port)
# One writer with groups of at most 64 (the producer's defaults): at most 64
# calls can be inside the group being written when the database freezes.
writers=1
max_group=64
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db"
consumer=$LAST_PID
start producer outbox-producer --listen="127.0.0.1:$P" --db="$orders_db" \
  --commit_writers=$writers
producer=$LAST_PID
start relay outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" \
  --consumer="127.0.0.1:$C" --ack_timeout=3s --poll_interval=200ms --retry_max=500ms
relay=$LAST_PID
for port in "$P" "$R" "$C"; do wait_serving "$port"; done

"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=200 --concurrency=4 \
  --timeout=5s >"$WORK/warmup.out" 2>&1 || fail "warm-up load: $(cat "$WORK/warmup.out")"
pass "the pipeline works before the freeze"

# Peak RSS (VmHWM) of each service, sampled until the test ends.
sample() {
  while :; do
    for name in producer relay consumer; do
      local pid
      eval "pid=\$$name"
      awk -v n="$name" '/^VmRSS|^VmHWM/ { printf "%s %s %s\n", n, $1, $2 }' \
        "/proc/$pid/status" 2>/dev/null || true
    done >>"$WORK/rss"
    sleep 0.2
  done
}
sample &
SAMPLER=$!

before=$(count_orders)
freeze
pass "PostgreSQL frozen (${#FROZEN[@]} processes)"
# 250 clients, each with one call at a time, a 200 ms deadline, one try and
# no idempotency key: ~1,250 calls/s for 20 s against the hung database. The
# first calls make the group the writer takes and waits on; every later one
# waits behind it. The flood ends before the database comes back, so that
# no caller waits any more when it does (a call whose deadline passes while
# its group is being written is written, and its caller cannot know).
"$BIN/outboxctl" load --producer="127.0.0.1:$P" --only=create --orders=40000 \
  --concurrency=250 --timeout=200ms --max_tries=1 --idempotency_keys=false \
  --duration=20s --format=json >"$WORK/flood.json" 2>"$WORK/flood.err" &
FLOOD=$!
deadline=$((SECONDS + 90))
while kill -0 "$FLOOD" 2>/dev/null; do
  [ $SECONDS -lt $deadline ] || fail "the flood did not end within 90 s"
  sleep 0.2
done
wait "$FLOOD" || true # it gives up on every call that failed
FLOOD=
thaw
pass "PostgreSQL thawed after the flood"

field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1"; }
calls=$(field "$WORK/flood.json" 'd["calls"]')
ok=$(field "$WORK/flood.json" 'd["created"]')
codes=$(field "$WORK/flood.json" '", ".join("%s %d" % kv for kv in sorted(d["codes"].items()))')
echo "flood: $calls calls: $codes"
[ "$calls" -ge 2000 ] || fail "the flood made only $calls calls: $(tail -3 "$WORK/flood.err")"

# The producer answers normally again: a fresh CreateOrder succeeds (it
# waits behind whatever the producer still has queued).
fresh=
deadline=$((SECONDS + 120))
while [ $SECONDS -lt $deadline ]; do
  fresh=$("$BUF" curl --protocol grpc --http2-prior-knowledge --timeout 30s \
    -d '{"customerId":"after","items":[{"sku":"book","quantity":1,"unitPriceCents":100}],"currency":"EUR"}' \
    "http://127.0.0.1:$P/outbox.v1.OrderService/CreateOrder" 2>&1 || true)
  grep -q ORDER_STATUS_CREATED <<<"$fresh" && break
  sleep 0.5
done
grep -q ORDER_STATUS_CREATED <<<"$fresh" || fail "no CreateOrder succeeded after the thaw: $fresh"
pass "a fresh CreateOrder succeeds after the thaw"

# Whatever is left in the producer is written by now; wait until the count
# stops moving.
last=-1
now=$(count_orders)
deadline=$((SECONDS + 120))
while [ "$now" != "$last" ]; do
  [ $SECONDS -lt $deadline ] || fail "the order count kept moving for 120 s"
  sleep 1
  last=$now
  now=$(count_orders)
done
written=$((now - before - 1))

kill -TERM "$SAMPLER" 2>/dev/null || true
wait "$SAMPLER" 2>/dev/null || true
SAMPLER=
peak_kb() { awk -v n="$1" '$1 == n && $2 == "VmHWM:" && $3 > m { m = $3 } END { print m + 0 }' "$WORK/rss"; }
mb() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }
p_kb=$(peak_kb producer) r_kb=$(peak_kb relay) c_kb=$(peak_kb consumer)
echo "peak RSS (VmHWM): producer $(mb "$p_kb") MB, relay $(mb "$r_kb") MB, consumer $(mb "$c_kb") MB"
echo "orders written during the flood: $written; calls answered OK: $ok"

for pid in "$producer" "$relay" "$consumer"; do
  kill -0 "$pid" 2>/dev/null || fail "a service died (pid $pid)"
done
pass "no service crashed"
slack=$((writers * max_group))
[ "$written" -le $((ok + slack)) ] ||
  fail "$written orders written, but only $ok calls were answered OK (+ at most $slack in the groups being written)"
pass "no abandoned call was written: $written written <= $ok OK + $slack"
for name in producer relay consumer; do
  kb=$(peak_kb "$name")
  [ "$kb" -gt 0 ] && [ "$kb" -lt $((64 * 1024)) ] ||
    fail "$name peak RSS $(mb "$kb") MB, not under 64 MB"
done
pass "peak RSS under 64 MB: producer $(mb "$p_kb") MB, relay $(mb "$r_kb") MB, consumer $(mb "$c_kb") MB"
for port in "$P" "$R" "$C"; do wait_serving "$port" 60; done
"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=200 --concurrency=4 \
  --timeout=5s >"$WORK/after.out" 2>&1 || fail "load after the thaw: $(cat "$WORK/after.out")"
pass "the producer answers a careful load normally after the thaw"

"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=120s >"$WORK/verify.out" || fail "invariants: $(cat "$WORK/verify.out")"
pass "every event applied exactly once, in order, after the hung database"
