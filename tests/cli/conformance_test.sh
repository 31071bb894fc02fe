#!/usr/bin/env bash
# outboxctl conformance against two EventSinks of different languages:
# the real outbox-consumer (--handler=audit, which records any event) and
# examples/python-consumer, each in plaintext and under mutual TLS that
# admits only the relay's identity to Deliver. Every case must pass (under
# TLS none may be skipped), also on a second run against the same
# databases, and a real relay's stream reaches the Python consumer intact.
# Then the tool must fail: the Python consumer with its dedup,
# its ordering or its identity check sabotaged fails the case that checks
# it, naming it, with exit 1; bad flags exit 2 naming the flag.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir conformance

PY="${OUTBOX_PYTHON:-/usr/bin/python3}"
EXAMPLE="$OUTBOX_ROOT/examples/python-consumer"
"$PY" -c 'import grpc, google.protobuf, psycopg2' 2>"$WORK/py.err" ||
  fail "$PY lacks python3-grpcio, python3-protobuf or python3-psycopg2 (scripts/lib/common.sh ensure_packages): $(cat "$WORK/py.err")"
"$EXAMPLE/gen_stubs.sh" "$WORK/stubs" || fail "cannot generate the Python stubs"
use_certs

# wait_port PORT LOG: until something listens on PORT (30 s at most).
wait_port() {
  local deadline=$((SECONDS + 30))
  until (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || fail "nothing listens on port $1 after 30s (see $2)"
    sleep 0.2
  done
}

# start_py NAME PORT DB [ARGS...]: the Python consumer in the background
# (environment from the caller), logging to $WORK/NAME.log.
start_py() {
  local name="$1" port="$2" db="$3"
  shift 3
  PYTHONPATH="$WORK/stubs" "$PY" "$EXAMPLE/consumer.py" --listen "127.0.0.1:$port" \
    --db "$db" "$@" >>"$WORK/$name.log" 2>&1 &
  PIDS+=("$!")
  wait_port "$port" "$name.log"
}

tls_server=(--tls_cert="$CERTS/consumer.crt" --tls_key="$CERTS/consumer.key"
  --tls_client_ca="$CERTS/ca.crt" --delivery_clients=spiffe://outbox/relay)
tls_client=(--ca "$CERTS/ca.crt" --cert "$CERTS/relay.crt" --key "$CERTS/relay.key"
  --wrong_cert "$CERTS/outboxctl.crt" --wrong_key "$CERTS/outboxctl.key")

audit_db=$(new_db conformance_audit)
py_db=$(new_db conformance_python)
C=$(free_port) CT=$(free_port) P=$(free_port) PT=$(free_port)
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$audit_db" --handler=audit
wait_port "$C" consumer.log
start consumer_tls outbox-consumer --listen="127.0.0.1:$CT" --db="$audit_db" --handler=audit \
  "${tls_server[@]}"
wait_port "$CT" consumer_tls.log
start_py python "$P" "$py_db"
start_py python_tls "$PT" "$py_db" "${tls_server[@]}"

# conform NAME ARGS...: outboxctl conformance, its output in $WORK/NAME.out;
# sets RC.
conform() {
  local name="$1"
  shift
  RC=0
  timeout 120 "$BIN/outboxctl" conformance --timeout 20s "$@" >"$WORK/$name.out" 2>&1 || RC=$?
  cat "$WORK/$name.out"
}

# must_pass NAME WHAT ARGS...: every case passes, none fails.
must_pass() {
  local name="$1" what="$2"
  shift 2
  conform "$name" "$@"
  [ "$RC" = 0 ] || fail "$what: conformance exited $RC"
  grep -q ' 0 failed' "$WORK/$name.out" || fail "$what: no summary with 0 failed"
  if grep -q '^FAIL' "$WORK/$name.out"; then fail "$what: a case failed"; fi
}

must_pass outbox_consumer "outbox-consumer" --sink "127.0.0.1:$C"
must_pass outbox_consumer_tls "outbox-consumer under mutual TLS" --sink "localhost:$CT" "${tls_client[@]}"
grep -q ' 0 skipped' "$WORK/outbox_consumer_tls.out" || fail "outbox-consumer under TLS: a case was skipped"
pass "outbox-consumer passes every case, the identity cases under mutual TLS"

must_pass python "the Python consumer" --sink "127.0.0.1:$P"
must_pass python_tls "the Python consumer under mutual TLS" --sink "localhost:$PT" "${tls_client[@]}"
grep -q ' 0 skipped' "$WORK/python_tls.out" || fail "the Python consumer under TLS: a case was skipped"
pass "the Python consumer passes every case, the identity cases under mutual TLS"

# A real relay delivers the order demo's events to the Python consumer:
# every one applied once, each aggregate's in seq order; idle, the relay
# still finds it reachable (it asks the consumer's grpc.health.v1).
orders_db=$(new_db conformance_orders)
relay_db=$(new_db conformance_python_relay)
PR=$(free_port) R=$(free_port) M=$(free_port) PP=$(free_port)
start_py python_relay "$PP" "$relay_db"
start producer outbox-producer --listen="127.0.0.1:$PR" --db="$orders_db"
wait_port "$PR" producer.log
start relay outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" --subscription=python \
  --consumer="127.0.0.1:$PP" --metrics_listen="127.0.0.1:$M" --poll_interval=200ms \
  --consumer_unready_after=2s
wait_port "$R" relay.log
timeout 120 "$BIN/outboxctl" load --producer "127.0.0.1:$PR" --orders 50 --concurrency 4 \
  >"$WORK/load.out" 2>&1 || fail "load: $(tail -3 "$WORK/load.out")"
events=$(psql "$orders_db" -qAtc "SELECT count(*) FROM outbox")
[ "$events" -ge 50 ] || fail "the load wrote $events events"
deadline=$((SECONDS + 60))
until [ "$(psql "$relay_db" -qAtc "SELECT count(*) FROM effects")" = "$events" ]; do
  [ $SECONDS -lt $deadline ] ||
    fail "the Python consumer has $(psql "$relay_db" -qAtc "SELECT count(*) FROM effects") of $events effects after 60s"
  sleep 0.5
done
disorder=$(psql "$relay_db" -qAtc "SELECT count(*) FROM (SELECT seq, lag(seq) OVER
  (PARTITION BY source, aggregate_type, aggregate_id ORDER BY apply_id) AS before FROM inbox) x
  WHERE before > seq")
[ "$disorder" = 0 ] || fail "$disorder events applied before a predecessor"
sleep 4  # twice --consumer_unready_after with nothing to deliver
reachable=$(curl -sf "http://127.0.0.1:$M/metrics" | sed -n 's/^outbox_relay_consumer_reachable{*[^ ]* //p')
[ "${reachable%.*}" = 1 ] || fail "idle, the relay takes the Python consumer for unreachable: '$reachable'"
pass "a real relay delivers $events events to the Python consumer, once each and in order; idle, it stays reachable"

must_pass again_consumer "outbox-consumer, second run on the same database" --sink "127.0.0.1:$C"
must_pass again_python "the Python consumer, second run on the same database" --sink "127.0.0.1:$P"
pass "a second run against the same databases passes too (fresh aggregate ids)"

# must_fail NAME CASE WHAT ARGS...: conformance exits 1 and names CASE.
must_fail() {
  local name="$1" case="$2" what="$3"
  shift 3
  conform "$name" "$@"
  [ "$RC" = 1 ] || fail "$what: conformance exited $RC, not 1"
  grep -q "^FAIL  $case " "$WORK/$name.out" || fail "$what: case $case is not named as failed"
  grep -q "(failed: .*$case" "$WORK/$name.out" || fail "$what: the summary does not name $case"
}

broken_db=$(new_db conformance_broken)
B1=$(free_port) B2=$(free_port) B3=$(free_port)
OUTBOX_EXAMPLE_SABOTAGE=dedup start_py broken_dedup "$B1" "$broken_db"
OUTBOX_EXAMPLE_SABOTAGE=order start_py broken_order "$B2" "$broken_db"
start_py broken_identity "$B3" "$broken_db" --tls_cert="$CERTS/consumer.crt" \
  --tls_key="$CERTS/consumer.key" --tls_client_ca="$CERTS/ca.crt"
must_fail broken_dedup duplicates "a sink that forgets duplicates" --sink "127.0.0.1:$B1"
must_fail broken_order out-of-order "a sink that ignores prev_seq" --sink "127.0.0.1:$B2"
must_fail broken_identity identity-wrong "a sink that admits any certificate to Deliver" \
  --sink "localhost:$B3" "${tls_client[@]}"
pass "broken sinks fail, naming duplicates, out-of-order and identity-wrong"

# bad_flag FLAG ARGS...: exit 2, FLAG named on stderr.
bad_flag() {
  local flag="$1" rc=0 out
  shift
  out=$("$BIN/outboxctl" conformance "$@" 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "conformance $*: exit $rc, not 2: $out"
  grep -q -- "$flag" <<<"$out" || fail "conformance $*: does not name $flag: $out"
}
bad_flag --sink
bad_flag --sink --sink nocolon
bad_flag --cases --sink "127.0.0.1:$C" --cases duplicates,nope
bad_flag --protocol --sink "127.0.0.1:$C" --protocol 3
bad_flag --max_batch_events --sink "127.0.0.1:$C" --max_batch_events 0
bad_flag --timeout --sink "127.0.0.1:$C" --timeout 0s
bad_flag --wrong_key --sink "127.0.0.1:$C" --wrong_cert "$CERTS/outboxctl.crt"
bad_flag --ca --sink "127.0.0.1:$C" --wrong_cert "$CERTS/outboxctl.crt" --wrong_key "$CERTS/outboxctl.key"
bad_flag --wrong_cert --sink "127.0.0.1:$C" --ca "$CERTS/ca.crt" --wrong_cert /nonexistent \
  --wrong_key "$CERTS/outboxctl.key"
conform unreachable --sink "127.0.0.1:$(free_port)" --timeout 1s
[ "$RC" = 1 ] || fail "an unreachable sink: exit $RC, not 1"
grep -q 'cannot reach the sink' "$WORK/unreachable.out" || fail "an unreachable sink: not said"
pass "bad flags exit 2 naming the flag; an unreachable sink exits 1 saying so"
