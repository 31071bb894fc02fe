#!/usr/bin/env bash
# outboxctl refuses a flag out of range before it contacts anything: exit 2
# and a message that names the flag. Nothing listens where it would call
# (port 9 on loopback), so a flag let through fails differently.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"

nowhere=127.0.0.1:9
db=postgresql://127.0.0.1:9/none
# refused FLAG ARGS...: outboxctl ARGS exits 2 naming FLAG.
refused() {
  local flag="$1" out rc=0
  shift
  out=$("$BIN/outboxctl" --producer=$nowhere --relay=$nowhere --consumer=$nowhere \
    --orders_db=$db --billing_db=$db "$@" 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "outboxctl $*: exit $rc, not 2: $out"
  grep -q -- "$flag" <<<"$out" || fail "outboxctl $*: does not name $flag: $out"
  pass "outboxctl $*: $out"
}

refused --timeout stats --timeout=0s
refused --timeout show 00000000-0000-0000-0000-000000000000 --timeout=-1s
refused --wait verify --wait=-1s
refused --since requeue --all-dead --since=-1h
refused --limit reconcile --limit=-1
refused --grace reconcile --grace=-5m
refused --concurrency demo --concurrency=0
refused --rate load --orders=10 --rate=-5
refused --pay_fraction load --pay_fraction=1.5
refused --only load --only=refund
refused --max_tries load --max_tries=0
refused usage no-such-command
