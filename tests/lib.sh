# Helpers for shell tests that run the real binaries: fresh databases on the
# test PostgreSQL (OUTBOX_TEST_PG_URL), processes started and stopped by
# pid, and `buf curl` as an independent reflection-based gRPC client.
# Source it; call `use_workdir NAME` first.

OUTBOX_ROOT="${OUTBOX_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
BIN="${OUTBOX_BIN:-$OUTBOX_ROOT/build/bin}"
BUF="$OUTBOX_ROOT/tests/deploy/node_modules/.bin/buf"
PIDS=()
# shellcheck source=scripts/lib/ports.sh
source "$OUTBOX_ROOT/scripts/lib/ports.sh"

# fail MESSAGE: says why, then the end of every process's log, so that a
# failure on a CI machine can be understood without its work folder.
fail() {
  echo "FAIL: $*" >&2
  local f
  for f in "${WORK:-/nonexistent}"/*.log; do
    [ -f "$f" ] || continue
    echo "--- last lines of $(basename "$f")" >&2
    tail -n 15 "$f" >&2
  done
  exit 1
}
pass() { echo "ok: $*"; }

use_workdir() {
  : "${OUTBOX_TEST_PG_URL:?run through ./scripts/test, which starts PostgreSQL}"
  WORK=$(mktemp -d "/tmp/outbox-$1.XXXXXX")
  trap stop_all EXIT
}

# stop_pids: SIGTERM to every process in PIDS, SIGKILL to any still there
# 10 s later.
stop_pids() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
}

stop_all() {
  stop_pids
  if [ -n "${KEEP_WORK:-}" ]; then echo "logs in $WORK"; else rm -rf "$WORK"; fi
}

# new_db NAME: creates a fresh database; prints its URL.
new_db() {
  local name="t_$1_$RANDOM$RANDOM"
  psql "$OUTBOX_TEST_PG_URL/postgres" -qc "CREATE DATABASE $name" >/dev/null
  echo "$OUTBOX_TEST_PG_URL/$name"
}

# A port on 127.0.0.1 that nothing listens on now, leased to this test
# until it ends (scripts/lib/ports.sh).
free_port() {
  port_lease "$$"
}

# start NAME BINARY ARGS...: runs build/bin/BINARY in the background, logging
# to $WORK/NAME.log; sets LAST_PID.
start() {
  local name="$1" bin="$2"
  shift 2
  "$BIN/$bin" "$@" >>"$WORK/$name.log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

# rpc PORT SERVICE/METHOD [JSON]: a unary call through reflection, as
# grpcurl users make it; prints the response (or the error) as JSON.
rpc() {
  "$BUF" curl --protocol grpc --http2-prior-knowledge --timeout 10s \
    -d "${3:-{\}}" "http://127.0.0.1:$1/$2" 2>&1
}

# wait_serving PORT [SECONDS]: until grpc.health.v1 says SERVING.
wait_serving() {
  local deadline=$((SECONDS + ${2:-30}))
  while [ $SECONDS -lt $deadline ]; do
    rpc "$1" grpc.health.v1.Health/Check | grep -q '"SERVING"' && return 0
    sleep 0.2
  done
  fail "port $1 did not report SERVING within ${2:-30}s"
}

# json_field KEY: the first "KEY": value on stdin, unquoted.
json_field() {
  grep -o "\"$1\": *\"\?[^\",}]*" | head -1 | sed -E "s/\"$1\": *\"?//"
}

# rpc_as CERT PORT SERVICE/METHOD [JSON]: a call over mutual TLS,
# presenting $CERTS/CERT.crt (CA $CERTS/ca.crt); CERT "-" presents none.
# Prints the response or the error; never fails itself.
rpc_as() {
  local who="$1" port="$2" method="$3" data="${4:-{\}}" id=()
  [ "$who" = - ] || id=(--cert "$CERTS/$who.crt" --key "$CERTS/$who.key")
  "$BUF" curl --protocol grpc --timeout 10s --cacert "$CERTS/ca.crt" "${id[@]}" \
    -d "$data" "https://localhost:$port/$method" 2>&1 || true
}

# use_certs: a throwaway CA and certificates in $WORK/certs ($CERTS) for
# the three services, outboxctl, and any further NAMES given.
use_certs() {
  CERTS="$WORK/certs"
  # shellcheck source=../scripts/lib/certs.sh
  source "$OUTBOX_ROOT/scripts/lib/certs.sh"
  make_certs "$CERTS" producer relay consumer outboxctl "$@" >/dev/null ||
    fail "cannot make certificates (openssl)"
}
