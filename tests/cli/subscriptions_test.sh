#!/usr/bin/env bash
# Subscriptions through outboxctl and the real binaries: an abandoned
# subscription (no relay) with old events pins retention, and both
# `outboxctl subscriptions` (exit 1) and the relay's metrics say by what;
# a pause stops delivery until resumed; a drop is refused while a relay
# delivers the subscription, and dropping the abandoned one frees
# retention (exit 0); billing, on the outbox log as relays make it by
# default, moved off it onto rows and back under load; the checker then
# finds every invariant intact.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir subscriptions

orders_db=$(new_db subs_orders)
billing_db=$(new_db subs_billing)
P=$(free_port) R=$(free_port) RM=$(free_port) C=$(free_port)
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db"
start producer outbox-producer --listen="127.0.0.1:$P" --db="$orders_db"
start relay outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" \
  --consumer="127.0.0.1:$C" --retention=1h --metrics_listen="127.0.0.1:$RM"
for port in "$P" "$R" "$C"; do wait_serving "$port"; done
ctl() { "$BIN/outboxctl" --relay="127.0.0.1:$R" --producer="127.0.0.1:$P" --consumer="127.0.0.1:$C" "$@"; }
# What SUB is owed, on either model: its rows, and what the log owes it.
pending() {
  psql "$orders_db" -XAtc "SELECT count(*) FROM outbox o WHERE EXISTS (SELECT 1
    FROM outbox_delivery d WHERE d.subscription = '$1' AND d.seq = o.seq)
    OR outbox_log_owed('$1', o.seq, o.xid, o.partition)"
}
wait_pending() {  # wait_pending SUB N: until SUB owes exactly N, 60 s at most
  local deadline=$((SECONDS + 60))
  until [ "$(pending "$1")" = "$2" ]; do
    [ $SECONDS -lt $deadline ] || fail "$1 still owes $(pending "$1"), not $2"
    sleep 0.2
  done
}

# audit exists from the start, yet no relay ever delivers it.
psql "$orders_db" -Xqc "INSERT INTO subscriptions (name) VALUES ('audit')"
ctl load --orders=40 --concurrency=4 >"$WORK/load1.out"
wait_pending billing 0
psql "$orders_db" -Xqc "UPDATE outbox SET created_at = now() - interval '3 hours'"
rc=0
ctl subscriptions >"$WORK/list1.out" || rc=$?
cat "$WORK/list1.out"
[ "$rc" = 1 ] || fail "subscriptions exits $rc while retention is pinned, not 1"
grep -q '^audit: [1-9][0-9]* pending .* 0 relay(s) alive' "$WORK/list1.out" ||
  fail "audit's line: $(cat "$WORK/list1.out")"
grep -q 'pins retention: an event no relay delivers, seq' "$WORK/list1.out" ||
  fail "nothing says what pins retention: $(cat "$WORK/list1.out")"
deadline=$((SECONDS + 30))
until curl -sf "http://127.0.0.1:$RM/metrics" >"$WORK/metrics" &&
  grep -Eq '^outbox_retention_pinned_seconds\{kind="abandoned",of_subscription="audit",subscription="billing"\} [0-9.e+]+$' "$WORK/metrics" &&
  grep -q '^outbox_subscription_relays_alive{of_subscription="audit",subscription="billing"} 0$' "$WORK/metrics"; do
  [ $SECONDS -lt $deadline ] || fail "the relay's metrics do not say audit pins retention: $(grep -E 'pinned|relays_alive' "$WORK/metrics")"
  sleep 1
done
pass "an abandoned subscription pins retention: outboxctl exits 1 and names it; the relay's metrics too"

# A heal requested for audit, which no relay runs: the listing says so.
psql "$orders_db" -Xqc "UPDATE subscriptions SET heal_requested_at = now() - interval '42 seconds',
  heal_reason = 'the consumer''s database changed (test)' WHERE name = 'audit'"
ctl subscriptions >"$WORK/list_heal.out" || :
grep -Eq "^  heal due: the consumer's database changed \(test\), requested 4[2-9]\.[0-9] s ago" "$WORK/list_heal.out" ||
  fail "the listing does not say audit's heal is due: $(cat "$WORK/list_heal.out")"
grep -q "subscription(s); retention 1h, pinned by 1, 1 heal(s) due$" "$WORK/list_heal.out" ||
  fail "the summary does not count the due heal: $(tail -1 "$WORK/list_heal.out")"
[ "$(grep -c 'heal due' "$WORK/list_heal.out")" = 1 ] ||
  fail "a heal is said due for billing too: $(cat "$WORK/list_heal.out")"
ctl stats --subscription=audit >"$WORK/stats_heal.out" 2>&1 || :
grep -Eq "^  HEAL DUE: the consumer's database changed \(test\), requested 4[2-9]\.[0-9] s ago" "$WORK/stats_heal.out" ||
  fail "outboxctl stats does not say audit's heal is due: $(cat "$WORK/stats_heal.out")"
ctl stats >"$WORK/stats_billing.out" 2>&1 || :
! grep -q 'HEAL DUE' "$WORK/stats_billing.out" ||
  fail "outboxctl stats says a heal is due for billing: $(cat "$WORK/stats_billing.out")"
psql "$orders_db" -Xqc "UPDATE subscriptions SET healed_at = heal_requested_at WHERE name = 'audit'"
ctl subscriptions >"$WORK/list_healed.out" || :
! grep -q 'heal' "$WORK/list_healed.out" ||
  fail "a heal is still said due once run: $(cat "$WORK/list_healed.out")"
ctl stats --subscription=audit >"$WORK/stats_healed.out" 2>&1 || :
! grep -q 'HEAL DUE' "$WORK/stats_healed.out" ||
  fail "outboxctl stats still says a heal is due once run: $(cat "$WORK/stats_healed.out")"
pass "a due heal shows in outboxctl subscriptions and stats, and goes once run"

ctl subscriptions pause billing --reason="consumer maintenance" | tee "$WORK/pause.out"
grep -q "billing paused" "$WORK/pause.out" || fail "pause: $(cat "$WORK/pause.out")"
# The relay reads the pause in its next rebalance round (every second).
deadline=$((SECONDS + 30))
until ctl stats 2>/dev/null | grep -q "PAUSED: subscription billing paused by"; do
  [ $SECONDS -lt $deadline ] || fail "the relay never reported the pause: $(ctl stats 2>&1)"
  sleep 0.2
done
ctl load --orders=10 --concurrency=2 >"$WORK/load2.out"
sleep 2  # a relay that still claimed would have delivered them by now
n=$(pending billing)
[ "$n" -ge 10 ] || fail "billing paused, yet only $n of 10+ events wait"
ctl subscriptions >"$WORK/list-paused.out" || true  # exit 1: audit still pins
grep -q '^billing \[PAUSED by .*: consumer maintenance\]' "$WORK/list-paused.out" ||
  fail "the listing does not show the pause: $(cat "$WORK/list-paused.out")"
ctl subscriptions resume billing --reason="maintenance done" >/dev/null
wait_pending billing 0
pass "a paused subscription waits ($n events) and drains once resumed"

rc=0
out=$(ctl subscriptions drop billing --reason=oops 2>&1) || rc=$?
[ "$rc" = 1 ] && grep -q "relay(s) deliver subscription billing" <<<"$out" ||
  fail "drop of a delivered subscription: exit $rc: $out"
ctl subscriptions drop audit --reason="audit retired" | tee "$WORK/drop.out"
grep -q "dropped audit (owed then: [1-9][0-9]* pending" "$WORK/drop.out" ||
  fail "drop: $(cat "$WORK/drop.out")"
ctl subscriptions >"$WORK/list2.out" || fail "still pinned after the drop: $(cat "$WORK/list2.out")"
actions=$(psql "$orders_db" -XAtc "SELECT string_agg(action || ':' || reason, ',' ORDER BY id) FROM subscription_actions")
[ "$actions" = "pause:consumer maintenance,resume:maintenance done,drop:audit retired" ] ||
  fail "recorded actions: $actions"
pass "a drop is refused while a relay delivers; the abandoned one goes and retention is free; each action recorded"

# Off the outbox log and onto it again while orders keep coming: the
# relay follows each move, and nothing is lost, doubled or reordered.
positions() { psql "$orders_db" -XAtc "SELECT count(*) FROM outbox_log_positions WHERE subscription = 'billing'"; }
[ "$(positions)" -gt 0 ] || fail "the relay did not deliver billing from the log"
ctl subscriptions >"$WORK/list-log.out" || true
grep -q '^billing: .*; delivery log$' "$WORK/list-log.out" ||
  fail "the listing does not say billing is on the log: $(cat "$WORK/list-log.out")"
ctl load --orders=400 --concurrency=4 --rate=100 >"$WORK/load3.out" &
load_pid=$!
sleep 0.5
ctl subscriptions rows billing --reason="to rows" | tee "$WORK/to-rows.out"
grep -Eq "^billing is delivered from delivery rows now \(owed as rows: [0-9]+ events the log had not delivered\)" "$WORK/to-rows.out" ||
  fail "rows: $(cat "$WORK/to-rows.out")"
# The relay follows at its next rebalance round (every second here).
deadline=$((SECONDS + 30))
until grep -q "subscription billing is not delivered from the outbox log now" "$WORK/relay.log"; do
  [ $SECONDS -lt $deadline ] || fail "the relay did not follow the move to rows: $(tail -5 "$WORK/relay.log")"
  sleep 0.2
done
rc=0
out=$(ctl subscriptions rows billing --reason=twice 2>&1) || rc=$?
[ "$rc" = 1 ] && grep -q "not delivered from the outbox log.*(9)$" <<<"$out" ||
  fail "a second move to rows: exit $rc: $out"
ctl subscriptions >"$WORK/list-rows.out" || true
grep -q '^billing: .*; delivery rows$' "$WORK/list-rows.out" ||
  fail "the listing does not say billing is on rows: $(cat "$WORK/list-rows.out")"
ctl subscriptions log billing --reason="back to the log" | tee "$WORK/to-log.out"
grep -Eq "^billing is delivered from the outbox log now \(start tick [0-9]+\)" "$WORK/to-log.out" ||
  fail "log: $(cat "$WORK/to-log.out")"
deadline=$((SECONDS + 30))
until [ "$(grep -c "subscription billing is delivered from the outbox log now" "$WORK/relay.log")" -ge 2 ]; do
  [ $SECONDS -lt $deadline ] || fail "the relay did not follow the move back to the log: $(tail -5 "$WORK/relay.log")"
  sleep 0.2
done
wait "$load_pid" || fail "the load failed: $(cat "$WORK/load3.out")"
wait_pending billing 0
actions=$(psql "$orders_db" -XAtc "SELECT string_agg(action || ':' || reason, ',' ORDER BY id) FROM subscription_actions WHERE action LIKE 'to_%'")
[ "$actions" = "to_rows:to rows,to_log:back to the log" ] || fail "recorded moves: $actions"
pass "billing moved off the log and back under load; each move recorded, a repeated one refused"

"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify.out" || fail "invariants: $(cat "$WORK/verify.out")"
pass "every invariant holds"
