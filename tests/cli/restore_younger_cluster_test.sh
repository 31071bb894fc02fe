#!/usr/bin/env bash
# The orders database restored from a dump into another, younger cluster,
# whose transaction ids lie behind the old one's: the producer writes
# orders there before any relay runs against it, then a relay starts,
# finds its log's ticks ahead of the database and rebases it. Every order,
# from before the dump and after the restore, must reach the consumer
# (outboxctl verify). Events written after the restore carry ids below the
# restored ticks' snapshots; a rebase that judged them by those snapshots
# took them for delivered and never sent them.
set -euo pipefail
source "$(dirname "$0")/../../scripts/lib/common.sh"  # pg_start, pg_stop
source "$(dirname "$0")/../lib.sh"
use_workdir restore

# Two servers of the test's own, in folders straight under /tmp: as root
# the servers run as postgres, which must reach them.
OLD=$(mktemp -d /tmp/outbox-restore-old.XXXXXX)
NEW=$(mktemp -d /tmp/outbox-restore-new.XXXXXX)
cleanup_servers() {
  stop_all
  pg_stop "$NEW"
  pg_stop "$OLD"
  rm -rf "$OLD" "$NEW"
}
trap cleanup_servers EXIT
pg_start "$OLD"
OLD_URL="$PG_URL"
# The old cluster has lived longer: its transaction ids run well ahead of
# a new cluster's.
psql "$OLD_URL/postgres" -qX -v ON_ERROR_STOP=1 -c "DO \$\$ BEGIN FOR i IN 1..5000 LOOP
  PERFORM pg_current_xact_id(); COMMIT; END LOOP; END \$\$" >/dev/null ||
  fail "could not age the old cluster"

billing_db="$OLD_URL/outbox_billing"
orders_db="$OLD_URL/outbox_orders"
P=$(free_port) R=$(free_port) C=$(free_port)
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db"
start producer outbox-producer --listen="127.0.0.1:$P" --db="$orders_db"
producer_pid=$LAST_PID
start relay outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" \
  --consumer="127.0.0.1:$C" --poll_interval=200ms
relay_pid=$LAST_PID
for port in "$P" "$R" "$C"; do wait_serving "$port"; done
"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=100 --concurrency=4 \
  >"$WORK/load1.out" || fail "load: $(cat "$WORK/load1.out")"
"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify1.out" || fail "before the dump: $(cat "$WORK/verify1.out")"
pass "100 orders delivered from the old cluster's outbox log"

kill -TERM "$producer_pid" "$relay_pid"
wait "$producer_pid" "$relay_pid" 2>/dev/null || true
run_pg=()
[ "$(id -u)" -eq 0 ] && run_pg=(runuser -u postgres --)
"${run_pg[@]}" pg_dump -Fc -h 127.0.0.1 -p "$(cat "$OLD/port")" -U postgres \
  -f "$OLD/orders.dump" outbox_orders 2>"$WORK/dump.log" ||
  fail "pg_dump: $(cat "$WORK/dump.log")"

pg_start "$NEW"
NEW_URL="$PG_URL"
orders_db="$NEW_URL/outbox_orders"
psql "$NEW_URL/postgres" -qc "DROP DATABASE outbox_orders" -c "CREATE DATABASE outbox_orders" >/dev/null
"${run_pg[@]}" pg_restore --single-transaction -h 127.0.0.1 -p "$(cat "$NEW/port")" \
  -U postgres -d outbox_orders "$OLD/orders.dump" 2>"$WORK/restore.log" ||
  fail "pg_restore: $(cat "$WORK/restore.log")"
behind=$(psql "$orders_db" -qAtX -c "SELECT pg_snapshot_xmax(pg_current_snapshot()) <
  (SELECT pg_snapshot_xmin(snapshot) FROM outbox_ticks ORDER BY id DESC LIMIT 1)")
[ "$behind" = t ] || fail "the new cluster's ids are not behind the restored ticks'"
pass "the dump restored into a younger cluster, its ids behind the log's ticks"

# The producer first: its orders commit with the new cluster's ids.
P2=$(free_port) R2=$(free_port)
start producer2 outbox-producer --listen="127.0.0.1:$P2" --db="$orders_db"
wait_serving "$P2"
"$BIN/outboxctl" load --producer="127.0.0.1:$P2" --orders=60 --concurrency=4 \
  >"$WORK/load2.out" || fail "load after the restore: $(cat "$WORK/load2.out")"
start relay2 outbox-relay --listen="127.0.0.1:$R2" --db="$orders_db" \
  --consumer="127.0.0.1:$C" --poll_interval=200ms
wait_serving "$R2" 60
"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify2.out" ||
  fail "after the restore: $(cat "$WORK/verify2.out")"
[ "$(psql "$billing_db" -qAtX -c "SELECT count(DISTINCT aggregate_id) FROM inbox")" = 160 ] ||
  fail "the consumer holds $(psql "$billing_db" -qAtX -c "SELECT count(DISTINCT aggregate_id) FROM inbox") orders, not 160"
grep -q "restored into another cluster" "$WORK/relay2.log" ||
  fail "the relay did not say it rebased the log"
pass "every order written since the restore delivered after the relay rebased the log"
