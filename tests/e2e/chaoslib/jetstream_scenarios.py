"""The JetStream scenarios (group "jetstream"): the relays publish to a
replicated stream on a 3-node NATS JetStream cluster of the scenario's own
(`outbox-relay --jetstream=...`) and the consumers read it with a durable
pull consumer (`outbox-consumer --jetstream=...`) into the billing inbox;
the faults hit the cluster's nodes (SIGKILL of the stream leader, rolling
SIGTERM restarts, SIGSTOP), the client links to it (through the harness's
own TCP proxy) or the relays and consumers themselves.

The cluster is tests/testing/nats_cluster.sh's (three nodes on loopback,
plaintext NATS: the gRPC links keep the harness's mutual TLS), started by
its `start DIR OWNER_PID` with the harness as the owner (its watcher stops
the nodes if the harness dies), stopped by its `stop DIR` (by pid) at the
scenario's end and by an atexit hook. Every node runs with
`--no_advertise=true`: a client knows only the URLs it was given, so one
that dials the cluster through the fault proxies cannot learn the nodes'
own addresses from the servers and reconnect around the proxies.

Who leads is read from the nodes' monitoring endpoints
(`/jsz?accounts=true&streams=true&consumers=true`): a node's view of a
stream or consumer names the leader of its Raft group, and only a node
that names itself counts (a follower's view can be stale while it has not
yet missed a leader that died or froze).

`outboxctl verify` counts an event as drained once the relay marked it
delivered, which with a broker in between is its publish ack, not its
apply; so before the checker runs the harness waits until the relays owe
nothing (no pending `outbox_delivery` row) and the durable consumer has
nothing undelivered or unacknowledged (its `num_pending` and
`num_ack_pending`, from the consumer's leader), within the same I5 bound.
Then the usual checker, plus one check of the broker's own: the stream
holds exactly one message per committed event (the relays' Nats-Msg-Id
and expected-last-subject-sequence publishes never store an event twice).
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass

from .proxy import FaultProxy
from .runner import HarnessError, Run
from .scenarios import Scenario, kill_relays

GROUP = "jetstream"
STREAM = "OUTBOX_BILLING"      # the relay's and consumer's default stream
DURABLE = "outbox-consumer"    # the consumer's default durable name
NODES = (1, 2, 3)
# A message the consumer took and did not acknowledge (it was killed, its
# link cut) is delivered again this long after: shorter than the default
# 30 s, so that a scenario drains within seconds of its faults.
ACK_WAIT = "5s"
CLUSTER_HEAL = 45.0  # s the cluster may take to have its leaders back
LEADER_KILLS = 2     # js-leader-kill: at least this many, however short
LEADER_WAIT = 12.0   # s to wait for a leader to kill (an election: 4-9 s)
LEADER_OVERRUN = 10.0  # s the leader kills may go on after the window
PAUSE_OVERRUN = 10.0   # s js-pause's owed pauses may go on after it
RESTART_OVERRUN = 10.0  # s js-node-restart's round may go on after it
NET_OVERRUN = 11.0     # s js-net-cut's owed cut and blackhole may go on
CATCH_UP = 10.0      # s a restarted node may take to be a current replica

_LIVE = set()  # clusters still running, stopped by the atexit hook
_LIVE_LOCK = threading.Lock()


def stop_live_clusters():
    with _LIVE_LOCK:
        live = list(_LIVE)
    for c in live:
        c.stop()


atexit.register(stop_live_clusters)


class NatsError(Exception):
    pass


class NatsCluster:
    """Three nats-server nodes (n1..n3) of tests/testing/nats_cluster.sh in
    a folder of their own, with the node operations of the script and the
    monitoring endpoints' view of the stream and its consumer."""

    def __init__(self, root, name):
        self.root = root
        self.script = os.path.join(root, "tests", "testing", "nats_cluster.sh")
        self.dir = tempfile.mkdtemp(prefix=f"outbox-chaos-nats-{name}.")
        self.down = set()    # nodes killed or stopped by us
        self.paused = set()  # nodes SIGSTOPped by us
        self.client_port = {}
        self.monitor_port = {}
        self.urls = []
        self.wrapper = None  # nats-server with --no_advertise (start)
        self.watcher = None  # the script's watcher's pid (start)
        self.stopped = False
        self.lock = threading.Lock()

    # -- the script ---------------------------------------------------------

    def _script(self, *args, timeout=60):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("OUTBOX_")}
        env["NATS_SERVER"] = self.wrapper
        try:
            r = subprocess.run(["bash", self.script] + [str(a) for a in args],
                               stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, timeout=timeout, env=env,
                               start_new_session=True)
        except subprocess.TimeoutExpired:
            raise NatsError(f"nats_cluster.sh {' '.join(map(str, args))}: "
                            f"no answer in {timeout}s")
        if r.returncode != 0:
            raise NatsError(f"nats_cluster.sh {' '.join(map(str, args))} "
                            f"failed (rc {r.returncode}): "
                            f"{(r.stderr or r.stdout).strip()[-600:]}")
        return r.stdout

    def start(self, owner_pid):
        server = shutil.which("nats-server")
        if server is None:
            raise NatsError("nats-server is not installed (Debian package "
                            "nats-server)")
        # Clients learn nothing but the URLs they are given (see the
        # module's docstring): no connect_urls in the servers' INFO.
        self.wrapper = os.path.join(self.dir, "nats-server-no-advertise")
        with open(self.wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec {server} --no_advertise=true "$@"\n')
        os.chmod(self.wrapper, 0o755)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._script("start", self.dir, owner_pid, timeout=90)
        try:
            self.watcher = int(self._read("watcher.pid"))
        except (OSError, ValueError):
            self.watcher = None
        for n in NODES:
            self.client_port[n] = int(self._read(f"n{n}.client_port"))
            self.monitor_port[n] = int(self._read(f"n{n}.monitor_port"))
        self.urls = [f"nats://127.0.0.1:{self.client_port[n]}" for n in NODES]
        return self

    def _read(self, name):
        with open(os.path.join(self.dir, name)) as f:
            return f.read().strip()

    def pid(self, n):
        try:
            return int(self._read(f"n{n}.pid"))
        except (OSError, ValueError):
            return None

    def kill(self, n):
        """SIGKILL (a crash); returns the pid."""
        pid = self.pid(n)
        self._script("kill", self.dir, n)
        self.down.add(n)
        self.paused.discard(n)
        return pid

    def term(self, n):
        """SIGTERM, a clean shutdown (the script waits for the exit, and
        SIGKILLs after 10 s); returns the pid."""
        pid = self.pid(n)
        self._script("term", self.dir, n, timeout=30)
        self.down.add(n)
        self.paused.discard(n)
        return pid

    def restart(self, n):
        """Starts node n again (same ports, same data); returns its pid."""
        self._script("restart", self.dir, n, timeout=30)
        self.down.discard(n)
        return self.pid(n)

    def pause(self, n):
        self._script("pause", self.dir, n)
        self.paused.add(n)
        return self.pid(n)

    def resume(self, n):
        self._script("resume", self.dir, n)
        self.paused.discard(n)
        return self.pid(n)

    def stop(self):
        """Every node by its pid (the script's stop), once."""
        with self.lock:
            if self.stopped or self.wrapper is None:
                return
            self.stopped = True
        try:
            self._script("stop", self.dir, timeout=60)
        except NatsError:
            pass
        # The script's watcher (it stops the nodes should the harness die)
        # sees DIR/.stopped within a second and ends; until it has, it may
        # still touch DIR (so the folder would outlive its removal).
        watcher = self.watcher
        deadline = time.monotonic() + 5
        while watcher is not None and self._is_watcher(watcher):
            if time.monotonic() > deadline:
                try:
                    os.kill(watcher, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                break
            time.sleep(0.1)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def _is_watcher(self, pid):
        """Whether `pid` is still this cluster's watcher (not a reused pid,
        not a zombie)."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return self.dir.encode() in f.read()
        except (OSError, IndexError):
            return False

    def keep_logs(self, into):
        for n in NODES:
            src = os.path.join(self.dir, f"n{n}.log")
            if os.path.exists(src):
                shutil.copy(src, os.path.join(into, f"nats-n{n}.log"))

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- the monitoring endpoints -------------------------------------------

    def up(self):
        """The nodes running and not paused (the ones that can answer)."""
        return [n for n in NODES if n not in self.down
                and n not in self.paused]

    def jsz(self, n, timeout=1.0):
        url = (f"http://127.0.0.1:{self.monitor_port[n]}/jsz?accounts=true"
               "&streams=true&consumers=true")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return json.loads(r.read().decode(errors="replace"))
        except Exception:
            return None

    @staticmethod
    def _stream_of(view, stream):
        for acc in (view or {}).get("account_details") or []:
            for s in acc.get("stream_detail") or []:
                if s.get("name") == stream:
                    return s
        return None

    def views(self, stream=STREAM):
        """{node: its view of `stream`} of every node that answers."""
        out = {}
        for n in self.up():
            s = self._stream_of(self.jsz(n), stream)
            if s is not None:
                out[n] = s
        return out

    def stream_leader(self, stream=STREAM, views=None):
        """(node, its view of the stream) of the node that says it leads
        the stream's Raft group, or (None, None)."""
        views = self.views(stream) if views is None else views
        for n, s in sorted(views.items()):
            if (s.get("cluster") or {}).get("leader") == f"n{n}":
                return n, s
        return None, None

    def consumer_leader(self, stream=STREAM, durable=DURABLE, views=None):
        """(node, its view of the durable consumer) of the node that says
        it leads the consumer's Raft group, or (None, None)."""
        views = self.views(stream) if views is None else views
        for n, s in sorted(views.items()):
            for c in s.get("consumer_detail") or []:
                if c.get("name") != durable:
                    continue
                if (c.get("cluster") or {}).get("leader") == f"n{n}":
                    return n, c
        return None, None

    def wait_leader(self, what, timeout):
        """The node that leads the stream ("stream") or the durable
        ("consumer"), waiting up to `timeout` s for one; None if none."""
        deadline = time.monotonic() + timeout
        while True:
            f = self.stream_leader if what == "stream" else \
                self.consumer_leader
            n, _ = f()
            if n is not None or time.monotonic() >= deadline:
                return n
            time.sleep(0.2)

    def current(self, n, views=None):
        """Whether node n is a current replica of the stream in its
        leader's eyes (or is the leader)."""
        leader, s = self.stream_leader(views=views)
        if leader is None:
            return False
        if leader == n:
            return True
        for r in (s.get("cluster") or {}).get("replicas") or []:
            if r.get("name") == f"n{n}":
                return bool(r.get("current")) and not r.get("offline")
        return False

    def healthy(self):
        """'' when every node runs, the stream has a leader with both other
        replicas current and the durable consumer has a leader; else what
        is missing."""
        if len(self.up()) != len(NODES):
            missing = sorted(set(NODES) - set(self.up()))
            return f"nodes down or paused: {missing}"
        views = self.views()
        if not views:
            return f"no node shows stream {STREAM}"
        leader, s = self.stream_leader(views=views)
        if leader is None:
            return f"stream {STREAM} has no leader"
        behind = [r.get("name") for r in
                  (s.get("cluster") or {}).get("replicas") or []
                  if not r.get("current") or r.get("offline")]
        if behind or len((s.get("cluster") or {}).get("replicas") or []) != 2:
            return (f"stream {STREAM} (leader n{leader}) has replicas not "
                    f"current: {behind}")
        if self.consumer_leader(views=views)[0] is None:
            return f"durable {DURABLE} has no leader"
        return ""

    def client_connections(self):
        """The client connections of every node (its /connz), or None when
        a node does not answer."""
        total = 0
        for n in NODES:
            try:
                url = f"http://127.0.0.1:{self.monitor_port[n]}/connz"
                with urllib.request.urlopen(url, timeout=2) as r:
                    total += int(json.loads(r.read())["num_connections"])
            except Exception:
                return None
        return total

    def describe(self):
        """One line per node: its view of the stream and the durable."""
        lines = []
        for n in NODES:
            state = ("down" if n in self.down else
                     "paused" if n in self.paused else "up")
            view = self.jsz(n, timeout=2) if state == "up" else None
            s = self._stream_of(view, STREAM) if view else None
            if s is None:
                lines.append(f"n{n} ({state}, pid {self.pid(n)}, client "
                             f":{self.client_port[n]}, monitor "
                             f":{self.monitor_port[n]}): no view of "
                             f"{STREAM}" + ("" if view else
                                            " (no answer)" if state == "up"
                                            else ""))
                continue
            cl = s.get("cluster") or {}
            reps = ", ".join(
                f"{r.get('name')} current={r.get('current')}"
                + (" offline" if r.get("offline") else "")
                for r in cl.get("replicas") or [])
            st = s.get("state") or {}
            line = (f"n{n} ({state}, pid {self.pid(n)}): stream leader "
                    f"{cl.get('leader')!r}, replicas [{reps}], messages "
                    f"{st.get('messages')}, seq {st.get('first_seq')}-"
                    f"{st.get('last_seq')}")
            for c in s.get("consumer_detail") or []:
                line += (f"; consumer {c.get('name')} leader "
                         f"{(c.get('cluster') or {}).get('leader')!r} "
                         f"delivered {(c.get('delivered') or {})} ack_floor "
                         f"{(c.get('ack_floor') or {})} num_pending "
                         f"{c.get('num_pending')} num_ack_pending "
                         f"{c.get('num_ack_pending')} num_redelivered "
                         f"{c.get('num_redelivered')} num_waiting "
                         f"{c.get('num_waiting')}")
            lines.append(line)
        return lines


# -- the scenario and its runner ----------------------------------------------


@dataclass
class JetStreamScenario(Scenario):
    # every relay and consumer dials the cluster through a fault proxy per
    # node (run.js_proxies: process name -> [proxy to n1, n2, n3])
    proxy_nats: bool = False
    group: str = GROUP
    # after the heal every process must say SERVING by itself (within
    # AFTER_HEAL s; check_stream reports one that does not)
    health_after_heal: bool = True

    @property
    def run_class(self):
        return JetStreamRun


class JetStreamRun(Run):
    """A Run whose relays publish to a NATS JetStream cluster of its own and
    whose consumers read it (a durable pull consumer); everything else
    (processes, supervisor, load, heal, checker, evidence) is the
    runner's."""

    def __init__(self, suite, scenario, seconds, seed, index):
        super().__init__(suite, scenario, seconds, seed, index)
        self.nats = None
        self.js_proxies = {}  # process name -> [FaultProxy to n1, n2, n3]
        self.js = {}          # figures for the notes and --json
        self.js_notes = []
        self.leaders_seen = []  # the stream leader at each fault that asked
        self.js_drain_seconds = None

    # -- the runner's hooks -------------------------------------------------

    def setup(self):
        self.nats = NatsCluster(self.suite.root, self.name)
        try:
            self.nats.start(os.getpid())
        except NatsError as e:
            raise HarnessError(f"jetstream: {e}")
        monitors = ", :".join(str(self.nats.monitor_port[n]) for n in NODES)
        self.log(f"NATS JetStream cluster: {', '.join(self.nats.urls)} "
                 f"(monitoring :{monitors}"
                 f"; {self.nats.dir}); stream {STREAM} (3 replicas, made by "
                 f"the relays), durable {DURABLE} (--jetstream_ack_wait="
                 f"{ACK_WAIT})")
        super().setup()
        n = self.nats.wait_leader("stream", 30)
        c = self.nats.wait_leader("consumer", 30)
        if n is None or c is None:
            raise HarnessError(f"jetstream: no leader for stream {STREAM} or "
                               f"durable {DURABLE} 30 s after the services "
                               "started: " + " | ".join(self.nats.describe()))
        self.log(f"stream {STREAM} led by n{n}, durable {DURABLE} by n{c}"
                 + (f"; a proxy per {{relay, consumer}} -> node link "
                    f"({len(self.js_proxies) * len(NODES)})"
                    if self.js_proxies else ""))

    def _proc(self, kind, i, extra_args, name=None, db=None):
        if kind in ("relay", "consumer") and self.nats is not None:
            extra_args = list(extra_args) + self.js_flags(
                kind, name or f"{kind}-{i}")
        return super()._proc(kind, i, extra_args, name=name, db=db)

    def js_flags(self, kind, name):
        if self.scn.proxy_nats:
            proxies = [FaultProxy(self.suite.ploop, f"{name}->n{n}",
                                  self.nats.client_port[n],
                                  seed=self.rng.random()) for n in NODES]
            self.js_proxies[name] = proxies
            urls = [f"nats://127.0.0.1:{p.port}" for p in proxies]
        else:
            urls = self.nats.urls
        flags = [f"--jetstream={','.join(urls)}"]
        if kind == "consumer":
            flags.append(f"--jetstream_ack_wait={ACK_WAIT}")
        return flags

    def all_js_proxies(self):
        return [p for ps in self.js_proxies.values() for p in ps]

    def heal(self):
        self.heal_nats()
        super().heal()

    def heal_nats(self):
        """Every proxy to pass, every paused node SIGCONT, every node down
        started again; then until the stream has a leader with both other
        replicas current and the durable a leader."""
        for p in self.all_js_proxies():
            p.set_pass()
        try:
            for n in sorted(self.nats.paused):
                self.nats.resume(n)
                self.log(f"heal: resumed NATS node n{n} (SIGCONT)")
            for n in sorted(self.nats.down):
                pid = self.nats.restart(n)
                self.log(f"heal: restarted NATS node n{n} (pid {pid})")
        except NatsError as e:
            raise HarnessError(f"jetstream: heal: {e}")
        t = time.monotonic()
        why = self.nats.healthy()
        while why and time.monotonic() - t < CLUSTER_HEAL:
            time.sleep(0.25)
            why = self.nats.healthy()
        if why:
            raise HarnessError(
                f"jetstream: the cluster did not heal within "
                f"{CLUSTER_HEAL:g}s ({why}): " + " | ".join(
                    self.nats.describe()))
        self.log(f"NATS healed in {time.monotonic() - t:.1f}s: stream "
                 f"{STREAM} led by n{self.nats.stream_leader()[0]}, replicas "
                 "current, proxies passing")

    def verify(self):
        drained = self.js_drain()
        if drained:
            super().verify()
        else:
            # The bound is spent already: the checker reports what it
            # finds now instead of waiting as long again.
            saved = self.suite.verify_wait
            self.suite.verify_wait = 0
            try:
                super().verify()
            finally:
                self.suite.verify_wait = saved
        # the backlog when the faults stopped, not after the drain above
        self.backlog = self.js["backlog_at_drain"]["outbox"]
        rep = self.report
        if rep is not None and self.js_drain_seconds is not None:
            # I5 is the whole drain: through the stream and then the
            # checker's own wait.
            rep["drain_seconds"] = rep["drain_seconds"] + self.js_drain_seconds

    def js_pending(self):
        # Every event the relays still owe the stream: a relay killed
        # mid-batch leaves the log behind, with no delivery row to count.
        return self.owed()[0]

    def js_drain(self):
        """Until the relays owe nothing and the durable consumer has
        nothing undelivered or unacknowledged (twice in a row, 0.5 s
        apart), within the I5 bound: 120 s plus 1 s per 1000 events
        pending (in the outbox or the stream) when it starts."""
        t = time.monotonic()
        pending = self.js_pending()
        _, c = self.nats.consumer_leader()
        in_stream = ((c or {}).get("num_pending") or 0) + (
            (c or {}).get("num_ack_pending") or 0)
        wait = self.suite.verify_wait
        if wait is None:
            wait = 120 + (pending + in_stream) // 1000
        self.js["backlog_at_drain"] = {"outbox": pending, "stream": in_stream}
        self.log(f"draining through JetStream: {pending} events pending in "
                 f"the outbox, {in_stream} in the stream not yet "
                 f"acknowledged (bound {wait}s)", quiet=True)
        stable = 0
        last = None
        drained = False
        while True:
            pend = self.js_pending()
            _, c = self.nats.consumer_leader()
            last = (pend, c)
            if (pend == 0 and c is not None and c.get("num_pending") == 0
                    and c.get("num_ack_pending") == 0):
                stable += 1
                if stable >= 2:
                    drained = True
                    break
            else:
                stable = 0
            if time.monotonic() - t > wait:
                self.violations.append(
                    f"I5 liveness: not drained through JetStream within "
                    f"{wait}s after the faults stopped ({pend} pending in the "
                    "outbox; durable " + (
                        f"num_pending {c.get('num_pending')}, "
                        f"num_ack_pending {c.get('num_ack_pending')}"
                        if c is not None else "without a leader") + ")")
                break
            time.sleep(0.5)
        self.js_drain_seconds = time.monotonic() - t
        pend, c = last
        self.js["drain_seconds"] = round(self.js_drain_seconds, 1)
        self.log(("JetStream drained" if drained else "JetStream NOT drained")
                 + f" in {self.js_drain_seconds:.1f}s" + (
            f": durable delivered stream seq "
            f"{(c.get('delivered') or {}).get('stream_seq')}" if c else ""))
        return drained

    def collect_evidence(self):
        text = super().collect_evidence()
        parts = ["-- NATS JetStream cluster (each node's view)"]
        try:
            parts += self.nats.describe()
        except Exception as e:
            parts.append(f"(failed: {e})")
        for n in NODES:
            if n in self.nats.up():
                view = self.nats.jsz(n, timeout=3)
                if view is not None:
                    with open(os.path.join(self.workdir,
                                           f"jsz-n{n}.json"), "w") as f:
                        json.dump(view, f, indent=1)
        if self.js_proxies:
            parts.append("-- JetStream fault proxies: " + ", ".join(
                f"{p.name} {p.connections()} open/{p.accepted} accepted/"
                f"{p.resets} reset" for p in self.all_js_proxies()))
        text += "\n" + "\n".join(parts)
        with open(os.path.join(self.workdir, "evidence.txt"), "w") as f:
            f.write(text)
        return text

    def _finish(self, started, verified):
        try:
            super()._finish(started, verified)
        finally:
            for p in self.all_js_proxies():
                p.close()
            if self.nats is not None:
                self.nats.stop()
                if os.path.isdir(self.workdir):
                    self.nats.keep_logs(self.workdir)
                self.nats.remove()

    def result(self):
        r = super().result()
        r["notes"] = r["notes"] + self.js_notes
        r["jetstream"] = self.js
        return r

    # -- faults on the cluster ----------------------------------------------

    def note(self, text):
        self.js_notes.append(text)
        self.log(text)

    def leader(self, what="stream", timeout=3.0):
        n = self.nats.wait_leader(what, timeout)
        if what == "stream" and n is not None:
            self.leaders_seen.append(f"n{n}")
        return n

    def node_kill(self, n, why=""):
        try:
            pid = self.nats.kill(n)
        except NatsError as e:
            raise HarnessError(f"jetstream: {e}")
        self.faults += 1
        self.log(f"killed NATS node n{n} (pid {pid}, SIGKILL){why}")

    def node_term(self, n, why=""):
        t = time.monotonic()
        try:
            pid = self.nats.term(n)
        except NatsError as e:
            raise HarnessError(f"jetstream: {e}")
        self.faults += 1
        self.log(f"stopped NATS node n{n} (pid {pid}, SIGTERM){why}; down "
                 f"after {time.monotonic() - t:.1f}s")

    def node_restart(self, n):
        try:
            pid = self.nats.restart(n)
        except NatsError as e:
            raise HarnessError(f"jetstream: {e}")
        self.log(f"restarted NATS node n{n} (pid {pid})")

    def node_pause(self, n, seconds, why=""):
        try:
            pid = self.nats.pause(n)
            self.faults += 1
            self.log(f"paused NATS node n{n} (pid {pid}, SIGSTOP) for "
                     f"{seconds:.1f}s{why}")
            self.hold(seconds)
        finally:
            try:
                self.nats.resume(n)
            except NatsError as e:
                raise HarnessError(f"jetstream: {e}")
        self.log(f"resumed NATS node n{n} (SIGCONT)")

    def wait_current(self, n, timeout=CATCH_UP):
        """Until node n is a current replica of the stream again; the
        seconds it took, or None."""
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            if self.nats.current(n):
                return time.monotonic() - t
            time.sleep(0.2)
        return None


# -- injectors ---------------------------------------------------------------


def kill_leaders(run):
    """SIGKILL the stream's leader (1 in 3 times the durable consumer's
    leader) 1-2 s after a leader is there (a 2.9 cluster elects a new one
    4-9 s after its leader died: its Raft election timeout), kept down
    0.5-2 s, then started again (same ports and data); never a second node
    while one is down. At least LEADER_KILLS however short the window (the
    last may end up to LEADER_OVERRUN s after it; the load runs that much
    longer, so every kill lands under load)."""
    kills = 0
    until = run.deadline + LEADER_OVERRUN
    while True:
        if not run.sleep(run.rng.uniform(1.0, 2.0)):
            if kills >= LEADER_KILLS or time.monotonic() > until:
                break
        what = "consumer" if run.rng.random() < 1 / 3 else "stream"
        n = run.leader(what, timeout=max(1.0, min(LEADER_WAIT, until -
                                                  time.monotonic())))
        if n is None:
            run.log(f"no {what} leader within {LEADER_WAIT:g}s; no kill "
                    "this time")
            continue
        down = run.rng.uniform(0.5, 2.0)
        t = time.monotonic()
        run.node_kill(n, f", the {STREAM if what == 'stream' else DURABLE} "
                         f"leader; restart in {down:.1f}s")
        kills += 1
        run.hold(down)
        run.node_restart(n)
        new = run.leader(what, timeout=LEADER_WAIT)
        run.log(f"{what} leader n{new} {time.monotonic() - t:.1f}s after the "
                "kill" if new is not None else
                f"no {what} leader {time.monotonic() - t:.1f}s after the kill")
    if kills < LEADER_KILLS:
        raise HarnessError(f"js-leader-kill: only {kills} leader kills (of "
                           f"{LEADER_KILLS}) in the window and "
                           f"{LEADER_OVERRUN:g}s more: no leader to kill")


def rolling_restarts(run):
    """A rolling restart, as an operator does one: each node in turn (a
    seeded order) gets SIGTERM, stays down 0.3-1.5 s, is started again,
    and the next waits until it is a current replica again (at most
    CATCH_UP s) and 0.5-1.5 s more. At least one full round, however short
    the window (it may end up to RESTART_OVERRUN s after it)."""
    order = run.rng.sample(list(NODES), len(NODES))
    i = 0
    until = run.deadline + RESTART_OVERRUN
    while run.sleep(run.rng.uniform(0.5, 1.5)) or (
            i < len(NODES) and time.monotonic() < until):
        n = order[i % len(order)]
        i += 1
        leader = run.leader("stream", timeout=1.0)
        run.node_term(n, ", the stream leader" if leader == n else "")
        run.hold(run.rng.uniform(0.3, 1.5))
        run.node_restart(n)
        took = run.wait_current(n)
        run.log(f"n{n} current again after {took:.1f}s" if took is not None
                else f"n{n} not a current replica {CATCH_UP:g}s after its "
                     "restart; going on")
    if i < len(NODES):
        run.log(f"rolling restart: only {i} of {len(NODES)} nodes restarted "
                f"in the window and {RESTART_OVERRUN:g}s more")


def net_cuts(run):
    """The relays' and consumers' links to the cluster, through a proxy
    per (process, node): every 0.5-1.5 s one process's three links (it is
    cut off from the cluster), one node's links from every process (a
    node unreachable for its clients, still in the cluster) or all of them
    get a cut (RST on every connection, new ones refused for 1-3 s), a
    blackhole (2-8 s: past ~6 s the clients' pings, every 2 s with 2
    outstanding, give up on the silent server; below, only their requests
    wait) or latency (20-200 ms for 1-3 s). At least one cut and one
    blackhole, however short the window (the last may end up to
    NET_OVERRUN s after it; the load runs that much longer)."""
    names = sorted(run.js_proxies)
    owed = run.rng.sample(["cut", "blackhole"], 2)
    while run.sleep(run.rng.uniform(0.5, 1.5)) or owed:
        scope = run.rng.choices(["process", "node", "all"], [5, 3, 2])[0]
        if scope == "process":
            targets = list(run.js_proxies[run.rng.choice(names)])
        elif scope == "node":
            # a node some client is connected to (a client talks to one
            # node at a time): it becomes unreachable for its clients
            used = [m for m in NODES if any(
                run.js_proxies[name][m - 1].connections() for name in names)]
            n = run.rng.choice(used or list(NODES))
            targets = [run.js_proxies[name][n - 1] for name in names]
        else:
            targets = run.all_js_proxies()
        if owed:
            action = owed.pop(0)
        else:
            action = run.rng.choices(["cut", "blackhole", "latency"],
                                     [4, 4, 2])[0]
        if action == "cut":
            flap = run.rng.uniform(1.0, 3.0)
            run.net_reset(targets, flap)
            run.hold(flap)
        elif action == "blackhole":
            run.net_blackhole(targets, run.rng.uniform(2.0, 8.0))
        else:
            run.net_latency(targets, run.rng.uniform(0.02, 0.05),
                            run.rng.uniform(0.1, 0.2),
                            run.rng.uniform(1.0, 3.0))


def kill_consumers(run):
    """SIGKILL a consumer (now and then both) every 1-2.5 s, kept down
    0-1.5 s: what it fetched and had not acknowledged comes again after
    --jetstream_ack_wait, to it or to the other."""
    while run.sleep(run.rng.uniform(1.0, 2.5)):
        if len(run.consumers) > 1 and run.rng.random() < 0.15:
            victims = list(run.consumers)
        else:
            victims = [run.rng.choice(run.consumers)]
        for v in victims:
            run.kill(v, signal.SIGKILL, run.rng.uniform(0.0, 1.5))


def pause_nodes(run):
    """SIGSTOP a node for 3-7 s (around the Raft election timeout, 4-9 s in
    2.9, and the clients' 2 x 2 s ping), then SIGCONT; 1-2 s apart. Half
    the time the stream's leader; at least one pause of the leader and one
    of a follower however short the window (the last may end up to
    PAUSE_OVERRUN s after it; the load runs that much longer)."""
    owed = run.rng.sample(["leader", "follower"], 2)
    until = run.deadline + PAUSE_OVERRUN
    while True:
        if not run.sleep(run.rng.uniform(1.0, 2.0)):
            if not owed or time.monotonic() > until:
                break
        seconds = run.rng.uniform(3.0, 7.0)
        if owed:
            whom = owed.pop(0)
        else:
            whom = "leader" if run.rng.random() < 0.5 else "any"
        leader = run.leader("stream")
        if whom == "leader" and leader is not None:
            n, why = leader, ", the stream leader"
        elif whom == "follower" and leader is not None:
            n = run.rng.choice([m for m in NODES if m != leader])
            why = f", a follower (leader n{leader})"
        else:
            n = run.rng.choice(NODES)
            why = ", the stream leader" if n == leader else ""
        run.node_pause(n, seconds, why)
        new = run.leader("stream", timeout=1.0)
        if leader is not None and new is not None and new != leader:
            run.log(f"stream leader moved n{leader} -> n{new}")


# -- the check ---------------------------------------------------------------


def check_stream(run, report):
    """The broker's own: the stream holds exactly one message per committed
    event (no event published twice, none missing), and the notes say
    what the cluster went through."""
    # After the heal each process must say SERVING again by itself (the
    # relays' readiness follows their link to the stream).
    bad = [f"health: {name} still {status} {bound:g}s after the heal"
           for name, status, bound in run.gray.after_heal]
    _, s = run.nats.stream_leader()
    _, c = run.nats.consumer_leader()
    if s is None:
        return bad + [f"jetstream: stream {STREAM} has no leader after the "
                      "drain"]
    st = s.get("state") or {}
    msgs = st.get("messages")
    run.js["stream"] = {"messages": msgs, "first_seq": st.get("first_seq"),
                        "last_seq": st.get("last_seq")}
    if c is not None:
        run.js["durable"] = {k: c.get(k) for k in (
            "delivered", "ack_floor", "num_pending", "num_ack_pending",
            "num_redelivered")}
    if msgs != report["events"]:
        bad.append(f"jetstream: stream {STREAM} holds {msgs} messages for "
                   f"{report['events']} committed events (each must be in it "
                   "exactly once)")
    leaders = sorted(set(run.leaders_seen))
    # the durable's consumer_seq counts every delivery, redeliveries too;
    # its stream_seq is the newest message delivered (it reads it all)
    delivered = (c or {}).get("delivered") or {}
    deliveries = delivered.get("consumer_seq")
    firsts = delivered.get("stream_seq")
    run.note(f"stream {STREAM}: {msgs} messages for {report['events']} "
             "events" + (f"; durable {DURABLE} delivered {deliveries} times "
                         f"({deliveries - firsts} redeliveries)"
                         if isinstance(deliveries, int)
                         and isinstance(firsts, int) else "")
             + (f"; stream leaders seen: {', '.join(leaders)}" if leaders
                else "")
             + f"; drained through the stream in {run.js_drain_seconds:.1f}s")
    return bad


def check_proxies(run, report):
    """js-net-cut: every link ran through its proxy (a client that went
    around it would make the cut prove nothing)."""
    bad = check_stream(run, report)
    unused = [p.name for p in run.all_js_proxies() if p.accepted == 0]
    if len(unused) == len(run.all_js_proxies()):
        bad.append("js-net-cut: no connection went through the NATS proxies")
    # Every client connection a node has must be one of the proxies'
    # (the nodes run with --no_advertise): a few looks, as a connection
    # may be opening or closing at the moment of one.
    for _ in range(5):
        direct = run.nats.client_connections()
        proxied = sum(p.connections() for p in run.all_js_proxies())
        if direct is not None and direct <= proxied:
            break
        time.sleep(0.5)
    else:
        bad.append(f"js-net-cut: the nodes have {direct} client connections, "
                   f"the proxies {proxied}: a client reached the cluster "
                   "around its proxies")
    resets = sum(p.resets for p in run.all_js_proxies())
    run.note(f"NATS links: {sum(p.accepted for p in run.all_js_proxies())} "
             f"connections through {len(run.all_js_proxies())} proxies, "
             f"{resets} reset" + (f"; never used: {', '.join(unused)}"
                                  if unused else ""))
    return bad


# Longer than a client with libnats's old default of 120 reconnects every
# 250 ms (about 30 s) would wait before closing its connection for good.
OUTAGE_S = 35.0


def whole_cluster_down(run):
    """Every node SIGKILLed 2 s into the load, all restarted OUTAGE_S later
    (same ports, same data): the outbox keeps taking orders meanwhile, and
    relays and consumers must reconnect and catch up by themselves."""
    run.sleep(2.0)
    for n in NODES:
        run.node_kill(n, " (the whole cluster down)")
    run.log(f"the whole cluster down for {OUTAGE_S:g}s")
    run.hold(OUTAGE_S)
    for n in NODES:
        run.node_restart(n)
    while run.sleep(0.5):
        pass


SCENARIOS = [
    JetStreamScenario(
        "js-leader-kill",
        "relays publish to a 3-node JetStream cluster, the consumer reads a "
        "durable; SIGKILL the stream's leader (1 in 3: the durable's) 1-2 s "
        f"after one is elected, restarted 0.5-2 s later; at least "
        f"{LEADER_KILLS}",
        kill_leaders, relays=2, check=check_stream,
        load_extra=LEADER_OVERRUN),
    JetStreamScenario(
        "js-node-restart",
        "JetStream: a rolling restart of the NATS nodes (SIGTERM, down "
        "0.3-1.5 s, started again, the next once it is a current replica); "
        "at least one full round",
        rolling_restarts, relays=2, check=check_stream, load_extra=5.0),
    JetStreamScenario(
        "js-net-cut",
        "JetStream: every relay->node and consumer->node link through a "
        "proxy; one process's links, one node's or all cut (RST, refused "
        "1-3 s), blackholed 2-8 s or slowed; 2 relays, 2 consumers",
        net_cuts, relays=2, consumers=2, proxy_nats=True,
        check=check_proxies, load_extra=NET_OVERRUN),
    JetStreamScenario(
        "js-relay-kill",
        "JetStream: SIGKILL relays at random moments (now and then SIGTERM, "
        "or SIGSTOP for 1-3 s); 2 relays share the subscription",
        kill_relays, relays=2, check=check_stream),
    JetStreamScenario(
        "js-consumer-kill",
        "JetStream: SIGKILL consumers at random moments (now and then both); "
        "2 consumers share the durable",
        kill_consumers, consumers=2, check=check_stream),
    JetStreamScenario(
        "js-pause",
        "JetStream: SIGSTOP a NATS node (half the time the stream's leader) "
        "for 3-7 s, then SIGCONT; at least one leader and one follower",
        pause_nodes, relays=2, check=check_stream,
        load_extra=PAUSE_OVERRUN),
    JetStreamScenario(
        "js-outage",
        f"JetStream: all 3 nodes SIGKILLed for {OUTAGE_S:g}s under load, "
        "then restarted; relays and consumers reconnect by themselves",
        whole_cluster_down, relays=2, check=check_stream,
        load_extra=OUTAGE_S + 5.0),
]
