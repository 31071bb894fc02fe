"""One scenario end to end: fresh databases, the real processes, the
client load, the faults, the heal, the checker, and the evidence when an
invariant breaks."""

import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback

from . import procs as P
from .fanout import AuditSubscription
from .gray import GrayFaults
from .observe import Sampler
from .pg import SqlError
from .proxy import FaultProxy
from .scenarios import ACK_TIMEOUT, AFTER_HEAL
from .tls import HARNESS, LOAD, Certs, TlsError

UUID_RE = re.compile(
    r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
LOAD_ORDERS_RE = re.compile(
    r"orders created (\d+), paid (\d+), cancelled (\d+)")
LOAD_CALLS_RE = re.compile(
    r"calls (\d+), retries (\d+), indeterminate outcomes (\d+), "
    r"operations given up (\d+)")
SHUTDOWN_TIMEOUT = 2.0  # --shutdown_timeout of every service


class HarnessError(Exception):
    """The harness could not run the scenario (not a product violation)."""


def _proc_start(pid):
    """The process's start time (clock ticks since boot); None once it has
    ended or is a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return fields[19]


class PortPool:
    """Free ports on 127.0.0.1 below the ephemeral range, leased to this
    process machine-wide as scripts/lib/ports.sh does: a file
    OUTBOX_PORT_LEASES/PORT names the owner (pid and start time), and no
    picker of this project takes a port whose owner still runs. So a node
    stopped on purpose comes back on its ports even while other tests pick
    theirs."""

    def __init__(self):
        self.rng = random.Random()  # not the scenario's: ports are no fault
        self.dir = os.environ.get("OUTBOX_PORT_LEASES",
                                  "/tmp/outbox-port-leases")
        self.owner = f"{os.getpid()} {_proc_start(os.getpid())}\n"

    def _held(self, path):
        try:
            with open(path) as f:
                pid, start = f.read().split()
        except (OSError, ValueError):
            return False
        return _proc_start(pid) == start

    def _lease(self, tmp, port):
        path = os.path.join(self.dir, str(port))
        try:
            os.link(tmp, path)  # appears whole, or fails if the lease exists
            return True
        except FileExistsError:
            if self._held(path):
                return False
        try:
            os.unlink(path)
            os.link(tmp, path)
            return True
        except OSError:
            return False

    @staticmethod
    def _range():
        narrowed = os.environ.get("OUTBOX_PORT_RANGE", "").split()
        if len(narrowed) == 2:
            return int(narrowed[0]), int(narrowed[1])
        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
                high = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            high = 32768
        return 20000, high if high > 21000 else 32768

    def take(self):
        if not os.path.isdir(self.dir):
            os.makedirs(self.dir, exist_ok=True)
            try:
                os.chmod(self.dir, 0o1777)
            except OSError:
                pass
        tmp = os.path.join(self.dir, f".new.{os.getpid()}.{self.rng.random()}")
        with open(tmp, "w") as f:
            f.write(self.owner)
        low, high = self._range()
        try:
            # From a random port on, each port of the range at most once.
            first = self.rng.randrange(low, high)
            for i in range(min(high - low, 3000)):
                port = low + (first - low + i) % (high - low)
                if not self._lease(tmp, port):
                    continue
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    # something outside the leases holds it
                    os.unlink(os.path.join(self.dir, str(port)))
                    continue
                finally:
                    s.close()
                return port
        finally:
            os.unlink(tmp)
        raise HarnessError("no free port on 127.0.0.1")


class Run:
    """The context a scenario's injector works with."""

    def __init__(self, suite, scenario, seconds, seed, index):
        self.suite = suite
        self.scn = scenario
        self.name = scenario.name
        self.seconds = seconds
        self.seed = seed
        self.rng = random.Random(f"{scenario.name}/{seed}")
        self.t0 = time.monotonic()
        self.deadline = None
        self.workdir = tempfile.mkdtemp(prefix=f"outbox-chaos-{self.name}.")
        self._timeline = open(os.path.join(self.workdir, "timeline.log"), "a")
        safe = self.name.replace("-", "_")
        self.orders_db = f"chaos{index}_{safe}_orders"
        self.billing_db = f"chaos{index}_{safe}_billing"
        # fan-out: a second subscription, "audit", with relays, a consumer
        # (--handler=audit) and a database of its own (chaoslib/fanout.py)
        self.audit = (AuditSubscription(self, f"chaos{index}_{safe}_audit")
                      if scenario.audit_relays else None)
        self.verify_started = None  # monotonic, when the checker started
        # Restarts are bounded too: plenty for the crash points' rate.
        self.sup = P.Supervisor(self, delay=0.5,
                                max_restarts=int(2000 + 20 * seconds))
        self.producers, self.relays, self.consumers = [], [], []
        self.rc_proxies, self.db_proxies = [], []
        self.loads = []
        self.sampler = None
        self.faults = 0
        self.poisoned = None
        self.i6 = "-"
        self.violations = []
        self.errors = []
        self.notes = []
        self.report = None
        self.backlog = None  # pending rows when the checker starts
        self.wait = None     # how long the checker may wait for the drain
        self.load = {}
        self.hung = []
        self._ready_cache = set()
        self.gray = GrayFaults(self)
        self.certs = None  # chaoslib.tls.Certs under mutual TLS, else None
        self._buf = None
        self.counts = {"ack timeouts": 0, "streams lost": 0}  # log_counts()
        self.health_counts = {}  # health_log_counts()

    # -- output -------------------------------------------------------------

    def t(self):
        return time.monotonic() - self.t0

    def log(self, msg, quiet=False):
        line = f"[{self.name}] t={self.t():.1f}s {msg}"
        with self.suite.print_lock:
            self._timeline.write(line + "\n")
            self._timeline.flush()
            if not quiet or self.suite.verbose:
                print(line, flush=True)

    # -- building blocks for injectors ----------------------------------------

    def remaining(self):
        return self.deadline - time.monotonic()

    def sleep(self, seconds):
        """Sleeps; False once the fault window is over (then it sleeps only
        until the window's end)."""
        left = self.remaining()
        if left <= 0:
            return False
        if seconds >= left:
            time.sleep(left)
            return False
        time.sleep(seconds)
        return True

    def hold(self, seconds):
        """Keeps a fault in place for `seconds` (it may outlast the window by
        that much; the heal follows right after)."""
        time.sleep(max(0.0, seconds))

    def samplers(self):
        return [s for s in (self.sampler,
                            self.audit.sampler if self.audit else None)
                if s is not None]

    def kill(self, proc, sig=signal.SIGKILL, down=0.0):
        for s in self.samplers():
            if proc in s.consumers:
                s.scrape_consumer(proc)  # its last counts
        pid = self.sup.kill(proc, sig, down)
        if pid is None:
            self.log(f"{proc.name} is down already; no {signal.Signals(sig).name}",
                     quiet=True)
            return
        self.faults += 1
        verb = "killed" if sig == signal.SIGKILL else "terminated (SIGTERM)"
        self.log(f"{verb} {proc.name} (pid {pid}); restart in "
                 f"{max(down, self.sup.delay):.1f}s")

    def pause(self, proc, seconds):
        pid = self.sup.pause(proc)
        if pid is None:
            return
        self.faults += 1
        self.log(f"paused {proc.name} (pid {pid}, SIGSTOP) for {seconds:.1f}s")
        self.hold(seconds)
        self.sup.resume(proc)
        self.log(f"resumed {proc.name} (pid {pid}, SIGCONT)")

    def pg_restart(self):
        t = time.monotonic()
        ok, out = self.suite.pg.restart_immediate()
        self.faults += 1
        self.log(f"pg_ctl restart -m immediate: {'done' if ok else 'FAILED'} "
                 f"in {time.monotonic() - t:.1f}s")
        if not ok:
            raise HarnessError(f"pg_ctl restart failed: {out[-500:]}")

    def _names(self, proxies):
        return ", ".join(p.name for p in proxies)

    def net_latency(self, proxies, lo, hi, seconds):
        for p in proxies:
            p.set_latency(lo, hi)
        self.faults += 1
        self.log(f"latency {lo * 1000:.0f}-{hi * 1000:.0f} ms on "
                 f"{self._names(proxies)} for {seconds:.1f}s")
        self.hold(seconds)
        for p in proxies:
            p.set_pass()

    def net_reset(self, proxies, flap):
        n = sum(p.reset(flap) for p in proxies)
        self.faults += 1
        self.log(f"reset (RST) {n} connections on {self._names(proxies)}"
                 + (f", and new ones for {flap:.1f}s" if flap else ""))

    def net_blackhole(self, proxies, seconds):
        for p in proxies:
            p.set_blackhole()
        self.faults += 1
        self.log(f"blackhole on {self._names(proxies)} for {seconds:.1f}s")
        self.hold(seconds)
        for p in proxies:
            p.set_pass()
        self.log(f"blackhole over on {self._names(proxies)}", quiet=True)

    def pg_of(self, db):
        """The server that holds database `db` now: the suite's, unless a
        topology scenario put it on servers of its own
        (chaoslib/topology_scenarios.py)."""
        return self.suite.pg

    def sql_orders(self, sql, timeout=30):
        return self.pg_of(self.orders_db).psql(self.orders_db, sql,
                                               timeout=timeout)

    def sql_billing(self, sql, timeout=30):
        return self.pg_of(self.billing_db).psql(self.billing_db, sql,
                                                timeout=timeout)

    POISON_UPDATE = (
        "UPDATE outbox SET schema_version = 2 WHERE seq = (SELECT min(o.seq) "
        "FROM outbox_delivery d JOIN outbox o USING (seq) WHERE d.status = "
        "'pending' AND o.event_type = 'OrderCreated') AND EXISTS (SELECT 1 "
        "FROM outbox_delivery d WHERE d.seq = outbox.seq AND d.status = "
        "'pending') RETURNING seq, aggregate_id")

    # Poisons the next OrderCreated row as it is inserted, in the producer's
    # own transaction: committed poison that no relay can have sent before.
    POISON_TRIGGER = """
CREATE TABLE chaos_poison (id int PRIMARY KEY, armed bool NOT NULL,
                           seq bigint, aggregate_id text);
INSERT INTO chaos_poison VALUES (1, true, NULL, NULL);
CREATE FUNCTION chaos_poison_next() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.event_type = 'OrderCreated' THEN
    UPDATE chaos_poison SET armed = false, seq = NEW.seq,
           aggregate_id = NEW.aggregate_id WHERE id = 1 AND armed;
    IF FOUND THEN NEW.schema_version := 2; END IF;
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER chaos_poison BEFORE INSERT ON outbox
  FOR EACH ROW EXECUTE FUNCTION chaos_poison_next();
"""

    def _poison_fate(self, seq, agg):
        """Waits until poisoned row `seq` is no longer pending; True when it
        became the dead letter."""
        status = "pending"
        wait_until = time.monotonic() + 15
        while time.monotonic() < wait_until:
            status = self.sql_orders(
                f"SELECT status FROM outbox_deliveries WHERE subscription = "
                f"'billing' AND seq = {seq}").strip()
            if status != "pending":
                break
            time.sleep(0.1)
        if status == "delivered":
            self.log(f"row {seq} had been sent with schema_version 1 before "
                     "the update and was delivered (not poison after all)")
            return False
        self.poisoned = (seq, agg)
        attempts = self.sql_orders(
            f"SELECT attempts FROM outbox_deliveries WHERE subscription = "
            f"'billing' AND seq = {seq}").strip()
        self.log(f"row {seq} of {agg} is {status} after {attempts} attempts")
        return True

    def poison(self, update_tries=5):
        """Makes one committed OrderCreated event poison (schema_version 2)
        and waits for its fate. First as an operator would, with an UPDATE
        of the oldest pending OrderCreated row; but a relay that keeps up
        has usually sent that row already (its copy says version 1, so it
        is applied and marked delivered anyway). After `update_tries` such
        races (or 3 s), an insert trigger poisons the next OrderCreated row
        inside the producer's transaction instead."""
        hits = 0
        # Rows only come while the load runs: the UPDATEs get a few seconds,
        # leaving the trigger most of the window.
        now = time.monotonic()
        updates_until = min(now + 3.0, self.deadline - 2.0)
        give_up = max(self.deadline + 5.0, now + 10.0)
        while hits < update_tries and time.monotonic() < updates_until:
            try:
                out = self.sql_orders(self.POISON_UPDATE).strip()
            except SqlError as e:
                self.log(f"poison: {e}; retrying", quiet=True)
                out = ""
            if not out:
                time.sleep(0.05)
                continue
            seq_s, agg = out.splitlines()[0].split("|")
            hits += 1
            self.log(f"poisoned row {seq_s} (OrderCreated of {agg}) by UPDATE")
            if self._poison_fate(int(seq_s), agg):
                self.faults += 1
                return
        self.log(f"the relay outran {hits} UPDATE(s): poisoning the next "
                 "OrderCreated at insert, in the producer's transaction")
        self.sql_orders(self.POISON_TRIGGER)
        while time.monotonic() < give_up:
            out = self.sql_orders(
                "SELECT p.seq, p.aggregate_id FROM chaos_poison p JOIN outbox "
                "o USING (seq) WHERE NOT p.armed").strip()
            if out:
                seq_s, agg = out.split("|")
                self.log(f"poisoned row {seq_s} (OrderCreated of {agg}) at "
                         "insert")
                if self._poison_fate(int(seq_s), agg):
                    self.faults += 1
                    return
                break
            time.sleep(0.1)
        raise HarnessError("poison: no committed OrderCreated row became "
                           "poison (is the load running?)")

    # -- the scenario ---------------------------------------------------------

    def _db_url(self, proc_name, db):
        pg = self.suite.pg
        if not self.scn.proxy_db:
            return pg.db_url(db)
        proxy = FaultProxy(self.suite.ploop, f"{proc_name}->postgres",
                           pg.port, seed=self.rng.random())
        self.db_proxies.append(proxy)
        return f"postgresql://postgres@127.0.0.1:{proxy.port}/{db}"

    def _proc(self, kind, i, extra_args, name=None, db=None):
        name = name or f"{kind}-{i}"
        port, mport = self.suite.ports.take(), self.suite.ports.take()
        if db is None:
            db = self.billing_db if kind == "consumer" else self.orders_db
        binary = os.path.join(self.suite.bin, f"outbox-{kind}")
        tls = self.certs.server_flags(kind) if self.certs else []
        argv = [binary, f"--listen=127.0.0.1:{port}",
                f"--db={self._db_url(name, db)}",
                f"--metrics_listen=127.0.0.1:{mport}",
                f"--shutdown_timeout={SHUTDOWN_TIMEOUT:g}s"] + tls + \
            extra_args + [
                f"--{k}={v}" for k, v in self.scn.service_flags.items()]
        # Each binary gets its own crash points only: it refuses a name that
        # is not one of its points at start-up (common/fault.h).
        own = ",".join(e for e in (self.scn.fault_env or "").split(",")
                       if e.startswith(f"{kind}."))
        env = {"OUTBOX_FAULT": own} if own else {}
        p = P.Proc(self, name, kind, argv, port, mport, env)
        self.sup.add(p)
        return p

    def relay_proc(self, i, target, name=None, extra_args=()):
        """Relay `name` (default relay-i) delivering to consumer `target`
        (through a fault proxy in the scenarios that have them)."""
        name = name or f"relay-{i}"
        port = target.listen_port
        if self.scn.proxy_relay_consumer:
            proxy = FaultProxy(self.suite.ploop, f"{name}->{target.name}",
                               port, seed=self.rng.random())
            self.rc_proxies.append(proxy)
            port = proxy.port
        flags = {"ack_timeout": f"{ACK_TIMEOUT:g}s",
                 "poll_interval": "200ms", "retry_max": "1s"}
        flags.update(self.scn.relay_flags)
        # Under TLS the relay checks that the consumer's certificate
        # names the host it dials: 127.0.0.1 is its IP SAN (through the
        # TCP-level proxy too, which passes the TLS session on).
        tls = self.certs.relay_client_flags() if self.certs else []
        return self._proc(
            "relay", i, [f"--consumer=127.0.0.1:{port}"] + tls +
            [f"--{k}={v}" for k, v in flags.items()] + list(extra_args),
            name=name)

    def setup(self):
        if self.suite.tls:
            # A CA of its own per scenario: a process left over from an
            # earlier scenario cannot talk to this one's.
            try:
                self.certs = Certs(self.suite.root, os.path.join(
                    self.workdir, "certs")).make()
            except TlsError as e:
                raise HarnessError(str(e))
        for db in (self.orders_db, self.billing_db):
            self.pg_of(db).drop_db(db)
            self.pg_of(db).create_db(db)
        scn = self.scn
        if scn.partition_span:
            self.partition_outbox(scn.partition_span)
        for i in range(1, scn.consumers + 1):
            self.consumers.append(self._proc("consumer", i, []))
        for i in range(1, scn.relays + 1):
            target = self.consumers[(i - 1) % len(self.consumers)
                                    if scn.pairs else 0]
            self.relays.append(self.relay_proc(i, target))
        if self.audit is not None:
            self.audit.setup()
        for i in range(1, scn.producers + 1):
            self.producers.append(self._proc("producer", i, []))
        topo = (f"{len(self.producers)} producer(s), {len(self.relays)} "
                f"relay(s), {len(self.consumers)} consumer(s)")
        if scn.pairs and len(self.consumers) > 1:
            topo += " (relay i -> consumer i)"
        if self.audit is not None:
            topo = "billing: " + topo + "; " + self.audit.describe()
        if self.rc_proxies:
            topo += ", a proxy per relay->consumer link"
        if self.db_proxies:
            topo += ", a proxy per service->PostgreSQL link"
        self.log(f"{scn.summary}")
        self.log(f"topology: {topo}; logs in {self.workdir}")
        self.log(self.certs.describe() if self.certs else
                 "plaintext (--plaintext): no TLS on any link", quiet=True)
        if scn.fault_env:
            self.log(f"OUTBOX_FAULT={scn.fault_env}")
        if scn.service_flags:
            self.log("every service runs with " + " ".join(
                f"--{k}={v}" for k, v in scn.service_flags.items()))
        self.sup.start()
        self.wait_ready(self.sup.procs, 60)
        self.log("all processes serving: " + ", ".join(
            f"{p.name}=:{p.listen_port}" for p in self.sup.procs))

    def partition_outbox(self, span):
        """outboxctl partition-outbox on the orders database (it applies the
        outbox's migrations first): children of `span` seqs, 8 ahead."""
        argv = [os.path.join(self.suite.bin, "outboxctl"), "partition-outbox",
                "--orders_db="
                + self.pg_of(self.orders_db).db_url(self.orders_db),
                f"--span={span}", "--ahead=8"]
        out = subprocess.run(argv, capture_output=True, text=True,
                             env=P.clean_env({}), timeout=60)
        if out.returncode != 0:
            raise HarnessError(f"outboxctl partition-outbox failed (rc "
                               f"{out.returncode}): {out.stderr.strip()}")
        self.log(out.stdout.strip())

    def buf(self):
        """buf (for `buf curl`): the platform's binary of the npm package
        when it runs (the node wrapper costs ~0.2 s a call), else the
        wrapper; None when not installed."""
        if self._buf is None:
            nm = os.path.join(self.suite.root, "tests", "deploy",
                              "node_modules")
            self._buf = ""
            for b in sorted(glob.glob(os.path.join(nm, "@bufbuild", "buf-*",
                                                   "bin", "buf"))):
                try:
                    subprocess.run([b, "--version"], capture_output=True,
                                   stdin=subprocess.DEVNULL, timeout=10,
                                   check=True)
                except (OSError, subprocess.SubprocessError):
                    continue
                self._buf = b
                break
            wrapper = os.path.join(nm, ".bin", "buf")
            if not self._buf and os.path.exists(wrapper):
                self._buf = wrapper
        return self._buf or None

    def health(self, port, timeout=3.0):
        """The grpc.health.v1 status of the server on `port` ("SERVING",
        "NOT_SERVING", ...), or None when it does not answer."""
        buf = self.buf()
        if buf is None:
            return None
        if self.certs:
            # mutual TLS on the port clients use, as the harness (health
            # answers any client whose certificate the CA signed)
            how = self.certs.buf_flags(HARNESS) + [
                f"https://127.0.0.1:{port}/grpc.health.v1.Health/Check"]
        else:
            how = ["--http2-prior-knowledge",
                   f"http://127.0.0.1:{port}/grpc.health.v1.Health/Check"]
        try:
            r = subprocess.run(
                [buf, "curl", "--protocol", "grpc",
                 "--timeout", f"{timeout:g}s"] + how,
                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=timeout + 7)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if r.returncode != 0:
            return None
        try:
            return json.loads(r.stdout or "{}").get("status", "UNKNOWN")
        except ValueError:
            return None

    def _healthy(self, port):
        if self.buf() is None:
            raise HarnessError("buf curl is missing: no process can be seen "
                               "SERVING (npm ci in tests/deploy)")
        return self.health(port) == "SERVING"

    def wait_serving(self, procs, timeout):
        """Polls the health of `procs` until each says SERVING; returns
        (proc, status) of those that still say something else (NOT_SERVING,
        or None: no answer) after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        left = list(procs)
        last = {}
        while left:
            for p in list(left):
                st = self.health(p.listen_port)
                last[p.name] = st
                if st == "SERVING":
                    left.remove(p)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        return [(p, last.get(p.name)) for p in left]

    def wait_ready(self, procs, timeout):
        """Until each process logged 'serving gRPC on' and its health check
        says SERVING (a crashing process is restarted meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = []
            for p in procs:
                key = (p.name, p.incarnation)
                if key in self._ready_cache and p.alive():
                    continue
                if (p.alive() and not p.paused
                        and P.READY_RE.search(p.log_since_start())
                        and self._healthy(p.listen_port)):
                    self._ready_cache.add(key)
                    continue
                waiting.append(p)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise HarnessError(
                    "not serving within %ds: %s" % (timeout, ", ".join(
                        f"{p.name} ({p.log_path})" for p in waiting)))
            time.sleep(0.2)

    def start_load(self):
        outboxctl = os.path.join(self.suite.bin, "outboxctl")
        for i, prod in enumerate(self.producers, 1):
            argv = [outboxctl, "load", f"--producer=127.0.0.1:{prod.listen_port}",
                    "--orders=1000000",
                    f"--duration={self.seconds + self.scn.load_extra:g}s",
                    "--concurrency=4", "--timeout=2s",
                    f"--seed={self.seed * 10 + i}"]
            if self.certs:
                argv += self.certs.ctl_flags(LOAD)
            out = open(os.path.join(self.workdir, f"load-{i}.out"), "wb")
            err = open(os.path.join(self.workdir, f"load-{i}.log"), "wb")
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=err, env=P.clean_env({}),
                                 start_new_session=True)
            out.close()
            err.close()
            P.track(p)
            self.loads.append((i, p))
            self.log(f"load-{i}: {' '.join(argv[1:])} (pid {p.pid})",
                     quiet=True)

    def heal(self):
        self.gray.restore()
        for proxy in self.rc_proxies + self.db_proxies:
            proxy.set_pass()
        armed = {}
        with self.sup.lock:
            if self.scn.fault_env:
                # Disarm the crash points: a clean restart of each binary.
                for p in self.sup.procs:
                    p.env.pop("OUTBOX_FAULT", None)
                    armed[p.name] = p.incarnation
                    if p.alive():
                        self.sup.kill(p, signal.SIGTERM)
            self.sup.heal()
        deadline = time.monotonic() + 60
        while armed and time.monotonic() < deadline:
            if all(p.incarnation > armed[p.name] for p in self.sup.procs):
                break
            time.sleep(0.1)
        procs = list(self.sup.procs)
        if self.scn.health_after_heal:
            if self.buf() is None:
                raise HarnessError("buf curl is missing: the after-heal "
                                   "SERVING check cannot run")
            # Gray faults leave every process up: each must say SERVING
            # again by itself once the database behaves.
            t = time.monotonic()
            for p, st in self.wait_serving(procs, AFTER_HEAL):
                if st is not None and p.alive() and not p.paused:
                    self.gray.after_heal.append((p.name, st, AFTER_HEAL))
                    procs.remove(p)
                    self.log(f"{p.name} still says {st} {AFTER_HEAL:g}s "
                             "after the heal")
            self.log(f"health after the heal: "
                     f"{len(procs)}/{len(self.sup.procs)} SERVING within "
                     f"{time.monotonic() - t:.1f}s", quiet=True)
        self.wait_ready(procs, 90)
        self.log("healed: every process serving"
                 + (" but " + ", ".join(n for n, _, _ in self.gray.after_heal)
                    if self.gray.after_heal else "") + ", proxies passing"
                 + (", crash points disarmed" if self.scn.fault_env else ""))

    def wait_load(self, timeout=150):
        deadline = time.monotonic() + timeout
        total = {k: 0 for k in ("created", "paid", "cancelled", "calls",
                                "retries", "indeterminate", "gave_up")}
        for i, p in self.loads:
            if not P.reap(p, max(0.1, deadline - time.monotonic())):
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                P.reap(p, 5)
                raise HarnessError(f"load-{i} still running {timeout}s after "
                                   "the faults stopped; killed it")
            with open(os.path.join(self.workdir, f"load-{i}.out")) as f:
                out = f.read()
            m1, m2 = LOAD_ORDERS_RE.search(out), LOAD_CALLS_RE.search(out)
            if m1 is None or m2 is None or p.returncode not in (0, 1):
                raise HarnessError(
                    f"load-{i} exited {P.signame(p.returncode)} without its "
                    f"summary: {out[-300:]!r}")
            for k, v in zip(("created", "paid", "cancelled"), m1.groups()):
                total[k] += int(v)
            for k, v in zip(("calls", "retries", "indeterminate", "gave_up"),
                            m2.groups()):
                total[k] += int(v)
        self.load = total
        self.log(f"load done: {total['created']} orders created, "
                 f"{total['paid']} paid, {total['cancelled']} cancelled; "
                 f"{total['calls']} calls, {total['retries']} retries, "
                 f"{total['indeterminate']} indeterminate, "
                 f"{total['gave_up']} given up")

    def owed(self):
        """(billing's, every subscription's) events still owed: delivery
        rows pending and events the outbox log has not passed yet, which
        have no delivery row. outbox_delivery alone misses the second."""
        out = self.sql_orders(
            "SELECT count(*) FILTER (WHERE subscription = 'billing'), "
            "count(*) FROM outbox_deliveries WHERE status = "
            "'pending'").strip().split("|")
        return int(out[0]), int(out[1])

    def run_checker(self, wait, saved_as):
        """outboxctl verify --wait=`wait`s: its JSON report, its whole
        output kept in the work directory as `saved_as`."""
        orders_url = self.pg_of(self.orders_db).db_url(self.orders_db)
        billing_url = self.pg_of(self.billing_db).db_url(self.billing_db)
        argv = [os.path.join(self.suite.bin, "outboxctl"), "verify",
                f"--orders_db={orders_url}", f"--billing_db={billing_url}",
                f"--wait={wait}s", "--format=json"]
        self.log(f"checking: outboxctl verify --wait={wait}s", quiet=True)
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL,
                               capture_output=True, text=True,
                               timeout=wait + 120)
        except subprocess.TimeoutExpired:
            raise HarnessError("outboxctl verify did not finish")
        with open(os.path.join(self.workdir, saved_as), "w") as f:
            f.write(r.stdout + r.stderr)
        line = next((ln for ln in reversed(r.stdout.splitlines())
                     if ln.startswith("{")), None)
        if line is None or r.returncode not in (0, 1):
            raise HarnessError(f"outboxctl verify failed (rc "
                               f"{r.returncode}): {r.stderr.strip()[-500:]}")
        return json.loads(line)

    def checker_violations(self, rep, wait):
        """What the checker's report `rep` breaks of I1-I6."""
        out = []
        if not rep["drained"]:
            out.append(
                f"I5 liveness: not drained within {wait}s after the faults "
                f"stopped ({rep['pending']} pending, {rep['held']} held)")
        for key, label in (("lost", "I1 lost events"),
                           ("missing_effects", "I1 missing effects"),
                           ("duplicate_effects", "I2 duplicate effects"),
                           ("order_violations", "I3 order violations"),
                           ("phantoms", "I4 phantoms"),
                           ("view_mismatches", "order view mismatches")):
            if rep[key]:
                out.append(f"{label}: {rep[key]}")
        if rep["dead_letters"] != self.scn.expect_dead:
            out.append(
                f"dead letters: {rep['dead_letters']} (expected "
                f"{self.scn.expect_dead}; transport faults never dead-letter)")
        return out

    def verify(self):
        pending = 0  # every subscription's (fan-out: audit's too)
        try:
            self.backlog, pending = self.owed()
        except (SqlError, ValueError, IndexError):
            self.backlog = None
        self.verify_started = time.monotonic()
        # The I5 bound. The client is not rate limited, so a long run can end
        # with a long backlog: 120 s, plus 1 s per 1000 events pending.
        wait = self.suite.verify_wait
        if wait is None:
            wait = 120 + pending // 1000
        self.wait = wait
        rep = self.run_checker(wait, "verify.json")
        self.report = rep
        self.violations += self.checker_violations(rep, wait)
        if self.scn.check is not None:
            self.violations += self.scn.check(self, rep)
        self.log(f"checked: {rep['events']} events, {rep['applied']} applied, "
                 f"backlog {self.backlog} drained in "
                 f"{rep['drain_seconds']:.1f}s, lost {rep['lost']}, "
                 f"duplicate effects {rep['duplicate_effects']}, order "
                 f"violations {rep['order_violations']}, phantoms "
                 f"{rep['phantoms']}, dead letters {rep['dead_letters']}")

    def sabotage(self):
        """Harness self-check (--sabotage): breaks the billing database the
        way a bug would, so the run must fail and show its evidence."""
        gone = self.sql_billing(
            "DELETE FROM charges WHERE event_id = (SELECT event_id FROM "
            "charges ORDER BY created_at LIMIT 1) RETURNING event_id, "
            "order_id").strip()
        self.sql_billing(
            "INSERT INTO inbox (event_id, aggregate_id, seq, event_type) "
            "VALUES (gen_random_uuid(), 'sabotage', 1, 'OrderCreated')")
        self.log(f"SABOTAGE: deleted the charge {gone} and inserted an inbox "
                 "row nobody committed")

    # -- evidence -------------------------------------------------------------

    def collect_evidence(self):
        """SQL state and admin stats while everything is still up, into
        evidence.txt (and CSV copies of the tables)."""
        parts = []

        def q(title, fn, sql):
            try:
                parts.append(f"-- {title}\n{fn(sql, 60)}")
            except Exception as e:
                parts.append(f"-- {title}\n(failed: {e})")

        q("outbox by status", self.sql_orders,
          "SELECT subscription, status, count(*), max(attempts) FROM "
          "outbox_deliveries GROUP BY 1, 2")
        q("oldest undelivered rows", self.sql_orders,
          "SELECT d.subscription, seq, o.aggregate_id, o.prev_seq, "
          "o.event_type, o.schema_version, d.status, d.attempts, o.partition, "
          "d.available_at, d.last_error FROM outbox o JOIN outbox_delivery d "
          "USING (seq) ORDER BY seq LIMIT 20")
        q("partitions owned, by lease (outbox_partition_leases)",
          self.sql_orders,
          "SELECT owner, count(*), array_agg(partition ORDER BY partition), "
          "min(expires_at) FILTER (WHERE isfinite(expires_at)) - now() AS "
          "expires_in, max(token) FROM "
          "outbox_partition_leases WHERE subscription = 'billing' GROUP BY 1 "
          "ORDER BY 1")
        q("divergences", self.sql_orders,
          "SELECT aggregate_id, kind, detected_at, resolved_at, detail FROM "
          "outbox_divergences ORDER BY id LIMIT 20")
        q("held events", self.sql_billing,
          "SELECT h.seq, h.prev_seq, h.aggregate_id, coalesce(c.last_seq, 0) "
          "AS cursor, h.received_at FROM held_events h LEFT JOIN "
          "aggregate_cursors c USING (aggregate_id) ORDER BY h.seq LIMIT 20")
        ids = sorted(set(UUID_RE.findall(" ".join(
            (self.report or {}).get("examples", [])))))[:10]
        if ids:
            lst = ",".join(f"'{i}'" for i in ids)
            q("outbox rows of the aggregates/events named by the checker",
              self.sql_orders,
              "SELECT seq, event_id, aggregate_id, event_type, status, "
              "attempts, created_at FROM outbox_deliveries WHERE "
              f"aggregate_id IN ({lst}) OR event_id::text IN ({lst}) OR "
              f"aggregate_id IN (SELECT aggregate_id FROM outbox WHERE "
              f"event_id::text IN ({lst})) ORDER BY aggregate_id, seq")
            q("inbox rows of the same", self.sql_billing,
              "SELECT apply_id, seq, event_id, aggregate_id, event_type, "
              f"applied_at FROM inbox WHERE aggregate_id IN ({lst}) OR "
              f"event_id::text IN ({lst}) ORDER BY aggregate_id, apply_id")
            q("charges of the same", self.sql_billing,
              "SELECT event_id, order_id, kind, amount_cents, created_at FROM "
              f"charges WHERE order_id IN ({lst}) OR event_id::text IN "
              f"({lst}) ORDER BY order_id, created_at")
        if self.audit is not None:
            parts += self.audit.evidence()
        outboxctl = os.path.join(self.suite.bin, "outboxctl")
        pairs = [(r, self.consumers[0]) for r in self.relays]
        if self.audit is not None:
            pairs += [(r, self.audit.consumer) for r in self.audit.relays]
        for r, c in pairs:
            try:
                tls = self.certs.ctl_flags(HARNESS) if self.certs else []
                out = subprocess.run(
                    [outboxctl, "stats", f"--relay=127.0.0.1:{r.listen_port}",
                     f"--consumer=127.0.0.1:{c.listen_port}",
                     "--timeout=3s"] + tls,
                    stdin=subprocess.DEVNULL, capture_output=True, text=True,
                    timeout=20)
                parts.append(f"-- outboxctl stats ({r.name})\n{out.stdout}"
                             f"{out.stderr}")
            except Exception as e:
                parts.append(f"-- outboxctl stats ({r.name}): {e}")
        for table, fn, sql in (
                ("outbox", self.sql_orders,
                 "SELECT o.seq, o.event_id, o.aggregate_id, o.prev_seq, "
                 "o.event_type, o.schema_version, v.subscription, v.status, "
                 "v.attempts, o.partition, o.created_at, v.last_error FROM "
                 "outbox o JOIN outbox_deliveries v USING (seq) ORDER BY seq"),
                ("inbox", self.sql_billing,
                 "SELECT * FROM inbox ORDER BY apply_id"),
                ("held_events", self.sql_billing,
                 "SELECT event_id, aggregate_id, seq, prev_seq, received_at "
                 "FROM held_events ORDER BY seq"),
                ("charges", self.sql_billing, "SELECT * FROM charges")):
            try:
                csv = fn(f"COPY ({sql}) TO STDOUT WITH CSV HEADER", 120)
                with open(os.path.join(self.workdir, f"{table}.csv"), "w") as f:
                    f.write(csv)
            except Exception:
                pass
        text = "\n".join(parts)
        with open(os.path.join(self.workdir, "evidence.txt"), "w") as f:
            f.write(text)
        return text

    def log_counts(self):
        """What the logs tell about the faults' reach."""
        pats = {
            "ack timeouts": "no answer within --ack_timeout",
            "streams lost": "delivery stream lost",
        }
        counts = {k: 0 for k in pats}
        for p in self.relays:
            try:
                with open(p.log_path, errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            for k, pat in pats.items():
                counts[k] += text.count(pat)
        return counts

    def health_log_counts(self):
        """How often each process logged that its health turned
        NOT_SERVING (its watchdog saw the work loop stall)."""
        out = {}
        for p in self.sup.procs:
            try:
                with open(p.log_path, errors="replace") as f:
                    n = f.read().count("health NOT_SERVING")
            except OSError:
                continue
            if n:
                out[p.name] = n
        return out

    # -- run it all -----------------------------------------------------------

    def execute(self):
        started = time.monotonic()
        verified = False
        try:
            self.setup()
            self.sampler = Sampler(self, self.consumers,
                                   self.pg_of(self.billing_db),
                                   self.billing_db)
            self.sampler.start()
            if self.audit is not None:
                self.audit.start_sampler()
            self.start_load()
            self.deadline = time.monotonic() + self.seconds
            self.log(f"load and faults for {self.seconds:g}s")
            self.scn.inject(self)
            self.log(f"faults stop ({self.faults} injected); healing")
            self.heal()
            self.wait_load()
            if self.suite.sabotage:
                self.sabotage()
            self.verify()
            verified = True
        except HarnessError as e:
            self.errors.append(str(e))
            self.log(f"HARNESS ERROR: {e}")
        except SqlError as e:
            self.errors.append(f"SQL: {e}")
            self.log(f"HARNESS ERROR: SQL: {e}")
        except (OSError, ValueError, RuntimeError) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
            self.log(f"HARNESS ERROR: {type(e).__name__}: {e}")
            with open(os.path.join(self.workdir, "traceback.txt"), "w") as f:
                traceback.print_exc(file=f)
        finally:
            self._finish(started, verified)
        return self.result()

    def _finish(self, started, verified):
        now = self.suite.stamp()
        if now != self.suite.bin_stamp:
            changed = [b for b in now if now[b] != self.suite.bin_stamp.get(b)]
            self.errors.append(
                f"build/bin changed during the scenario ({', '.join(changed)} "
                "rebuilt?): its result proves nothing; run it again")
            self.suite.bin_stamp = now
        with self.sup.lock:
            self.errors += [u for p in self.sup.procs for u in p.unexpected
                            if "restart limit" in u]
        try:
            self.gray.restore()  # after an exception too: the next scenario
        except Exception as e:  # and the checker need a sane server
            self.errors.append(f"could not undo the gray faults: {e}")
            self.log(f"HARNESS ERROR: could not undo the gray faults: {e}")
        failed = bool(self.violations or self.errors)
        evidence = ""
        for s in self.samplers():
            s.sample_once()
            s.stop()
        if failed and self.orders_db:
            try:
                evidence = self.collect_evidence()
            except Exception as e:
                evidence = f"(evidence collection failed: {e})"
        for i, p in self.loads:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            P.reap(p, 5)
        self.hung = self.sup.stop_all(SHUTDOWN_TIMEOUT + 6)
        for proxy in self.rc_proxies + self.db_proxies:
            proxy.close()
        for name in self.hung:
            self.notes.append(f"{name} ignored SIGTERM for "
                              f"{SHUTDOWN_TIMEOUT + 6:g}s")
        for p in self.sup.procs:
            self.notes += [f"unexpected exit: {u}" for u in p.unexpected
                           if "restart limit" not in u]
        self.wall = time.monotonic() - started
        # what the logs tell, read before a passing run's folder goes
        self.counts = self.log_counts()
        self.health_counts = self.health_log_counts()
        self._timeline.close()
        if failed:
            print(f"[{self.name}] FAILED; logs and evidence kept in "
                  f"{self.workdir}", flush=True)
            for v in self.violations:
                print(f"[{self.name}]   violation: {v}", flush=True)
            for e in self.errors:
                print(f"[{self.name}]   error: {e}", flush=True)
            for ex in (self.report or {}).get("examples", []):
                print(f"[{self.name}]   ! {ex}", flush=True)
            if evidence:
                lines = evidence.splitlines()
                print("\n".join(f"[{self.name}]   | {ln}" for ln in lines[:80]),
                      flush=True)
        if not self.suite.keep_dbs:
            self.pg_of(self.orders_db).drop_db(self.orders_db)
            self.pg_of(self.billing_db).drop_db(self.billing_db)
            if self.audit is not None:
                self.suite.pg.drop_db(self.audit.db)
        if not failed and not self.suite.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def result(self):
        rep = self.report or {}
        totals = self.sampler.totals() if self.sampler else {}
        crashes = {}
        restarts = 0
        for p in self.sup.procs:
            restarts += max(0, p.incarnation - 1)
            for point, n in p.crash_points.items():
                crashes[point] = crashes.get(point, 0) + n
        faults = self.faults + sum(crashes.values())
        counts = self.counts
        notes = list(self.notes)
        if counts["ack timeouts"]:
            notes.append(f"relay streams reset on ack timeout: "
                         f"{counts['ack timeouts']}")
        if crashes:
            notes.append("crashes: " + ", ".join(
                f"{k} x{v}" for k, v in sorted(crashes.items())))
        health = self.health_counts
        if health:
            notes.append("health NOT_SERVING logged: " + ", ".join(
                f"{k} x{v}" for k, v in sorted(health.items())))
        if self.gray.read_only_seconds:
            notes.append(f"read-only for {self.gray.read_only_seconds:.1f}s "
                         "in all")
        if self.gray.refused_seconds:
            notes.append(f"connections refused for "
                         f"{self.gray.refused_seconds:.1f}s in all")
        status = ("ERROR" if self.errors else
                  "FAIL" if self.violations else "PASS")
        return {
            "scenario": self.name, "seed": self.seed, "result": status,
            "seconds": self.seconds, "wall_seconds": round(self.wall, 1),
            "events": rep.get("events"), "applied": rep.get("applied"),
            "deliveries": totals.get("deliveries"),
            "duplicates": totals.get("duplicate"),
            "held_answers": totals.get("held"),
            "rejected": totals.get("rejected"),
            "held_peak": self.sampler.held_peak if self.sampler else None,
            "lost": rep.get("lost"),
            "missing_effects": rep.get("missing_effects"),
            "duplicate_effects": rep.get("duplicate_effects"),
            "order_violations": rep.get("order_violations"),
            "phantoms": rep.get("phantoms"),
            "view_mismatches": rep.get("view_mismatches"),
            "drained": rep.get("drained"),
            "drain_seconds": rep.get("drain_seconds"),
            "backlog_at_check": self.backlog,
            "drain_bound_seconds": self.wait,
            "dead_letters": rep.get("dead_letters"),
            "behind_dead": rep.get("behind_dead"),
            "i6": self.i6,
            "latency_p50_ms": rep.get("latency_p50_ms"),
            "latency_p99_ms": rep.get("latency_p99_ms"),
            "orders": self.load.get("created"),
            "indeterminate": self.load.get("indeterminate"),
            "gave_up": self.load.get("gave_up"),
            "faults": faults, "restarts": restarts,
            "violations": self.violations, "errors": self.errors,
            "examples": rep.get("examples", []), "notes": notes,
            "workdir": self.workdir if (self.violations or self.errors
                                        or self.suite.keep) else None,
            "replay": f"./scripts/chaos --seconds {self.seconds:g} --seed "
                      f"{self.seed} --scenario {self.name}"
                      + ("" if self.suite.tls else " --plaintext"),
            "tls": self.suite.tls,
            "figures": self.audit.figures() if self.audit else None,
            "fan_out": self.audit.result() if self.audit else None,
        }
