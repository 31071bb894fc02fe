# Ports on 127.0.0.1 for throwaway servers, leased machine-wide. Source it;
# it defines functions only.
#
# Picking "a port nothing listens on now" is not enough when tests run side
# by side: a server stopped on purpose (a node restarted by a chaos
# scenario) leaves its port free for a moment, another test's picker takes
# it, and the restarted server cannot bind. So every picker of this project
# leases its port: a file OUTBOX_PORT_LEASES/PORT names the owning process
# (pid and start time, so that a reused pid is not taken for it), and the
# lease holds until that process ends. The Python pickers of the chaos suite
# (tests/e2e/chaoslib/runner.py, PortPool) follow the same protocol.
#
# Ports come from below the kernel's ephemeral range: an outgoing
# connection can take a port in it before a server binds it.
# OUTBOX_PORT_RANGE="LOW HIGH" (HIGH excluded) narrows the range, for the
# test of this protocol (tests/cli/port_lease_test.sh).

OUTBOX_PORT_LEASES="${OUTBOX_PORT_LEASES:-/tmp/outbox-port-leases}"

# _port_proc_start PID: the process's start time (clock ticks since boot),
# or failure if it has ended or is a zombie.
_port_proc_start() {
  local rest
  rest=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
  # shellcheck disable=SC2086
  set -- $rest
  [ -n "${20:-}" ] && [ "$1" != Z ] || return 1
  echo "${20}"
}

# _port_lease_held FILE: its owner still runs.
_port_lease_held() {
  local pid start
  read -r pid start <"$1" 2>/dev/null || return 1
  [ -n "$pid" ] && [ "$(_port_proc_start "$pid")" = "$start" ]
}

# _port_listened PORT: a socket listens on it, on any address. Read from
# the kernel's table rather than by connecting, which a listener with a
# full backlog leaves hanging.
_port_listened() {
  awk -v port="$(printf '%04X' "$1")" '
    $4 == "0A" { n = split($2, a, ":"); if (a[n] == port) found = 1 }
    END { exit !found }' /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

# _port_range: sets PORT_LOW and PORT_HIGH.
_port_range() {
  # shellcheck disable=SC2086
  set -- ${OUTBOX_PORT_RANGE:-}
  if [ $# -eq 2 ]; then
    PORT_LOW=$1 PORT_HIGH=$2
    return
  fi
  PORT_LOW=20000
  PORT_HIGH=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  [ "$PORT_HIGH" -gt 21000 ] 2>/dev/null || PORT_HIGH=32768
}

# port_lease OWNER_PID: prints a port on 127.0.0.1 that nothing listens on
# and that no living process holds a lease on, leased to OWNER_PID.
port_lease() {
  local owner="$1" dir="$OUTBOX_PORT_LEASES" start tmp p
  start=$(_port_proc_start "$owner") || {
    echo "port_lease: no process $owner" >&2
    return 1
  }
  if [ ! -d "$dir" ]; then
    mkdir -p "$dir" 2>/dev/null && chmod 1777 "$dir" 2>/dev/null
  fi
  tmp="$dir/.new.$$.$RANDOM"
  echo "$owner $start" >"$tmp" || return 1
  _port_range
  # From a random port on, each port of the range at most once.
  local size=$((PORT_HIGH - PORT_LOW)) first i
  first=$(((RANDOM * 32768 + RANDOM) % size))
  for ((i = 0; i < size && i < 3000; i++)); do
    p=$((PORT_LOW + (first + i) % size))
    # A hard link appears whole or not at all, and fails if the lease exists.
    if ! ln "$tmp" "$dir/$p" 2>/dev/null; then
      _port_lease_held "$dir/$p" && continue
      rm -f "$dir/$p"
      ln "$tmp" "$dir/$p" 2>/dev/null || continue
    fi
    if _port_listened "$p"; then
      rm -f "$dir/$p"  # something outside the leases listens there
      continue
    fi
    rm -f "$tmp"
    echo "$p"
    return 0
  done
  rm -f "$tmp"
  echo "port_lease: no free port found" >&2
  return 1
}
