#!/usr/bin/env bash
# Runs what the dev overlay would run, as local processes: renders
# deploy/k8s/overlays/dev, takes each outbox container's command, args and
# environment (ConfigMap and Secret references resolved from the rendered
# objects) and starts them with the binaries of BIN_DIR against a test
# PostgreSQL, with real certificates (openssl) issued from the rendered
# cert-manager Certificates and mounted where the pods mount their Secrets.
# Checks health SERVING on the probe (plaintext health) ports, that the API
# ports refuse plaintext, /metrics on the annotated ports, JSON logs,
# reflection, an order flowing from producer to the consumer of every
# subscription (billing, audit) through its relay over mutual TLS, an
# outboxctl load verified end to end for each subscription (and by the
# reconcile CronJob's outboxctl command, which must exit 0), who is admitted
# and refused, renewed certificates served without a restart, and a clean
# exit within the grace period after SIGTERM. A flag or OUTBOX_* variable in
# the manifests that a binary does not know fails the test. See
# tests/deploy/rendered.mjs for the rewrites (addresses -> 127.0.0.1 or
# localhost and free ports, database names unique per run, Secret mounts ->
# local copies).
#
# Usage: OUTBOX_TEST_PG_URL=postgresql://postgres@127.0.0.1:5432 \
#          tests/deploy/run_rendered.sh BIN_DIR [--replicas=N] [--overlay=dev]
#                                               [--components=producer,relay,consumer]
#   BIN_DIR   directory holding outbox-producer, outbox-relay, outbox-consumer
#             (and outboxctl: without it the load/verify/stats steps are skipped)
#   OUTBOX_TEST_PG_URL  a PostgreSQL server (no database in the URL, or one
#             to connect to for CREATE DATABASE); the run creates and drops
#             its own uniquely named databases (KEEP_DATABASES=1 keeps them).
#   --replicas=N  start N instances of each Deployment at once (default: the
#             manifest's replica count), e.g. 2 to exercise concurrent
#             migrations and relay partition ownership.
# Exit 0 if every check passed, 1 otherwise. Callable from any directory.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

fail() { echo "run_rendered: $*" >&2; exit 1; }

[[ $# -ge 1 ]] || fail "usage: run_rendered.sh BIN_DIR [--replicas=N] [--components=LIST]"
bin_dir=$1
shift
[[ -d "$bin_dir" ]] || fail "BIN_DIR $bin_dir is not a directory"
bin_dir=$(cd "$bin_dir" && pwd)
overlay=dev
extra=()
for a in "$@"; do
  case "$a" in
    --overlay=*) overlay=${a#--overlay=} ;;
    --replicas=* | --components=*) extra+=("$a") ;;
    *) fail "unknown option $a" ;;
  esac
done
[[ -n "${OUTBOX_TEST_PG_URL:-}" ]] || fail "set OUTBOX_TEST_PG_URL to a PostgreSQL server, e.g. postgresql://postgres@127.0.0.1:5432"
for tool in kubectl node psql openssl; do
  command -v "$tool" >/dev/null || fail "$tool not found"
done
[[ -x "$here/node_modules/.bin/buf" && -d "$here/node_modules/yaml" ]] ||
  fail "node_modules incomplete: run 'npm ci' in $here"
psql "$OUTBOX_TEST_PG_URL" -X -At -c 'SELECT 1' >/dev/null 2>&1 ||
  PGCONNECT_TIMEOUT=5 psql "$OUTBOX_TEST_PG_URL" -X -At -c 'SELECT 1' >/dev/null ||
  fail "cannot connect to OUTBOX_TEST_PG_URL=$OUTBOX_TEST_PG_URL"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/run_rendered.XXXXXX")
node_pid=
cleanup() {
  local rc=$?
  # Normally rendered.mjs has stopped everything; this covers it dying.
  [[ -n "$node_pid" ]] && kill "$node_pid" 2>/dev/null || true
  if [[ -f "$tmp/pids" ]]; then
    while read -r pid exe; do
      # Only our own children: the pid must still run the same binary.
      if [[ "$(readlink "/proc/$pid/exe" 2>/dev/null)" == "$exe" ]]; then
        kill -KILL "$pid" 2>/dev/null || true
      fi
    done <"$tmp/pids"
  fi
  # Databases of this run that rendered.mjs could not drop (it died).
  if [[ -f "$tmp/databases" && "${KEEP_DATABASES:-0}" != 1 ]]; then
    while read -r db; do
      psql "$OUTBOX_TEST_PG_URL" -X -q -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null 2>&1 || true
    done <"$tmp/databases"
  fi
  if [[ $rc -ne 0 ]]; then
    echo "run_rendered: logs kept in $tmp"
  else
    rm -rf "$tmp"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

kubectl kustomize "$root/deploy/k8s/overlays/$overlay" >"$tmp/rendered.yaml" 2>"$tmp/kustomize.err" ||
  fail "kubectl kustomize deploy/k8s/overlays/$overlay failed: $(cat "$tmp/kustomize.err")"

# A hard bound on the whole run, so that CI never hangs on it.
timeout --signal=TERM --kill-after=15 "${RUN_RENDERED_TIMEOUT:-300}" \
  node "$here/rendered.mjs" "--rendered=$tmp/rendered.yaml" "--bin=$bin_dir" \
  "--pg=$OUTBOX_TEST_PG_URL" "--root=$root" "--tmp=$tmp" ${extra[@]+"${extra[@]}"} &
node_pid=$!
rc=0
wait "$node_pid" || rc=$?
node_pid=
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
  echo "run_rendered: timed out after ${RUN_RENDERED_TIMEOUT:-300} s" >&2
fi
[[ $rc -eq 0 ]] || exit 1
