#!/usr/bin/env bash
# The relay's replication fence with a real streaming standby: with
# --fence_standbys=1 an event is delivered only once the standby flushed
# it. With the standby streaming every order flows; with it stopped the
# relay claims the new events and holds them (stats say PAUSED, with why,
# and outbox_relay_paused is 1) and the consumer gets none; once the
# standby streams again they are delivered, and every invariant holds.
set -euo pipefail
source "$(dirname "$0")/../../scripts/lib/common.sh"  # pg_start, pg_stop
source "$(dirname "$0")/../lib.sh"
use_workdir fence

# A primary of the test's own (the shared test server has no standby), in
# folders straight under /tmp: as root the servers run as postgres, which
# must reach them.
PRIMARY=$(mktemp -d /tmp/outbox-fence-primary.XXXXXX)
STANDBY=$(mktemp -d /tmp/outbox-fence-standby.XXXXXX)
cleanup_servers() {
  pg_ctl_as "$STANDBY" stop
  pg_stop "$PRIMARY"
  stop_all
  rm -rf "$PRIMARY" "$STANDBY"
}
run_pg=()
[ "$(id -u)" -eq 0 ] && run_pg=(runuser -u postgres --)
pg_ctl_as() {
  local dir="$1"
  shift
  [ -f "$dir/data/postmaster.pid" ] || [ "$1" != stop ] || return 0
  "${run_pg[@]}" "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w \
    -t 60 "$@" -m fast >/dev/null 2>&1 || true
}
trap cleanup_servers EXIT
PG_OPTIONS="-c wal_level=replica -c max_wal_senders=4" pg_start "$PRIMARY"
PRIMARY_URL="$PG_URL"
[ "$(id -u)" -eq 0 ] && chown postgres "$STANDBY"
chmod 700 "$STANDBY"
"${run_pg[@]}" "$PG_BIN/pg_basebackup" -h 127.0.0.1 -p "$PG_PORT" -U postgres \
  -D "$STANDBY/data" -R -X stream --checkpoint=fast --no-sync \
  >"$WORK/basebackup.log" 2>&1 ||
  fail "pg_basebackup: $(tail -3 "$WORK/basebackup.log")"
S_PORT=$(free_port)
start_standby() {
  "${run_pg[@]}" "$PG_BIN/pg_ctl" -D "$STANDBY/data" -l "$STANDBY/postgres.log" \
    -w -t 60 -o "-p $S_PORT -c listen_addresses=127.0.0.1 -k $STANDBY \
      -c max_connections=300 -c shared_buffers=32MB" start \
    >/dev/null || fail "the standby did not start: $(tail -5 "$STANDBY/postgres.log")"
}
streaming() {
  psql "$PRIMARY_URL/postgres" -qAtc \
    "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
}
wait_streaming() {
  local want="$1" deadline=$((SECONDS + 60))
  while [ "$(streaming)" != "$want" ]; do
    [ $SECONDS -lt $deadline ] || fail "streaming standbys: $(streaming), want $want"
    sleep 0.2
  done
}
start_standby
wait_streaming 1
pass "a streaming standby of the test's own primary"

orders_db="$PRIMARY_URL/outbox_orders"
billing_db="$PRIMARY_URL/outbox_billing"
P=$(free_port) R=$(free_port) C=$(free_port) RM=$(free_port)
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db"
start producer outbox-producer --listen="127.0.0.1:$P" --db="$orders_db"
start relay outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" \
  --consumer="127.0.0.1:$C" --poll_interval=200ms --fence_standbys=1 \
  --metrics_listen="127.0.0.1:$RM"
for port in "$P" "$R" "$C"; do wait_serving "$port"; done

"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=150 --concurrency=4 \
  >"$WORK/load1.out" || fail "load: $(cat "$WORK/load1.out")"
"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify1.out" || fail "fenced delivery: $(cat "$WORK/verify1.out")"
pass "with the standby streaming, every event is delivered through the fence"

applied() { psql "$billing_db" -qAtc "SELECT count(*) FROM inbox"; }
before=$(applied)
pg_ctl_as "$STANDBY" stop
wait_streaming 0
"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=30 --concurrency=2 \
  --pay_fraction=0 --cancel_fraction=0 >"$WORK/load2.out" ||
  fail "load: $(cat "$WORK/load2.out")"
# The positive sign that the relay had the new events and held them: it
# claimed them (in flight) and says why it waits.
deadline=$((SECONDS + 30))
while :; do
  "$BIN/outboxctl" stats --relay="127.0.0.1:$R" --consumer="127.0.0.1:$C" \
    >"$WORK/stats.out" 2>&1 || true
  grep -q "PAUSED: replication fence: 0 of the 1 standbys" "$WORK/stats.out" &&
    grep -q "in flight [1-9]" "$WORK/stats.out" && break
  [ $SECONDS -lt $deadline ] || fail "the relay did not hold the new events: $(cat "$WORK/stats.out")"
  sleep 0.2
done
# Into a file first: `curl | grep -q` fails under pipefail when grep stops
# reading early (curl: (23) Failed writing body).
curl -fsS "http://127.0.0.1:$RM/metrics" >"$WORK/metrics.out" ||
  fail "the relay's metrics cannot be read on :$RM"
grep -q '^outbox_relay_paused{[^}]*} 1$' "$WORK/metrics.out" ||
  fail "outbox_relay_paused is not 1 while the fence holds events: $(grep outbox_relay_paused "$WORK/metrics.out")"
[ "$(applied)" = "$before" ] ||
  fail "events went past the fence with no standby: $(applied) applied, $before before"
grep -q "delivery paused: replication fence" "$WORK/relay.log" ||
  fail "the relay's log does not say why delivery paused"
pass "with no standby the relay holds the claimed events and says why"

start_standby
wait_streaming 1
"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s | tee "$WORK/verify2.out" || fail "after the standby came back"
[ "$(applied)" -gt "$before" ] || fail "nothing was delivered after the standby came back"
# Nothing held any more: the relay no longer says it is paused.
deadline=$((SECONDS + 10))
while :; do
  if "$BIN/outboxctl" stats --relay="127.0.0.1:$R" --consumer="127.0.0.1:$C" \
    >"$WORK/stats.out" 2>&1 && ! grep -q "PAUSED" "$WORK/stats.out"; then
    break
  fi
  [ $SECONDS -lt $deadline ] || fail "the relay still says it is paused: $(cat "$WORK/stats.out")"
  sleep 0.2
done
pass "once the standby streams again the held events are delivered; every invariant holds"
