#!/usr/bin/env bash
# tests/testing/nats_cluster.sh as a shell test uses it: three nodes agree
# on a meta leader; the leader killed, the two others elect one of
# themselves; the killed node restarts from its own data and rejoins; at
# exit the trap leaves no node running.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v nats-server >/dev/null || { echo "skip: nats-server is not installed"; exit 0; }
dir=$(mktemp -d /tmp/outbox-nats-sh.XXXXXX)
out=$(mktemp /tmp/outbox-nats-sh.XXXXXX.log)
trap 'rm -rf "$dir" "$out"' EXIT

# The cluster's life in a child shell, so that its EXIT trap can be checked.
bash ${NATS_TEST_TRACE:+-x} -c '
  set -euo pipefail
  source "$1/../testing/nats_cluster.sh"
  nats_cluster_start "$2"
  [ "$(echo "$NATS_URLS" | tr , "\n" | grep -c "^nats://127.0.0.1:")" = 3 ] ||
    { echo "FAIL: urls $NATS_URLS"; exit 1; }
  first=$(nats_meta_leader "$2")
  echo "ok: meta leader $first"
  n=${first#n}
  start=$SECONDS
  nats_node_kill "$2" "$n"
  nats_wait_meta_leader "$2" 30
  second=$(nats_meta_leader "$2")
  [ "$second" != "$first" ] || { echo "FAIL: $first still leads"; exit 1; }
  echo "ok: $first killed, $second leads after $((SECONDS - start))s"
  nats_node_start "$2" "$n"
  nats_wait_meta_leader "$2" 30
  port=$(cat "$2/n$n.monitor_port")
  # Read whole first: grep -q would end the pipe early, and pipefail
  # would call that a failure.
  jsz=$(curl -s --max-time 2 "http://127.0.0.1:$port/jsz" | tr -d "\n ")
  grep -q "\"meta_cluster\":{[^}]*\"leader\":\"$second\"" <<<"$jsz" ||
    { echo "FAIL: restarted $first does not follow $second: $jsz"; exit 1; }
  echo "ok: $first restarted and follows $second"
' _ "$here" "$dir" >"$out" 2>&1 || { cat "$out"; exit 1; }
cat "$out"

for n in 1 2 3; do
  pid=$(cat "$dir/n$n.pid")
  state=$(sed -n 's/^.*) \(.\).*/\1/p' "/proc/$pid/stat" 2>/dev/null || true)
  if [ -n "$state" ] && [ "$state" != Z ] &&
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "$dir/n$n.conf"; then
    kill -KILL "$pid"
    echo "FAIL: node $n ($pid) outlived its shell"
    exit 1
  fi
done
echo "ok: no node left after exit"
