"""Gray failures: every process stays up while the database misbehaves.

A database turns read-only, either as after a failover to a read-only
standby (ALTER DATABASE ... SET default_transaction_read_only, every session
of that database terminated, so the services reconnect to it) or in place
(ALTER SYSTEM SET default_transaction_read_only and a reload: the whole
server, sessions kept, at their next transaction); a database refuses new
connections (ALTER DATABASE ... WITH ALLOW_CONNECTIONS false, its sessions
terminated); a rogue session holds a table's ACCESS EXCLUSIVE lock for
longer than the services' --lock_timeout while the health of the binaries
whose loop it blocks is polled.

Every change is undone by restore(), which the heal and the end of every
run call (also after an exception), and which checks with a fresh session
that both databases accept connections and writes again, so later
scenarios and the checker are unaffected. The harness's own sessions run
with default_transaction_read_only=off (pg.HARNESS_OPTIONS) and every
statement here is bounded by statement_timeout, lock_timeout and the psql
call's timeout.
"""

import os
import re
import signal
import subprocess
import threading
import time

from . import procs as P
from .observe import scrape
from .pg import HARNESS_OPTIONS, SqlError

OWNED_RE = re.compile(r"^outbox_relay_partitions_owned(?:\{[^}]*\})?\s+"
                      r"([0-9.eE+]+)\s*$", re.M)

ROGUE_APP = "chaos-rogue-lock"
# Statements of the faults and of their undoing: writable and bounded.
ADMIN_OPTIONS = (HARNESS_OPTIONS +
                 " -c statement_timeout=10s -c lock_timeout=5s")
ADMIN_TIMEOUT = 20       # the psql call's own bound, seconds
ROGUE_LOCK_WAIT = 5.0    # the rogue session's lock_timeout, seconds


def partitions_owned(relay):
    """outbox_relay_partitions_owned of `relay` from its /metrics; None
    when it cannot be read."""
    if relay.metrics_port is None or relay.pid is None:
        return None
    try:
        text = scrape(relay.metrics_port, timeout=2)
    except Exception:  # noqa: BLE001 -- unknown, so a stall is expected
        return None
    m = OWNED_RE.search(text)
    return int(float(m.group(1))) if m else None


class HealthWatch:
    """Polls grpc.health.v1 of `procs` from one thread each until stop();
    remembers what each said, and when NOT_SERVING was first seen."""

    def __init__(self, run, procs, interval=0.1):
        self.run = run
        self.procs = list(procs)
        self.interval = interval
        self.t0 = time.monotonic()
        self.seen = {p.name: {"polls": 0, "not_serving": 0, "serving": 0,
                              "other": 0, "first_not_serving": None}
                     for p in self.procs}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(p,),
                                          name=f"health-{p.name}", daemon=True)
                         for p in self.procs]

    def start(self):
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def _loop(self, proc):
        while not self._stop.is_set():
            t = time.monotonic() - self.t0
            status = self.run.health(proc.listen_port, timeout=2.0)
            with self._lock:
                s = self.seen[proc.name]
                s["polls"] += 1
                if status == "NOT_SERVING":
                    s["not_serving"] += 1
                    if s["first_not_serving"] is None:
                        s["first_not_serving"] = t
                elif status == "SERVING":
                    s["serving"] += 1
                else:
                    s["other"] += 1
            self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        with self._lock:
            return {k: dict(v) for k, v in self.seen.items()}


class GrayFaults:
    def __init__(self, run):
        self.run = run
        self.dirty = False            # something may need undoing
        self.read_only_dbs = set()    # ALTER DATABASE ... read-only in force
        self.rogues = []              # rogue lock psql processes
        self.read_only_seconds = 0.0
        self.refused_seconds = 0.0
        # rogue-lock: proc name -> lock periods that should stall it, and
        # those during which its health said NOT_SERVING
        self.stalls_expected = {}
        self.stalls_seen = {}
        self.lock_periods = []        # one dict per lock held
        self.after_heal = []  # (name, status, bound): not SERVING after heal

    @property
    def pg(self):
        return self.run.suite.pg

    def sql(self, db, statements, timeout=ADMIN_TIMEOUT):
        return self.pg.psql(db, statements, timeout=timeout,
                            options=ADMIN_OPTIONS)

    def terminate(self, db):
        """Terminates every session of `db` but our own; how many."""
        out = self.sql("postgres",
                       "SELECT count(*) FILTER (WHERE pg_terminate_backend("
                       "pid)) FROM pg_stat_activity WHERE datname = "
                       f"'{db}' AND pid <> pg_backend_pid()")
        return int(out.strip() or 0)

    def probe(self, db):
        """What a new session of `db` gets as default_transaction_read_only,
        with no option of ours; None when it cannot connect."""
        try:
            return self.pg.psql(
                db, "SELECT current_setting('default_transaction_read_only')",
                timeout=5, options="", app="chaos-probe").strip()
        except SqlError:
            return None

    def wait_probe(self, db, want, seconds):
        """Polls probe(db) until it says `want` (a reload is asynchronous);
        returns the last answer."""
        deadline = time.monotonic() + seconds
        while True:
            got = self.probe(db)
            if got == want or time.monotonic() >= deadline:
                return got
            time.sleep(0.05)

    # -- read-only ------------------------------------------------------------

    def read_only(self, db, label, how, seconds):
        """`db` read-only for `seconds`, then writable again. how: "failover"
        (that database, its sessions terminated) or "in-place" (the whole
        server, sessions kept)."""
        run = self.run
        self.dirty = True
        t = time.monotonic()
        if how == "failover":
            self.read_only_dbs.add(db)
            self.sql("postgres", f"ALTER DATABASE {db} SET "
                     "default_transaction_read_only = on")
            n = self.terminate(db)
            what = (f"failover: ALTER DATABASE SET "
                    f"default_transaction_read_only = on, {n} sessions "
                    "terminated")
        else:
            self.sql("postgres", ["ALTER SYSTEM SET "
                                  "default_transaction_read_only = on",
                                  "SELECT pg_reload_conf()"])
            what = ("in place: ALTER SYSTEM SET default_transaction_read_only"
                    " = on and pg_reload_conf(), the whole server, sessions "
                    "kept")
        got = self.wait_probe(db, "on", 3.0)
        if got != "on":
            raise SqlError(f"{label} database did not turn read-only "
                           f"({how}): a new session says {got!r}")
        run.faults += 1
        run.log(f"{label} database read-only ({what}) for {seconds:.1f}s")
        run.hold(seconds - (time.monotonic() - t))
        self.writable(db, label, how, since=t)

    def writable(self, db, label, how, since=None):
        if how == "failover":
            self.sql("postgres", f"ALTER DATABASE {db} RESET "
                     "default_transaction_read_only")
            n = self.terminate(db)
            self.read_only_dbs.discard(db)
            what = (f"ALTER DATABASE RESET default_transaction_read_only, {n} "
                    "sessions terminated")
        else:
            self.sql("postgres", ["ALTER SYSTEM RESET "
                                  "default_transaction_read_only",
                                  "SELECT pg_reload_conf()"])
            what = "ALTER SYSTEM RESET default_transaction_read_only, reload"
        took = ""
        if since is not None:
            self.read_only_seconds += time.monotonic() - since
            took = f" after {time.monotonic() - since:.1f}s"
        got = self.wait_probe(db, "off", 5.0)
        if got != "off":
            raise SqlError(f"{label} database still read-only after the "
                           f"heal ({how}): a new session says {got!r}")
        self.run.log(f"{label} database writable again{took} ({what})")

    # -- refusing connections -------------------------------------------------

    def refuse_connections(self, db, label, seconds):
        """`db` refuses new connections for `seconds` (its sessions are
        terminated), then takes them again. Run from the postgres
        database: ALTER DATABASE cannot target the session's own one."""
        run = self.run
        self.dirty = True
        t = time.monotonic()
        self.sql("postgres",
                 f"ALTER DATABASE {db} WITH ALLOW_CONNECTIONS false")
        n = self.terminate(db)
        run.faults += 1
        run.log(f"{label} database refuses connections (ALTER DATABASE WITH "
                f"ALLOW_CONNECTIONS false, {n} sessions terminated) for "
                f"{seconds:.1f}s")
        run.hold(seconds - (time.monotonic() - t))
        self.sql("postgres",
                 f"ALTER DATABASE {db} WITH ALLOW_CONNECTIONS true")
        took = time.monotonic() - t
        self.refused_seconds += took
        if self.wait_probe(db, "off", 5.0) is None:
            raise SqlError(f"{label} database still refuses connections "
                           "after ALLOW_CONNECTIONS true")
        run.log(f"{label} database takes connections again after "
                f"{took:.1f}s (ALLOW_CONNECTIONS true)")

    # -- a rogue lock ---------------------------------------------------------

    def _rogue_granted(self, db, table):
        out = self.pg.psql(
            db, "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a "
            "USING (pid) WHERE a.application_name = '" + ROGUE_APP + "' AND "
            "l.locktype = 'relation' AND l.mode = 'AccessExclusiveLock' AND "
            f"l.granted AND l.relation = '{table}'::regclass", timeout=5)
        return int(out.strip() or 0) > 0

    def rogue_lock(self, db, label, table, seconds, stalled):
        """A rogue session holds LOCK TABLE `table` IN ACCESS EXCLUSIVE MODE
        for `seconds` while the health of each process in `stalled` (whose
        loop needs that table) is polled. A relay's loop always has work; a
        producer or consumer only while the client load runs, so one of
        those counts as expected to stall only when the load was still
        running when the lock was released (or when it did say
        NOT_SERVING). Returns the lock period's record, or None when the
        lock could not be taken."""
        run = self.run
        self.dirty = True
        stmt = (f"BEGIN; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE; "
                f"SELECT pg_sleep({seconds:.2f}); COMMIT;")
        opts = (f"{HARNESS_OPTIONS} -c lock_timeout={ROGUE_LOCK_WAIT:g}s "
                f"-c statement_timeout={int((seconds + 10) * 1000)}")
        log_path = os.path.join(run.workdir, "rogue-lock.log")
        with open(log_path, "ab") as log:
            log.write(f"==== t={run.t():.1f}s {label}: {stmt}\n".encode())
            log.flush()
            p = subprocess.Popen(
                ["psql", self.pg.db_url(db), "-XAtq", "-v", "ON_ERROR_STOP=1",
                 "-c", stmt], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, PGOPTIONS=opts, PGAPPNAME=ROGUE_APP,
                         PGCONNECT_TIMEOUT="3"))
        P.track(p)
        self.rogues.append(p)
        try:
            deadline = time.monotonic() + ROGUE_LOCK_WAIT + 3
            granted = False
            while time.monotonic() < deadline and p.poll() is None:
                try:
                    granted = self._rogue_granted(db, table)
                except SqlError:
                    granted = False
                if granted:
                    break
                time.sleep(0.05)
            if not granted:
                run.log(f"rogue lock on {label}.{table} not taken within "
                        f"{ROGUE_LOCK_WAIT + 3:g}s (see rogue-lock.log)")
                return None
            start = time.monotonic()
            owned = {s.name: partitions_owned(s) for s in stalled
                     if s.kind == "relay"}
            watch = HealthWatch(run, stalled).start()
            run.faults += 1
            run.log(f"rogue lock: {label}.{table} IN ACCESS EXCLUSIVE MODE "
                    f"for {seconds:.1f}s (psql pid {p.pid}); polling the "
                    f"health of {', '.join(s.name for s in stalled)}"
                    + "".join(f"; {n} owns {k} partitions"
                              for n, k in sorted(owned.items())))
            try:
                P.reap(p, seconds + 10)
            finally:
                if p.poll() is None:
                    self._kill_rogue(p)
                held = time.monotonic() - start
                loading = any(lp.poll() is None for _, lp in run.loads)
                seen = watch.stop()
        finally:
            if p.poll() is None:
                self._kill_rogue(p)
        period = {"db": label, "table": table, "held": held, "health": seen}
        self.lock_periods.append(period)
        parts = []
        for s in stalled:
            h = seen[s.name]
            if not (h["not_serving"] or loading or s.kind == "relay"):
                parts.append(f"{s.name} never NOT_SERVING, but the client "
                             "load had ended: no work, no stall")
                continue
            if not h["not_serving"] and owned.get(s.name) == 0:
                # Its peer held every partition and could not hand any
                # over (it gives one up only once its marks are written):
                # nothing of this relay's waits on the table.
                parts.append(f"{s.name} never NOT_SERVING, but it owned no "
                             "partition when the lock was taken: no work, "
                             "no stall")
                continue
            self.stalls_expected[s.name] = \
                self.stalls_expected.get(s.name, 0) + 1
            if h["not_serving"]:
                self.stalls_seen[s.name] = self.stalls_seen.get(s.name, 0) + 1
                parts.append(f"{s.name} NOT_SERVING from "
                             f"{h['first_not_serving']:.1f}s "
                             f"({h['not_serving']}/{h['polls']} polls)")
            else:
                parts.append(f"{s.name} never NOT_SERVING ({h['serving']} "
                             f"SERVING, {h['other']} no answer, of "
                             f"{h['polls']} polls)")
        run.log(f"rogue lock on {label}.{table} released after {held:.1f}s: "
                + "; ".join(parts))
        return period

    def _kill_rogue(self, p):
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        P.reap(p, 5)

    # -- the heal -------------------------------------------------------------

    def restore(self):
        """Undoes every gray fault that may still be in force: no rogue lock,
        ALTER SYSTEM and both databases' read-only setting reset, both
        databases accepting connections; sessions opened read-only are
        terminated. Then checks with fresh sessions that both databases take
        connections and are writable (raises SqlError if not)."""
        if not self.dirty:
            return
        run = self.run
        for p in self.rogues:
            if p.poll() is None:
                self._kill_rogue(p)
        self.rogues = []
        stmts = ["ALTER SYSTEM RESET default_transaction_read_only",
                 "SELECT pg_reload_conf()",
                 "SELECT count(pg_terminate_backend(pid)) FROM "
                 f"pg_stat_activity WHERE application_name = '{ROGUE_APP}'"]
        for db in (run.orders_db, run.billing_db):
            stmts += [f"ALTER DATABASE {db} WITH ALLOW_CONNECTIONS true",
                      f"ALTER DATABASE {db} RESET "
                      "default_transaction_read_only"]
        self.sql("postgres", stmts)
        for db in sorted(self.read_only_dbs):
            n = self.terminate(db)
            run.log(f"restore: {n} sessions of {db} terminated (opened "
                    "read-only)")
        self.read_only_dbs.clear()
        for db in (run.orders_db, run.billing_db):
            got = self.wait_probe(db, "off", 5.0)
            if got != "off":
                raise SqlError(f"restore: a new session of {db} says "
                               f"default_transaction_read_only = {got!r}")
        self.dirty = False
        run.log("gray faults undone: no rogue lock, both databases writable "
                "and accepting connections", quiet=True)
