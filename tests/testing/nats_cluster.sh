#!/usr/bin/env bash
# A throwaway 3-node NATS JetStream cluster on 127.0.0.1, for the tests of
# the JetStream sink and source and, later, their chaos scenarios.
#
# Two ways to use it:
#
#   source tests/testing/nats_cluster.sh       # in a shell test
#   nats_cluster_start "$WORK/nats"            # NATS_URLS, NATS_MONITOR_PORTS
#   nats_node_kill "$WORK/nats" 2              # SIGKILL node 2 (a crash)
#   nats_node_start "$WORK/nats" 2             # same ports, same data dir
#   nats_cluster_stop "$WORK/nats"             # also run by the EXIT trap
#
#   bash tests/testing/nats_cluster.sh start DIR [OWNER_PID]   # from a program
#   bash tests/testing/nats_cluster.sh kill|term|restart DIR N
#   bash tests/testing/nats_cluster.sh stop DIR
#
# As a command, `start` returns once the cluster has a JetStream meta
# leader and leaves the servers running; DIR/urls holds the client URLs
# (comma-separated), DIR/nN.pid each node's pid. With OWNER_PID, a watcher
# stops the cluster when that process ends, so a test that crashes leaves
# no server behind. Every process is stopped by its recorded pid.
#
# Nodes are small: GOMAXPROCS=1, 32 MB memory store, 256 MB file store,
# each with its own free client, route and monitoring port.
#
# Durability (what an acknowledgement means, nats-server 2.9 as Debian 12
# ships it, checked against the v2.9.10 sources):
#
# - A stream's publish ack comes after the message is committed by its
#   Raft group (a quorum, 2 of 3 for Replicas=3, appended it to their
#   write-ahead log) and stored by the leader. "Stored" means written to
#   the file (write(2), in the OS page cache), not fsynced: 2.9 syncs a
#   stream's message blocks every 2 minutes and the Raft WAL every 5
#   minutes (both hard-coded), and on a clean shutdown.
# - So a process crash (SIGKILL, OOM kill) loses nothing acknowledged: the
#   kernel still writes the pages. A node's OS crash or power loss can lose
#   its last minutes; Replicas=3 repairs that from the other two. A
#   coordinated power failure of a quorum (one rack, one zone, the whole
#   cluster) can lose acknowledged messages; Jepsen's analysis of NATS
#   found exactly that with the default periodic flush.
# - 2.9 has no setting for it: `sync_interval` (and `sync_interval:
#   always`, an fsync before every ack) exist from nats-server 2.10 only;
#   2.9.10 refuses the config with `unknown field "sync_interval"`. On 2.9
#   the choices are (a) independent failure domains for the replicas
#   (`server_tags` with `jetstream { unique_tag: "az:" }` puts each replica
#   in another zone): free, but trusts that zones do not fail together;
#   (b) a store_dir on a file system mounted `-o sync`: every write
#   becomes synchronous, which costs an fsync per write (throughput drops
#   to what the disk's flush latency allows, on the order of hundreds to a
#   few thousand messages per second per stream instead of hundreds of
#   thousands); (c) nats-server 2.10+ with `sync_interval: always`, the same
#   cost, set per server.
# - These test nodes share one machine and one disk: they prove behaviour
#   under process crashes, not power loss.

NATS_SERVER="${NATS_SERVER:-nats-server}"

_nats_die() {
  printf 'nats_cluster: %s\n' "$*" >&2
  return 1
}

# A port on 127.0.0.1 that nothing listens on now, below the ephemeral
# range, not handed out before for DIR (DIR/.ports).
_nats_free_port() {
  local used="$1/.ports" p low
  low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  [ "$low" -gt 21000 ] 2>/dev/null || low=32768
  for _ in $(seq 1 500); do
    p=$((20000 + RANDOM % (low - 20000)))
    grep -qx "$p" "$used" 2>/dev/null && continue
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && continue
    echo "$p" >>"$used"
    echo "$p"
    return 0
  done
  _nats_die "no free port found"
}

# _nats_alive PID: the process exists and is not a zombie (a node whose
# starting shell has exited is reparented, and `kill -0` succeeds on it
# until it is reaped).
_nats_alive() {
  local state
  state=$(sed -n 's/^.*) \(.\).*/\1/p' "/proc/$1/stat" 2>/dev/null)
  [ -n "$state" ] && [ "$state" != Z ]
}

# _nats_pid DIR N: node N's pid if it is running; only a process whose
# command line names this node's config counts, so a reused pid is never
# signalled.
_nats_pid() {
  local pid
  pid=$(cat "$1/n$2.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && _nats_alive "$pid" || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$1/n$2.conf" || return 1
  echo "$pid"
}

# nats_node_start DIR N: starts node N from DIR/nN.conf (its data in
# DIR/nN/, kept across restarts), logging to DIR/nN.log; returns once its
# client port answers (at most 15 s).
nats_node_start() {
  local dir="$1" n="$2" pid port
  if _nats_pid "$dir" "$n" >/dev/null; then return 0; fi
  port=$(cat "$dir/n$n.client_port")
  GOMAXPROCS=1 "$NATS_SERVER" -c "$dir/n$n.conf" >>"$dir/n$n.log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$dir/n$n.pid"
  for _ in $(seq 1 150); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
    _nats_alive "$pid" || break
    sleep 0.1
  done
  tail -n 20 "$dir/n$n.log" >&2
  _nats_die "node $n did not start listening on 127.0.0.1:$port"
}

# nats_node_kill DIR N: SIGKILL (a crash: no flush, no goodbye).
nats_node_kill() {
  local pid
  pid=$(_nats_pid "$1" "$2") || return 0
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do _nats_alive "$pid" || break; sleep 0.05; done
}

# nats_node_stop DIR N: SIGTERM (a clean shutdown, which syncs the store),
# SIGKILL if it is still there after 10 s.
nats_node_stop() {
  local pid
  pid=$(_nats_pid "$1" "$2") || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do _nats_alive "$pid" || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

# nats_meta_leader DIR: the server name of the JetStream meta leader as
# node 1..3 sees it (the first that answers); fails when none knows one.
nats_meta_leader() {
  local dir="$1" n port leader
  for n in 1 2 3; do
    _nats_pid "$dir" "$n" >/dev/null || continue
    port=$(cat "$dir/n$n.monitor_port")
    leader=$(curl -s --max-time 2 "http://127.0.0.1:$port/jsz" |
      tr -d '\n ' | grep -o '"meta_cluster":{[^}]*' | grep -o '"leader":"[^"]*"' |
      sed 's/"leader":"//; s/"$//')
    [ -n "$leader" ] && { echo "$leader"; return 0; }
  done
  return 1
}

# nats_wait_meta_leader DIR [SECONDS]: until every running node reports the
# same meta leader, itself running (default 30 s).
nats_wait_meta_leader() {
  local dir="$1" limit="${2:-30}" deadline n port seen leader agree
  deadline=$((SECONDS + limit))
  while [ $SECONDS -lt $deadline ]; do
    agree=true seen=""
    for n in 1 2 3; do
      _nats_pid "$dir" "$n" >/dev/null || continue
      port=$(cat "$dir/n$n.monitor_port")
      leader=$(curl -s --max-time 2 "http://127.0.0.1:$port/jsz" |
        tr -d '\n ' | grep -o '"meta_cluster":{[^}]*' | grep -o '"leader":"[^"]*"' |
        sed 's/"leader":"//; s/"$//')
      if [ -z "$leader" ] || { [ -n "$seen" ] && [ "$leader" != "$seen" ]; }; then
        agree=false
        break
      fi
      seen="$leader"
    done
    # A node that was just killed stays the leader in the others' eyes
    # until they miss it: only a running one counts.
    $agree && [ -n "$seen" ] && _nats_pid "$dir" "${seen#n}" >/dev/null && return 0
    sleep 0.2
  done
  _nats_die "no JetStream meta leader within ${limit}s"
}

# nats_cluster_start DIR [OWNER_PID]: writes three node configs into DIR
# (created), starts the nodes and waits for a meta leader. Sets NATS_URLS
# (comma-separated client URLs, also in DIR/urls). Without OWNER_PID it
# installs an EXIT trap that stops the cluster (replacing any EXIT trap of
# the caller: call nats_cluster_stop from yours instead if you have one).
nats_cluster_start() {
  local dir="$1" owner="${2:-}" n m routes="" urls=""
  command -v "$NATS_SERVER" >/dev/null || _nats_die "$NATS_SERVER is not installed" || return 1
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  for n in 1 2 3; do
    _nats_free_port "$dir" >"$dir/n$n.client_port" || return 1
    _nats_free_port "$dir" >"$dir/n$n.route_port" || return 1
    _nats_free_port "$dir" >"$dir/n$n.monitor_port" || return 1
    routes+="${routes:+, }nats-route://127.0.0.1:$(cat "$dir/n$n.route_port")"
    urls+="${urls:+,}nats://127.0.0.1:$(cat "$dir/n$n.client_port")"
  done
  for n in 1 2 3; do
    mkdir -p "$dir/n$n"
    cat >"$dir/n$n.conf" <<EOF
server_name: n$n
listen: 127.0.0.1:$(cat "$dir/n$n.client_port")
http: 127.0.0.1:$(cat "$dir/n$n.monitor_port")
jetstream {
  store_dir: "$dir/n$n"
  max_memory_store: 32MB
  max_file_store: 256MB
}
cluster {
  name: outbox-test
  listen: 127.0.0.1:$(cat "$dir/n$n.route_port")
  routes: [$routes]
}
EOF
  done
  echo "$urls" >"$dir/urls"
  NATS_URLS="$urls"
  if [ -z "$owner" ]; then
    # shellcheck disable=SC2064
    trap "nats_cluster_stop '$dir'" EXIT
  fi
  for n in 1 2 3; do
    nats_node_start "$dir" "$n" || { nats_cluster_stop "$dir"; return 1; }
  done
  if [ -n "$owner" ]; then
    # Bounded by the owner's life; it polls once a second.
    (
      trap '' HUP
      while _nats_alive "$owner" && [ ! -f "$dir/.stopped" ]; do sleep 1; done
      nats_cluster_stop "$dir"
    ) </dev/null >/dev/null 2>&1 &
    echo $! >"$dir/watcher.pid"
  fi
  nats_wait_meta_leader "$dir" 30 || {
    for m in 1 2 3; do tail -n 10 "$dir/n$m.log" >&2; done
    nats_cluster_stop "$dir"
    return 1
  }
}

# nats_cluster_stop DIR: every node by its pid, all at once (SIGTERM, then
# SIGKILL for any still there after 10 s).
nats_cluster_stop() {
  local dir="$1" n pid pids=()
  [ -d "$dir" ] || return 0
  touch "$dir/.stopped"
  for n in 1 2 3; do
    pid=$(_nats_pid "$dir" "$n") || continue
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 100); do _nats_alive "$pid" || break; sleep 0.1; done
    _nats_alive "$pid" && kill -KILL "$pid" 2>/dev/null
  done
  return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -u
  cmd="${1:-}"
  case "$cmd" in
    start) nats_cluster_start "${2:?DIR}" "${3:-}" && trap - EXIT ;;
    stop) nats_cluster_stop "${2:?DIR}" ;;
    kill) nats_node_kill "${2:?DIR}" "${3:?N}" ;;
    term) nats_node_stop "${2:?DIR}" "${3:?N}" ;;
    restart) nats_node_start "${2:?DIR}" "${3:?N}" ;;
    leader) nats_meta_leader "${2:?DIR}" ;;
    *)
      echo "usage: $0 start DIR [OWNER_PID] | stop DIR | kill|term|restart DIR N | leader DIR" >&2
      exit 2
      ;;
  esac
fi
