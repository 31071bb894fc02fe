#!/usr/bin/env bash
# Relay and consumer through a NATS JetStream server that requires TLS
# with client certificates and a user and password per role, as the
# Kubernetes component deploys them: orders flow end to end and
# `outboxctl verify` finds every invariant intact. A relay with a wrong
# password, one without the CA, and one whose certificate the server does
# not trust never publish, say why, and turn NOT_SERVING; bad JetStream
# flags exit 2 naming the flag.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir jetstream-secure
command -v nats-server >/dev/null ||
  fail "nats-server is not installed (scripts/lib/common.sh ensure_packages)"
use_certs nats
# A second CA, whose certificate the server must refuse.
source "$OUTBOX_ROOT/scripts/lib/certs.sh"
make_certs "$WORK/other" relay >/dev/null || fail "cannot make the other CA"

N=$(free_port)
mkdir -p "$WORK/js"
cat >"$WORK/nats.conf" <<EOF
listen: 127.0.0.1:$N
server_name: secure
jetstream { store_dir: "$WORK/js", max_memory_store: 32MB, max_file_store: 256MB }
tls {
  cert_file: "$CERTS/nats.crt"
  key_file: "$CERTS/nats.key"
  ca_file: "$CERTS/ca.crt"
  verify: true
}
authorization {
  users: [
    { user: relay, password: "relay-secret" }
    { user: consumer, password: "consumer-secret" }
  ]
}
EOF
nats-server -c "$WORK/nats.conf" >"$WORK/nats.log" 2>&1 &
PIDS+=("$!")
deadline=$((SECONDS + 20))
until grep -q "Server is ready" "$WORK/nats.log"; do
  [ $SECONDS -lt $deadline ] || fail "nats-server did not start"
  sleep 0.1
done
URL="tls://localhost:$N"
tls=(--jetstream_ca="$CERTS/ca.crt")

# Bad flags: exit 2, naming the flag, before anything starts.
orders_db=$(new_db js_orders)
billing_db=$(new_db js_billing)
expect_exit2() {
  local what="$1" flag="$2" rc=0
  shift 2
  "$BIN/$what" --db="$orders_db" --listen="127.0.0.1:$(free_port)" "$@" \
    >"$WORK/bad.out" 2>&1 || rc=$?
  [ "$rc" = 2 ] || fail "$what $* exited $rc, not 2: $(tail -2 "$WORK/bad.out")"
  grep -q -- "$flag" "$WORK/bad.out" ||
    fail "$what $*: the error does not name $flag: $(tail -2 "$WORK/bad.out")"
}
expect_exit2 outbox-relay --jetstream: --jetstream=http://localhost:$N
expect_exit2 outbox-relay --jetstream_password --jetstream="$URL" \
  --jetstream_password=x
expect_exit2 outbox-relay --jetstream_creds --jetstream="$URL" \
  --jetstream_user=a --jetstream_creds=/nonexistent
expect_exit2 outbox-relay --jetstream_ca --jetstream="$URL" \
  --jetstream_ca=/nonexistent/ca.crt
expect_exit2 outbox-relay --jetstream_subjects --jetstream="$URL" \
  --jetstream_subjects='a.*'
expect_exit2 outbox-relay --jetstream_replicas --jetstream="$URL" \
  --jetstream_replicas=0
pass "bad JetStream flags exit 2 naming the flag"

P=$(free_port) R=$(free_port) C=$(free_port)
# The passwords from the environment, as the manifests pass them.
export OUTBOX_JETSTREAM_PASSWORD=consumer-secret
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db" \
  --jetstream="$URL" --jetstream_user=consumer "${tls[@]}" \
  --jetstream_cert="$CERTS/consumer.crt" --jetstream_key="$CERTS/consumer.key" \
  --jetstream_ack_wait=5s
start producer outbox-producer --listen="127.0.0.1:$P" --db="$orders_db"
export OUTBOX_JETSTREAM_PASSWORD=relay-secret
start relay outbox-relay \
  --listen="127.0.0.1:$R" --db="$orders_db" --jetstream="$URL" \
  --jetstream_user=relay --jetstream_replicas=1 "${tls[@]}" \
  --jetstream_cert="$CERTS/relay.crt" --jetstream_key="$CERTS/relay.key" \
  --poll_interval=200ms --retry_max=500ms
unset OUTBOX_JETSTREAM_PASSWORD
for port in "$P" "$R" "$C"; do wait_serving "$port"; done
"$BIN/outboxctl" load --producer="127.0.0.1:$P" --orders=300 --concurrency=4 \
  --timeout=3s >"$WORK/load.out" 2>"$WORK/load.err" ||
  fail "load: $(cat "$WORK/load.out" "$WORK/load.err")"
"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify.out" 2>&1 ||
  fail "invariants violated through TLS and passwords: $(cat "$WORK/verify.out")"
events=$(psql "$orders_db" -qAtc "SELECT count(*) FROM outbox")
applied=$(psql "$billing_db" -qAtc "SELECT count(*) FROM inbox")
[ "$events" -gt 0 ] && [ "$events" = "$applied" ] ||
  fail "$applied of $events events applied"
grep -q "ready (1 replicas" "$WORK/relay.log" ||
  fail "the relay never reported its stream ready"
pass "$events events through TLS with client certificates and passwords, verified"

# A relay per fault, each against its own database (nothing to publish
# but a subscription to take): it must never reach the stream, say why,
# and turn NOT_SERVING after --consumer_unready_after.
bad_relay() {
  local name="$1" why="$2" port
  shift 2
  port=$(free_port)
  start "$name" outbox-relay --listen="127.0.0.1:$port" --db="$(new_db "js_$name")" \
    --jetstream="$URL" --jetstream_replicas=1 --consumer_unready_after=2s "$@"
  local deadline=$((SECONDS + 30))
  until grep -q -- "$why" "$WORK/$name.log" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] ||
      fail "$name: no \"$why\" in its log within 30s: $(tail -3 "$WORK/$name.log")"
    sleep 0.2
  done
  deadline=$((SECONDS + 30))
  until rpc "$port" grpc.health.v1.Health/Check | grep -q NOT_SERVING; do
    [ $SECONDS -lt $deadline ] || fail "$name still SERVING"
    sleep 0.2
  done
  grep -q "ready (1 replicas" "$WORK/$name.log" && fail "$name reached the stream"
  pass "$name: \"$why\", NOT_SERVING"
}
export OUTBOX_JETSTREAM_PASSWORD=wrong
bad_relay wrong_password "Authorization Violation" \
  --jetstream_user=relay "${tls[@]}" \
  --jetstream_cert="$CERTS/relay.crt" --jetstream_key="$CERTS/relay.key"
export OUTBOX_JETSTREAM_PASSWORD=relay-secret
bad_relay no_ca "SSL handshake error" \
  --jetstream_user=relay \
  --jetstream_cert="$CERTS/relay.crt" --jetstream_key="$CERTS/relay.key"
bad_relay untrusted_cert \
  "Protocol Error\|SSL\|TLS" --jetstream_user=relay "${tls[@]}" \
  --jetstream_cert="$WORK/other/relay.crt" --jetstream_key="$WORK/other/relay.key"
