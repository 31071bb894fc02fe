#!/usr/bin/env bash
# The machine-wide port leases (scripts/lib/ports.sh, and the chaos suite's
# PortPool that follows the same protocol): no port is handed to two living
# owners, a port someone listens on is never handed out, and an owner's
# ports come free when it ends. In a narrowed range of 40 ports, so that
# every port is contended, below the range the other tests' pickers use
# (from 20000): a test running beside this one never listens there.
# No database.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
source "$root/tests/lib.sh"

work=$(mktemp -d /tmp/outbox-port-lease.XXXXXX)
[ -z "${KEEP_WORK:-}" ] || echo "work in $work"
owners=()
cleanup() {
  local pid
  for pid in "${owners[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${owners[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -n "${KEEP_WORK:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
export OUTBOX_PORT_LEASES="$work/leases"
export OUTBOX_PORT_RANGE="19400 19440"

sleep 300 &
a=$!
sleep 300 &
b=$!
owners+=("$a" "$b")

# A listener outside the leases on one port of the range.
python3 -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 19417)); s.listen(1)
print("ready", flush=True); time.sleep(300)' >"$work/listener.out" &
listener=$!
owners+=("$listener")
for _ in $(seq 1 50); do grep -q ready "$work/listener.out" 2>/dev/null && break; sleep 0.1; done
grep -q ready "$work/listener.out" || fail "the listener on 19417 did not start"

# Owner A takes 20 ports from bash, owner B (Python, the chaos suite's pool)
# takes the 19 left; neither gets the listener's port nor one of the other's.
for _ in $(seq 1 20); do port_lease "$a" >>"$work/a"; done
python3 - "$root" "$b" >"$work/b" <<'EOF'
import os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "e2e"))
from chaoslib import runner
owner = int(sys.argv[2])
runner.os.getpid = lambda: owner  # lease in B's name, as B's own pool would
pool = runner.PortPool()
for _ in range(19):
    print(pool.take())
try:
    pool.take()
    print("EXTRA")
except runner.HarnessError:
    pass
EOF
grep -q EXTRA "$work/b" && fail "a 40th port was handed out of 40, one of them listened on"
[ "$(sort -u "$work/a" | wc -l)" -eq 20 ] || fail "owner A got a port twice: $(tr '\n' ' ' <"$work/a")"
[ "$(sort -u "$work/b" | wc -l)" -eq 19 ] || fail "owner B got a port twice: $(tr '\n' ' ' <"$work/b")"
both=$(sort "$work/a" "$work/b" | uniq -d)
[ -z "$both" ] || fail "ports leased to both owners: $both"
grep -qx 19417 "$work/a" "$work/b" && fail "the port a listener holds was handed out"
pass "39 ports to two owners (bash and Python pickers), none twice, none listened on"

# Everything is taken: a third owner gets nothing.
if got=$(port_lease "$$" 2>/dev/null); then fail "port $got was handed out while all were leased"; fi
pass "nothing is handed out while every port is leased or listened on"

# A ends: its 20 ports come free for the next picker, and only those.
kill "$a"
wait "$a" 2>/dev/null || true
for _ in $(seq 1 20); do port_lease "$$" >>"$work/c"; done
[ "$(sort -u "$work/c")" = "$(sort -u "$work/a")" ] ||
  fail "after A ended, the next picker got $(sort -u "$work/c" | tr '\n' ' ') instead of A's ports"
pass "the ports of an owner that ended are leased again, to the next picker"

# A lease that names a pid now used by another process (its start time
# differs) is no lease.
kill "$b"
wait "$b" 2>/dev/null || true
for p in $(cat "$work/b"); do echo "$$ 1" >"$OUTBOX_PORT_LEASES/$p"; done
got=$(port_lease "$$") || fail "a lease naming a reused pid kept its port"
grep -qx "$got" "$work/b" || fail "got $got, not one of the stale leases' ports"
pass "a lease whose pid was reused by another process is taken over"
