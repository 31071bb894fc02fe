#!/usr/bin/env bash
# The dashboard and the alerts against the real binaries: starts
# outbox-consumer, outbox-producer and outbox-relay (loopback, fresh
# databases on the test PostgreSQL) with --metrics_listen, pushes orders
# through them, then
#   - scrapes each /metrics and runs `promtool check metrics` on it;
#   - checks that every metric name, matched label and grouping label of
#     every PromQL expression of the dashboard and the rules is in the
#     scrapes (monitoring.mjs names);
#   - checks that the relay owns as many partitions as the rules expect
#     (OutboxPartitionsUnowned's total);
#   - runs a Prometheus (loopback, 1 s scrapes, the rules loaded) over the
#     three: every dashboard query evaluates and returns data, every rule
#     evaluates, and no alert is active while all is well;
#   - poisons one event (schema_version 2, which the consumer rejects):
#     OutboxConsumerRejecting and, once it is a dead letter, OutboxDeadLetters
#     turn active;
#   - stops the consumer: OutboxDeliveryStreamDown turns active for the
#     relay;
#   - replaces the billing database by an earlier copy of itself (a
#     restore): the consumer reports the change (OutboxDatabaseFailover,
#     database inbox, kind recreated), the relay heals and delivers again
#     what the copy lacks (OutboxRelayHealing).
# Every process it starts is stopped by pid on exit.
#
# Usage: tests/monitoring/live_test.sh [BIN_DIR]   (exit 0 or 1)
#   BIN_DIR  the built binaries (default: build/bin of the repository).
# Needs: OUTBOX_TEST_PG_URL (scripts/test sets it), promtool and prometheus
# (Debian package prometheus), node with `npm ci` run in tests/deploy, curl.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
OUTBOX_BIN=$(cd "${1:-$root/build/bin}" && pwd)
export OUTBOX_BIN
# shellcheck source=../lib.sh
source "$root/tests/lib.sh"

for tool in promtool prometheus node curl; do
  command -v "$tool" >/dev/null || fail "$tool not found (promtool, prometheus: Debian package prometheus)"
done
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  [ -x "$BIN/$b" ] || fail "$BIN/$b is missing: build it or pass the directory of the built binaries"
done
use_workdir monitoring

mjs() { node "$here/monitoring.mjs" "$1" "--root=$root" "${@:2}"; }

# ---------------------------------------------------------------- binaries
orders_db=$(new_db mon_orders)
billing_db=$(new_db mon_billing)
# The outbox partitioned (rotation), as an operator may have it: the
# relay then exports the partition gauges that OutboxPartitionsRunningOut
# reads, and that alert must stay quiet in the checks below.
"$BIN/outboxctl" partition-outbox --orders_db="$orders_db" --span=100000 \
  >"$WORK/partition.out" 2>&1 || fail "partition-outbox: $(cat "$WORK/partition.out")"
P=$(free_port) R=$(free_port) C=$(free_port)
PM=$(free_port) RM=$(free_port) CM=$(free_port)
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db" \
  --metrics_listen="127.0.0.1:$CM"
consumer=$LAST_PID
start producer outbox-producer --listen="127.0.0.1:$P" --db="$orders_db" \
  --metrics_listen="127.0.0.1:$PM"
# Few, quick retries: the poisoned event below becomes a dead letter in
# about a second.
start relay outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" \
  --consumer="127.0.0.1:$C" --metrics_listen="127.0.0.1:$RM" \
  --poll_interval=200ms --retry_max=500ms --max_attempts=3 --reject_backoff=100ms
for port in "$C" "$P" "$R"; do wait_serving "$port" 60; done
pass "producer, relay and consumer serving"

# ---------------------------------------------------------------- Prometheus
# Target labels as the PodMonitor of deploy/k8s/components/monitoring sets
# them: job = the Deployment's name, namespace, pod.
mjs rules "--out=$WORK"
PROM=$(free_port)
cat >"$WORK/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - $WORK/rules.yaml
scrape_configs:
  - job_name: outbox-producer
    static_configs: [{targets: ["127.0.0.1:$PM"], labels: {namespace: outbox, pod: outbox-producer-0}}]
  - job_name: outbox-relay
    static_configs: [{targets: ["127.0.0.1:$RM"], labels: {namespace: outbox, pod: outbox-relay-0}}]
  - job_name: outbox-consumer
    static_configs: [{targets: ["127.0.0.1:$CM"], labels: {namespace: outbox, pod: outbox-consumer-0}}]
EOF
promtool check config "$WORK/prometheus.yml" >/dev/null || fail "prometheus.yml: $(promtool check config "$WORK/prometheus.yml" 2>&1)"
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM" --log.level=warn >>"$WORK/prometheus.log" 2>&1 &
PIDS+=("$!")
prom="http://127.0.0.1:$PROM"
deadline=$((SECONDS + 30))
until curl -fsS "$prom/-/ready" >/dev/null 2>&1; do
  [ $SECONDS -lt $deadline ] || fail "Prometheus not ready within 30 s: $(tail -5 "$WORK/prometheus.log")"
  sleep 0.2
done
# wait_samples N: until Prometheus holds at least N scrapes of each of the
# three targets within the last 15 s (it finds its targets only some
# seconds after start).
wait_samples() {
  local deadline=$((SECONDS + 60))
  until curl -fsS "$prom/api/v1/query" --data-urlencode \
    "query=count(count_over_time(up{job=~\"outbox-.*\"}[15s]) >= $1)" 2>/dev/null |
    grep '"value":\[[0-9.]*,"3"\]' >/dev/null; do
    [ $SECONDS -lt $deadline ] || fail "Prometheus has not scraped each target $1 times in 15 s within 60 s: $(tail -5 "$WORK/prometheus.log")"
    sleep 0.5
  done
}
wait_samples 2
pass "Prometheus scraping the three on 127.0.0.1:$PROM"

# ---------------------------------------------------------------- load
"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=200 --concurrency=4 \
  --timeout=10s >"$WORK/load.out" 2>&1 || fail "load failed: $(cat "$WORK/load.out")"
grep -m1 'orders created' "$WORK/load.out" || true
stats() { "$BIN/outboxctl" stats --relay="127.0.0.1:$R" --consumer="127.0.0.1:$C" 2>&1; }
deadline=$((SECONDS + 60))
until stats | grep 'pending 0,' >/dev/null; do
  [ $SECONDS -lt $deadline ] || fail "the backlog did not drain within 60 s: $(stats)"
  sleep 0.5
done
stats >"$WORK/stats.out"
pass "backlog drained ($(grep -o 'delivered [0-9]*$' "$WORK/stats.out" | head -1))"

# ---------------------------------------------------------------- scrapes
rc=0
for x in producer:$PM relay:$RM consumer:$CM; do
  name=${x%%:*}
  curl -fsS --max-time 5 "http://127.0.0.1:${x#*:}/metrics" >"$WORK/$name.prom" ||
    fail "cannot scrape $name's /metrics"
  if out=$(promtool check metrics <"$WORK/$name.prom" 2>&1); then
    pass "promtool check metrics: outbox-$name ($(grep -c '^# TYPE' "$WORK/$name.prom") families)"
  else
    echo "FAIL: promtool check metrics on outbox-$name's /metrics:" >&2
    printf '%s\n' "$out" | sed 's/^/  /' >&2
    rc=1
  fi
done
[ $rc -eq 0 ] || fail "promtool check metrics found problems in the binaries' metrics (above)"
mjs names "$WORK"/producer.prom "$WORK"/relay.prom "$WORK"/consumer.prom

# The partition count the rules compare with is the relay's.
want=$(grep -o 'outbox_relay_partitions_owned) < [0-9]*' "$root/deploy/monitoring/prometheus-rule.yaml" | grep -o '[0-9]*$')
[ -n "$want" ] || fail "prometheus-rule.yaml: no 'sum ... (outbox_relay_partitions_owned) < N' found"
total=$(grep -o 'partitions owned [0-9]* of [0-9]*' "$WORK/stats.out" | grep -o '[0-9]*$')
owned=$(grep '^outbox_relay_partitions_owned{' "$WORK/relay.prom" | awk '{print $2}')
[ "$total" = "$want" ] || fail "the relay has $total partitions (outboxctl stats), the rules expect $want"
[ "$owned" = "$want" ] || fail "the only relay owns $owned partitions (metrics), expected all $want"
pass "the relay owns all $want partitions, the number OutboxPartitionsUnowned expects"

# ---------------------------------------------------------------- queries
# Enough scrapes since the load for every rate's window.
wait_samples 6
mjs queries "--prometheus=$prom"
mjs alerts "--prometheus=$prom" --timeout=20

# ---------------------------------------------------------------- alerts
# A poison event: the next OrderCreated row gets a schema_version the
# consumer does not know (as the failure-injection suite does), so the
# consumer rejects it until it is a dead letter. The relay reads the dead
# letter count every 15 s.
psql "$orders_db" -qv ON_ERROR_STOP=1 >/dev/null <<'SQL' || fail "cannot install the poison trigger"
CREATE FUNCTION monitoring_poison_next() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.event_type = 'OrderCreated' THEN NEW.schema_version := 2; END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER monitoring_poison BEFORE INSERT ON outbox
  FOR EACH ROW EXECUTE FUNCTION monitoring_poison_next();
SQL
"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=1 --concurrency=1 --only=create \
  --timeout=10s >"$WORK/poison.out" 2>&1 || fail "poisoned order failed: $(cat "$WORK/poison.out")"
mjs alerts "--prometheus=$prom" --active=OutboxConsumerRejecting,OutboxDeadLetters \
  --labels=namespace=outbox --timeout=60
"$BIN/outboxctl" dead-letters --relay="127.0.0.1:$R" >"$WORK/dead.out" 2>&1 || true
grep -q 'schema_version' "$WORK/dead.out" ||
  fail "the poisoned event is not the dead letter: $(cat "$WORK/dead.out")"
pass "a poisoned event: OutboxConsumerRejecting and OutboxDeadLetters active"

kill -TERM "$consumer"
wait "$consumer" 2>/dev/null || true
mjs alerts "--prometheus=$prom" --active=OutboxDeliveryStreamDown \
  --labels=subscription=billing,pod=outbox-relay-0,namespace=outbox \
  --allow=OutboxConsumerRejecting,OutboxDeadLetters --timeout=30

# ---------------------------------------------------------------- restore
# A backup of the billing database (a copy made while the consumer is
# down), then more orders applied in the database the restore will lose,
# then the consumer started on the copy. It finds another database behind
# its URL (the identity the copy recorded names the original's oid) and
# reports it; the relay sees the consumer's new identity in its answers and
# heals: it compares the consumer's cursors with what it delivered and
# delivers again what the copy lacks.
psql "$orders_db" -qv ON_ERROR_STOP=1 -c 'DROP TRIGGER monitoring_poison ON outbox' >/dev/null ||
  fail "cannot remove the poison trigger"
billing_name=${billing_db##*/}
psql "$OUTBOX_TEST_PG_URL/postgres" -qv ON_ERROR_STOP=1 \
  -c "CREATE DATABASE ${billing_name}_copy TEMPLATE $billing_name" >/dev/null ||
  fail "cannot copy the billing database"
restored_db="${billing_db%/*}/${billing_name}_copy"
start_consumer() {
  start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$1" \
    --metrics_listen="127.0.0.1:$CM"
  consumer=$LAST_PID
  wait_serving "$C" 60
}
drained() {
  local deadline=$((SECONDS + 60))
  until stats | grep 'pending 0,' >/dev/null; do
    [ $SECONDS -lt $deadline ] || fail "the backlog did not drain within 60 s ($1): $(stats)"
    sleep 0.5
  done
}
start_consumer "$billing_db"
"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=20 --concurrency=4 \
  --timeout=10s >"$WORK/load2.out" 2>&1 || fail "load failed: $(cat "$WORK/load2.out")"
drained "orders after the backup"
kill -TERM "$consumer"
wait "$consumer" 2>/dev/null || true
start_consumer "$restored_db"
"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=5 --concurrency=1 \
  --timeout=10s >"$WORK/load3.out" 2>&1 || fail "load failed: $(cat "$WORK/load3.out")"
settled=OutboxConsumerRejecting,OutboxDeadLetters,OutboxDeliveryStreamDown
mjs alerts "--prometheus=$prom" --active=OutboxDatabaseFailover \
  --labels=namespace=outbox,job=outbox-consumer,database=inbox,kind=recreated \
  --allow=$settled,OutboxRelayHealing --timeout=60
mjs alerts "--prometheus=$prom" --active=OutboxRelayHealing \
  --labels=namespace=outbox,subscription=billing \
  --allow=$settled,OutboxDatabaseFailover --timeout=60
# Everything the original had applied (and the orders since) reaches the
# copy.
original=$(psql "$billing_db" -Atc "SELECT count(*) FROM inbox")
deadline=$((SECONDS + 60))
until [ "$(psql "$restored_db" -Atc "SELECT count(*) FROM inbox")" -ge "$original" ]; do
  [ $SECONDS -lt $deadline ] ||
    fail "the restored billing database holds $(psql "$restored_db" -Atc "SELECT count(*) FROM inbox") applied events after 60 s, the original $original: $(stats)"
  sleep 0.5
done
drained "after the restore"
grep -qi 'failover' "$WORK/consumer.log" ||
  fail "the consumer logged no failover for its restored database"
curl -fsS --max-time 5 "http://127.0.0.1:$RM/metrics" >"$WORK/relay-healed.prom" ||
  fail "cannot scrape the relay's /metrics"
grep -E '^outbox_relay_redelivered_total\{[^}]*reason="heal"[^}]*\} [1-9]' "$WORK/relay-healed.prom" >/dev/null ||
  fail "the heal delivered nothing again: $(grep -E '^outbox_relay_(redelivered|heals)_total' "$WORK/relay-healed.prom")"
pass "a restored billing database: OutboxDatabaseFailover and OutboxRelayHealing active, the heal delivered again what it lacked"
pass "live monitoring checks"
