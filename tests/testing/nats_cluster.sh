#!/usr/bin/env bash
# A throwaway 3-node NATS JetStream cluster on 127.0.0.1, for the tests of
# the JetStream sink and source and, later, their chaos scenarios.
#
# Two ways to use it:
#
#   source tests/testing/nats_cluster.sh       # in a shell test
#   nats_cluster_start "$WORK/nats"            # sets NATS_URLS
#   leader=$(nats_meta_leader "$WORK/nats")    # "n1".."n3"
#   nats_node_kill "$WORK/nats" 2              # SIGKILL node 2 (a crash)
#   nats_wait_meta_leader "$WORK/nats"         # one among the living
#   nats_node_start "$WORK/nats" 2             # same ports, same data dir
#   nats_node_pause "$WORK/nats" 3             # SIGSTOP; nats_node_resume
#   nats_cluster_stop "$WORK/nats"             # also run by the EXIT trap
#
#   bash tests/testing/nats_cluster.sh start DIR [OWNER_PID]   # from a program
#   bash tests/testing/nats_cluster.sh kill|term|restart|pause|resume DIR N
#   bash tests/testing/nats_cluster.sh leader|stop DIR
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
# ships it, read in the v2.9.10 sources):
#
# - A stream's publish ack comes after the message is committed by the
#   stream's Raft group (a quorum, 2 of 3 for Replicas=3, appended it to
#   its write-ahead log) and stored by the leader. Both the WAL and the
#   stream's blocks are written in place, each message with write(2)
#   before the ack (AsyncFlush off), so an ack means: in the OS page cache
#   of at least two nodes. Nothing is fsynced per message: 2.9 fsyncs a
#   stream's blocks every 2 minutes and a Raft WAL every 5 minutes, both
#   hard-coded; a clean shutdown (SIGTERM) writes out what is pending but
#   does not fsync either.
# - So a process crash (SIGKILL, OOM kill) of any number of nodes loses
#   nothing acknowledged: the kernel still has the pages. One node's OS
#   crash or power loss can lose its last minutes; the other replicas
#   repair it when it rejoins. A coordinated power failure of a quorum
#   (one rack, one zone, the whole cluster) can lose acknowledged
#   messages; Jepsen's analysis of NATS JetStream showed exactly that
#   with the default periodic flush.
# - 2.9 has no setting for it: `sync_interval` (and `sync_interval:
#   always`, an fsync of every write) exist from nats-server 2.10 on;
#   2.9.10 refuses such a config (`unknown field "sync_interval"`). In
#   2.10 `always` covers the stream stores, so the leader has a message
#   on disk before it acks; the Raft WALs follow the setting from 2.11 on.
#   On 2.9 the choices are
#   (a) replicas in independent failure domains: `server_tags: ["az:1"]`
#       per server and `jetstream { unique_tag: "az:" }` place each
#       replica in another zone. Free at run time, but it trusts that
#       zones do not lose power together;
#   (b) store_dir on a file system mounted `-o sync` (e.g. ext4): every
#       write(2) waits for the disk, WAL and blocks alike. The cost is a
#       disk flush per message per replica: publish latency becomes the
#       device's flush latency and throughput drops by one to two orders
#       of magnitude on disks without a power-protected write cache;
#   (c) nats-server 2.11+ with `sync_interval: always` (2.10: the leader's
#       store only): the same cost, set in the server's config.
# - These test nodes share one machine and one disk: they show behaviour
#   under process crashes, never under power loss.

NATS_SERVER="${NATS_SERVER:-nats-server}"
# shellcheck source=scripts/lib/ports.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/scripts/lib/ports.sh"

_nats_die() {
  printf 'nats_cluster: %s\n' "$*" >&2
  return 1
}

# _nats_free_port OWNER_PID: a port on 127.0.0.1 leased to OWNER_PID
# (scripts/lib/ports.sh), so that no other test takes it while a node of
# this cluster is down and restarts on the same ports.
_nats_free_port() {
  port_lease "$1" || _nats_die "no free port found"
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
  # Out of the job table: a kill later is not reported as a dead job.
  disown "$pid" 2>/dev/null || true
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

# nats_node_pause DIR N / nats_node_resume DIR N: SIGSTOP / SIGCONT (a node
# that holds its connections open and answers nothing: a gray failure).
nats_node_pause() {
  local pid
  pid=$(_nats_pid "$1" "$2") || return 0
  kill -STOP "$pid" 2>/dev/null || true
}
nats_node_resume() {
  local pid
  pid=$(_nats_pid "$1" "$2") || return 0
  kill -CONT "$pid" 2>/dev/null || true
}

# nats_node_stop DIR N: SIGTERM (a clean shutdown: pending writes go out,
# without fsync), SIGKILL if it is still there after 10 s.
nats_node_stop() {
  local pid
  pid=$(_nats_pid "$1" "$2") || return 0
  kill -TERM "$pid" 2>/dev/null || true
  kill -CONT "$pid" 2>/dev/null || true  # a paused node must see the TERM
  for _ in $(seq 1 100); do _nats_alive "$pid" || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

# _nats_jsz_leader PORT: the meta leader that the node with this
# monitoring port names; empty when it names none. Never fails, so that
# callers under `set -e -o pipefail` go on polling.
_nats_jsz_leader() {
  curl -s --max-time 2 "http://127.0.0.1:$1/jsz" 2>/dev/null | tr -d '\n ' |
    grep -o '"meta_cluster":{[^}]*' | grep -o '"leader":"[^"]*"' |
    sed 's/"leader":"//; s/"$//' || true
}

# nats_meta_leader DIR: the server name of the JetStream meta leader as
# node 1..3 sees it (the first that answers); fails when none knows one.
nats_meta_leader() {
  local dir="$1" n port leader
  for n in 1 2 3; do
    _nats_pid "$dir" "$n" >/dev/null || continue
    port=$(cat "$dir/n$n.monitor_port")
    leader=$(_nats_jsz_leader "$port")
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
      leader=$(_nats_jsz_leader "$port")
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
    # The ports stay leased while the owner (or this shell) lives.
    _nats_free_port "${owner:-$$}" >"$dir/n$n.client_port" || return 1
    _nats_free_port "${owner:-$$}" >"$dir/n$n.route_port" || return 1
    _nats_free_port "${owner:-$$}" >"$dir/n$n.monitor_port" || return 1
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
    kill -CONT "$pid" 2>/dev/null || true
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
    pause) nats_node_pause "${2:?DIR}" "${3:?N}" ;;
    resume) nats_node_resume "${2:?DIR}" "${3:?N}" ;;
    leader) nats_meta_leader "${2:?DIR}" ;;
    *)
      echo "usage: $0 start DIR [OWNER_PID] | stop|leader DIR | kill|term|restart|pause|resume DIR N" >&2
      exit 2
      ;;
  esac
fi
