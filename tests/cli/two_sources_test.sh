#!/usr/bin/env bash
# One consumer takes events from two outbox databases (two shards, a
# producer and a relay each): their seqs collide (both start at 1), so the
# consumer tells their chains apart only by source. Orders flow into both
# while shard A's relay is killed with SIGKILL and started again; the
# checker, run against each outbox in turn, then finds nothing lost,
# doubled or out of order, and no event of one shard taken for a phantom of
# the other. A relay that names another source than its outbox recorded
# refuses to deliver.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir sources

shard_a=$(new_db sources_a)
shard_b=$(new_db sources_b)
billing_db=$(new_db sources_billing)
PA=$(free_port) PB=$(free_port) RA=$(free_port) RB=$(free_port) C=$(free_port)
relay_flags=(--consumer="127.0.0.1:$C" --ack_timeout=3s --poll_interval=200ms
  --retry_max=500ms)
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db"
start producer_a outbox-producer --listen="127.0.0.1:$PA" --db="$shard_a"
start producer_b outbox-producer --listen="127.0.0.1:$PB" --db="$shard_b"
# Shard A names its source; shard B takes the default (its database's name
# and a random suffix), recorded by its first relay.
start relay_a outbox-relay --listen="127.0.0.1:$RA" --db="$shard_a" \
  --source=shard-a "${relay_flags[@]}"
relay_a=$LAST_PID
start relay_b outbox-relay --listen="127.0.0.1:$RB" --db="$shard_b" \
  "${relay_flags[@]}"
for port in "$PA" "$PB" "$RA" "$RB" "$C"; do wait_serving "$port"; done
source_b=$(psql "$shard_b" -qAtc "SELECT name FROM outbox_source")
case "$source_b" in
  t_sources_b_*-????????) ;;
  *) fail "shard B's default source is \"$source_b\", not its database's name and a suffix" ;;
esac
pass "both relays serve; shard B's source defaulted to $source_b"

load() {  # load PRODUCER_PORT SEED
  "$BIN/outboxctl" load --producer="127.0.0.1:$1" --orders=300 \
    --concurrency=3 --timeout=3s --seed="$2" >"$WORK/load$2.out" \
    2>"$WORK/load$2.err"
}
load "$PA" 1 &
load_a=$!
load "$PB" 2 &
load_b=$!
deadline=$((SECONDS + 60))
until [ "$(psql "$billing_db" -qAtc "SELECT count(DISTINCT source) FROM inbox")" -eq 2 ]; do
  [ $SECONDS -lt $deadline ] || fail "events of both shards not applied within 60s"
  sleep 0.1
done
kill -KILL "$relay_a"
wait "$relay_a" 2>/dev/null || true
pass "shard A's relay killed mid-load"
sleep 1
start relay_a2 outbox-relay --listen="127.0.0.1:$RA" --db="$shard_a" \
  --source=shard-a "${relay_flags[@]}"
wait_serving "$RA"
wait "$load_a" || fail "load on shard A gave up: $(cat "$WORK/load1.out")"
wait "$load_b" || fail "load on shard B gave up: $(cat "$WORK/load2.out")"

collided=$(psql "$billing_db" -qAtc "SELECT count(*) FROM (SELECT seq FROM inbox \
  GROUP BY seq HAVING count(DISTINCT source) = 2) x")
[ "$collided" -gt 0 ] || fail "no seq was applied from both shards: the test proves nothing"
for shard in a b; do
  db_var="shard_$shard"
  "$BIN/outboxctl" verify --orders_db="${!db_var}" --billing_db="$billing_db" \
    --wait=60s | tee "$WORK/verify-$shard.out" ||
    fail "invariants violated for shard $shard"
done
for pair in "shard-a:$shard_a" "$source_b:$shard_b"; do
  src=${pair%%:*} db=${pair#*:}
  committed=$(psql "$db" -qAtc "SELECT count(*) FROM outbox")
  applied=$(psql "$billing_db" -qAtc "SELECT count(*) FROM inbox WHERE source = '$src'")
  [ "$committed" -eq "$applied" ] ||
    fail "source $src: $committed events committed, $applied applied"
done
pass "$collided seqs applied from both shards; each shard's events applied exactly once, in order"

# The recorded name stays: a relay told another one refuses to deliver.
R3=$(free_port)
start relay_renamed outbox-relay --listen="127.0.0.1:$R3" --db="$shard_b" \
  --source=renamed "${relay_flags[@]}"
deadline=$((SECONDS + 20))
until grep -q "this outbox's events carry source $source_b" "$WORK/relay_renamed.log"; do
  [ $SECONDS -lt $deadline ] || fail "a relay with another --source did not refuse: $(tail -5 "$WORK/relay_renamed.log")"
  sleep 0.2
done
pass "a relay naming another source than the recorded one refuses, naming both"
