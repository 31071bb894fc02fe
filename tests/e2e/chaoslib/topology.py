"""Real database topologies for the failure-injection suite: PostgreSQL
servers of a scenario's own (a primary with an asynchronous streaming
standby), a movable address in front of them, PgBouncer, dumps and
restores, and freezing a whole server (standard library only).

Everything listens on 127.0.0.1 only, on ports from the suite's PortPool.
Every server and pooler started here is registered; `stop_everything`
(registered with atexit the first time one starts) stops each one by its
pid, so nothing outlives the harness. As root, PostgreSQL and PgBouncer run
as the `postgres` user (initdb, postgres and pgbouncer refuse root), in
folders of their own straight under /tmp, which that user can reach.

    pair = StandbyPair(ploop, ports, "orders").start()
    pair.primary.create_db("shop")
    vip = pair.address               # services dial vip.port
    pair.cut_replication()           # the standby falls behind
    pair.crash_primary()             # pg_ctl stop -m immediate
    pair.promote()                   # pg_ctl promote; timeline 2
    pair.move_address()              # vip -> the new primary; resets
"""

import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from .pg import PG_BIN, Postgres, SqlError
from .proxy import FaultProxy

# Each server of a topology is small: a scenario may run three at once
# next to the suite's own on a 2-core machine.
SERVER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "shared_buffers": "32MB",
    "max_connections": "100",
    "fsync": "on",
    "max_wal_size": "256MB",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] %d '",
}
# A primary that streams to a standby: WAL for it, a slot, and enough WAL
# kept that a standby cut off for seconds can still catch up later.
PRIMARY_SETTINGS = {
    "wal_level": "replica",
    "max_wal_senders": "4",
    "max_replication_slots": "4",
    "wal_keep_size": "128MB",
    "hot_standby": "on",
}
# The standby retries its primary every second (not 5 s), so that a cut
# healed by itself catches up quickly.
STANDBY_SETTINGS = {
    "hot_standby": "on",
    "wal_retrieve_retry_interval": "1s",
    "wal_receiver_timeout": "60s",
}

_LIVE = []  # servers and poolers started and not stopped yet
_LIVE_LOCK = threading.Lock()
_ATEXIT = []


def _register(thing):
    with _LIVE_LOCK:
        if not _ATEXIT:
            atexit.register(stop_everything)
            _ATEXIT.append(True)
        if thing not in _LIVE:
            _LIVE.append(thing)


def _unregister(thing):
    with _LIVE_LOCK:
        if thing in _LIVE:
            _LIVE.remove(thing)


def stop_everything():
    """Stops every server and pooler of this module still running, by pid
    (atexit; a scenario stops its own at its end)."""
    with _LIVE_LOCK:
        things = list(_LIVE)
    for t in reversed(things):
        try:
            t.stop()
        except Exception:
            pass


class TopologyError(RuntimeError):
    """A server or pooler could not be set up or driven (a harness
    problem: the scenario is an ERROR, not a FAIL)."""


def _as_postgres():
    """subprocess arguments that run a command as `postgres` when we are
    root (initdb, postgres and pgbouncer refuse to run as root)."""
    if os.geteuid() != 0:
        return {}
    return {"user": "postgres", "group": "postgres", "extra_groups": []}


def _own_dir(prefix):
    """A folder straight under /tmp that the server's user owns."""
    d = tempfile.mkdtemp(prefix=prefix)
    if os.geteuid() == 0:
        shutil.chown(d, "postgres", "postgres")
        os.chmod(d, 0o700)
    return d


def _run(argv, timeout, cwd=None, env=None):
    """Runs a server tool (as postgres when root); (returncode, output)."""
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout, cwd=cwd or "/tmp",
                           env=env, **_as_postgres())
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        return None, f"timed out after {timeout}s: {out}"
    return r.returncode, (r.stdout + r.stderr).strip()


def _children(pid):
    """The pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command may hold spaces and parentheses: fields follow the
        # last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(entry))
    return out


def _log_tail(path, n):
    """The last n lines of the log at `path`, on one line; "" if none."""
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().splitlines()[-n:])
    except OSError:
        return ""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rfind(")") + 2:].split()[0] != "Z"
    except OSError:
        return False


class Cluster(Postgres):
    """A PostgreSQL 15 server of a scenario's own, on its own port and
    folder; the same psql/db_url/create_db/drop_db as the suite's server.
    `settings` are its -c options (SERVER_SETTINGS plus the caller's)."""

    def __init__(self, root, name, ports, settings=None):
        super().__init__(root)
        self.name = name
        self.ports = ports
        self.settings = dict(SERVER_SETTINGS)
        self.settings.update(settings or {})
        self.dir = _own_dir(f"outbox-chaos-{name}.")
        self.data = os.path.join(self.dir, "data")
        self.logfile = os.path.join(self.dir, "postgres.log")
        self.pid = None  # the postmaster's, while it runs
        self.started = 0  # how often it was started

    def __repr__(self):
        return f"{self.name} (127.0.0.1:{self.port})"

    # -- making one -----------------------------------------------------------

    def initdb(self):
        rc, out = _run([os.path.join(PG_BIN, "initdb"), "-D", self.data, "-U",
                        "postgres", "-A", "trust", "--no-sync", "-E", "UTF8",
                        "--locale=C.UTF-8"], 120)
        if rc != 0:
            raise TopologyError(f"initdb of {self.name} failed: {out[-800:]}")
        return self

    def base_backup_of(self, primary, slot):
        """This server's data folder becomes a base backup of `primary`
        (pg_basebackup -R -X stream, a new replication slot `slot`): a
        standby of it once started."""
        rc, out = _run([os.path.join(PG_BIN, "pg_basebackup"), "-h",
                        "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
                        "-D", self.data, "-R", "-X", "stream", "-C", "-S",
                        slot, "--checkpoint=fast", "--no-sync"], 180)
        if rc != 0:
            raise TopologyError(f"pg_basebackup of {primary.name} into "
                                f"{self.name} failed: {out[-800:]}")
        return self

    def set_auto_conf(self, **settings):
        """Appends settings to postgresql.auto.conf (the last one of a name
        wins), read at the next start."""
        path = os.path.join(self.data, "postgresql.auto.conf")
        with open(path, "a") as f:
            for k, v in settings.items():
                f.write(f"{k} = '{v}'\n")
        if os.geteuid() == 0:
            shutil.chown(path, "postgres", "postgres")

    # -- running it -----------------------------------------------------------

    def start(self, port=None):
        """Starts the server on `port` (default: a free one; the same one
        again on a restart) and waits until it takes connections."""
        last = ""
        for _ in range(3):
            self.port = port or self.port or self.ports.take()
            opts = [f"-p {self.port}", f"-k {self.dir}"] + [
                f"-c {k}={v}" for k, v in self.settings.items()]
            rc, out = _run([os.path.join(PG_BIN, "pg_ctl"), "-D", self.data,
                            "-l", self.logfile, "-w", "-t", "90", "-o",
                            " ".join(opts), "start"], 120)
            if rc == 0:
                break
            last = out
            if port is not None:
                break
            self.port = None  # taken meanwhile: another one
        else:
            rc = None
        if rc != 0:
            raise TopologyError(f"{self.name} did not start: {last[-400:]} "
                                f"{self.log_tail(10)}")
        self.pid = self._pid_file()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}"
        self.started += 1
        _register(self)
        self._wait_connectable(60)
        return self

    def _pid_file(self):
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                return int(f.readline().strip())
        except (OSError, ValueError):
            return None

    def _wait_connectable(self, seconds):
        deadline = time.monotonic() + seconds
        while True:
            try:
                self.psql("postgres", "SELECT 1", timeout=5)
                return
            except SqlError as e:
                if time.monotonic() > deadline:
                    raise TopologyError(f"{self.name} takes no connection: "
                                        f"{e}")
            time.sleep(0.2)

    def running(self):
        return self.pid is not None and _alive(self.pid)

    def pids(self):
        """The postmaster and every process it forked."""
        if not self.running():
            return []
        return [self.pid] + _children(self.pid)

    def stop_immediate(self):
        """pg_ctl stop -m immediate: the server dies as in a crash (no
        checkpoint; its clients see their connections drop)."""
        rc, out = _run([os.path.join(PG_BIN, "pg_ctl"), "-D", self.data, "-m",
                        "immediate", "-w", "-t", "30", "stop"], 60)
        if rc != 0 and self.running():
            raise TopologyError(f"pg_ctl stop -m immediate of {self.name} "
                                f"failed: {out[-400:]}")
        self.pid = None

    def stop(self):
        """Stops the server (fast, then by its pid) and forgets it; its
        folder stays until remove()."""
        if self.running():
            for p in self.pids():
                try:
                    os.kill(p, signal.SIGCONT)  # it may be frozen
                except ProcessLookupError:
                    pass
            _run([os.path.join(PG_BIN, "pg_ctl"), "-D", self.data, "-m",
                  "fast", "-w", "-t", "20", "stop"], 40)
            if self.running():
                pids = self.pids()
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + 10
                while any(_alive(p) for p in pids) and \
                        time.monotonic() < deadline:
                    time.sleep(0.1)
        self.pid = None
        _unregister(self)

    def remove(self, keep_log_in=None):
        """Stops it and deletes its folder (its log copied into
        `keep_log_in` first, if given)."""
        self.stop()
        if keep_log_in and os.path.exists(self.logfile):
            try:
                shutil.copy(self.logfile,
                            os.path.join(keep_log_in, f"{self.name}.pg.log"))
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def restart_immediate(self):
        ok = True
        out = ""
        try:
            self.stop_immediate()
            self.start(self.port)
        except TopologyError as e:
            ok, out = False, str(e)
        return ok, out

    def log_tail(self, n=20):
        return _log_tail(self.logfile, n)

    # -- freezing: a hung server ---------------------------------------------

    def freeze(self):
        """SIGSTOP to the postmaster (so that it forks no one new), then to
        each of its children: the server accepts TCP connections (the
        kernel does) and answers nothing. Returns the pids frozen."""
        if not self.running():
            raise TopologyError(f"{self.name} is not running: nothing to "
                                "freeze")
        os.kill(self.pid, signal.SIGSTOP)
        frozen = [self.pid]
        for p in _children(self.pid):
            try:
                os.kill(p, signal.SIGSTOP)
                frozen.append(p)
            except ProcessLookupError:
                pass
        return frozen

    def thaw(self):
        """SIGCONT to the postmaster and every child (also one forked just
        before the freeze)."""
        if self.pid is None:
            return
        for p in [self.pid] + _children(self.pid):
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass

    # -- facts ----------------------------------------------------------------

    def in_recovery(self):
        return self.psql("postgres", "SELECT pg_is_in_recovery()",
                         timeout=5).strip() == "t"

    def timeline(self):
        """The timeline this server writes (a primary) or replays (a
        standby)."""
        out = self.psql("postgres", (
            "SELECT CASE WHEN pg_is_in_recovery() THEN (SELECT "
            "received_tli FROM pg_stat_wal_receiver) ELSE ('x' || "
            "substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)"
            "::int END"), timeout=5).strip()
        return int(out) if out else None

    def system_identifier(self):
        return self.psql("postgres", "SELECT system_identifier FROM "
                         "pg_control_system()", timeout=5).strip()

    def wal_lsn(self):
        """The primary's current WAL position, or a standby's last replayed
        one (as numbers: bytes)."""
        out = self.psql("postgres", (
            "SELECT CASE WHEN pg_is_in_recovery() THEN "
            "pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END "
            "- '0/0'::pg_lsn"), timeout=5).strip()
        return int(float(out)) if out else None


class MovableProxy(FaultProxy):
    """The services' address of a database that may move (as a DNS name
    or a virtual IP does when a standby is promoted): a FaultProxy whose
    upstream can be switched to another server's port."""

    def retarget(self, upstream_port):
        """New connections go to `upstream_port` from now on; every open
        one is reset, so its client reconnects to the new server. Returns
        how many were reset."""
        self.upstream_port = upstream_port
        return self.reset()


class StandbyPair:
    """A primary with one asynchronous streaming standby, and the address
    the services dial (`address`, a MovableProxy, at first in front of the
    primary). The standby streams through a FaultProxy of its own
    (`link`), so replication can be cut without touching the services'
    connections."""

    def __init__(self, root, ploop, ports, name):
        self.name = name
        self.ploop = ploop
        self.primary = Cluster(root, f"{name}-primary", ports,
                               PRIMARY_SETTINGS)
        self.standby = Cluster(root, f"{name}-standby", ports,
                               STANDBY_SETTINGS)
        self.current = self.primary  # the server the address leads to
        self.old = None              # the primary it replaced, once promoted
        self.link = None             # standby -> primary (replication)
        self.address = None          # services -> current
        self.promoted_at = None      # wall clock (time.time())
        self.moved_at = None
        self.timelines = None        # (old, new) once promoted

    def start(self):
        self.primary.initdb().start()
        self.link = FaultProxy(self.ploop, f"{self.name}-standby->primary",
                               self.primary.port)
        self.address = MovableProxy(self.ploop, f"services->{self.name}",
                                    self.primary.port)
        return self

    def start_standby(self):
        """The base backup and the standby (after the databases exist, so
        that the backup carries them; streaming would bring them anyway).
        Waits until it streams."""
        self.standby.base_backup_of(self.primary, f"{self.name}_standby")
        self.standby.set_auto_conf(primary_conninfo=(
            f"host=127.0.0.1 port={self.link.port} user=postgres "
            f"application_name={self.name}_standby"))
        self.standby.start()
        deadline = time.monotonic() + 60
        while self.replication_state() != "streaming":
            if time.monotonic() > deadline:
                raise TopologyError(
                    f"{self.standby.name} does not stream from "
                    f"{self.primary.name}: {self.standby.log_tail(5)}")
            time.sleep(0.2)
        return self

    def start_spare(self):
        """Instead of a standby: an empty server of its own, made by initdb
        (its transaction ids far behind the aged primary's), that a dump
        of the primary is restored into (restore-orders)."""
        self.standby.name = f"{self.name}-new"
        self.standby.initdb().start()
        return self

    def replace_primary(self):
        """The primary is gone for good (crash_primary) and the spare,
        restored from its dump, takes its place; then move_address."""
        self.old, self.current = self.primary, self.standby

    def replication_state(self):
        try:
            return self.primary.psql(
                "postgres", "SELECT state FROM pg_stat_replication WHERE "
                f"application_name = '{self.name}_standby'",
                timeout=5).strip()
        except SqlError:
            return ""

    def lag_bytes(self):
        """How much WAL the standby has not replayed yet (primary's
        position - standby's)."""
        return self.primary.wal_lsn() - self.standby.wal_lsn()

    def cut_replication(self):
        """Replication stalls (its link blackholed: connections kept,
        nothing forwarded), as when the network between the two breaks."""
        self.link.set_blackhole()

    def heal_replication(self):
        self.link.set_pass()

    def crash_primary(self):
        """The primary dies (pg_ctl stop -m immediate) and replication with
        it: what the link still holds is dropped, never delivered."""
        self.primary.stop_immediate()
        self.link.close()

    def promote(self, timeout=60):
        """pg_ctl promote, then waits until pg_is_in_recovery() is false.
        Returns (old timeline, new timeline)."""
        old_tli = self.standby.timeline() or 1
        rc, out = _run([os.path.join(PG_BIN, "pg_ctl"), "-D",
                        self.standby.data, "-w", "-t", str(timeout),
                        "promote"], timeout + 30)
        if rc != 0:
            raise TopologyError(f"pg_ctl promote of {self.standby.name} "
                                f"failed: {out[-400:]}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                if not self.standby.in_recovery():
                    break
            except SqlError:
                pass
            if time.monotonic() > deadline:
                raise TopologyError(f"{self.standby.name} still in recovery "
                                    f"{timeout}s after pg_ctl promote")
            time.sleep(0.1)
        self.promoted_at = time.time()
        self.old, self.current = self.primary, self.standby
        self.timelines = (old_tli, self.standby.timeline())
        return self.timelines

    def move_address(self):
        """The services' address now leads to the new primary; their open
        connections (to the dead one) are reset. Returns how many."""
        n = self.address.retarget(self.current.port)
        self.moved_at = time.time()
        return n

    def read_old_primary(self, queries, ports):
        """Starts the old primary again, alone, on a new port nobody else
        knows (crash recovery brings back every commit it had), runs
        `queries` ({key: (db, sql)}) and stops it. The truth of what the
        failover lost. Returns {key: output}."""
        old = self.old
        if old is None:
            raise TopologyError("read_old_primary: no failover happened")
        old.port = None
        old.ports = ports
        old.start()
        try:
            return {k: old.psql(db, sql, timeout=120)
                    for k, (db, sql) in queries.items()}
        finally:
            old.stop()

    def stop(self, keep_logs_in=None):
        for p in (self.address, self.link):
            if p is not None:
                p.close()
        for c in (self.primary, self.standby):
            c.remove(keep_logs_in)


POOL_MODES = ("session", "transaction", "statement")


class PgBouncer:
    """PgBouncer 1.18 in front of one server (every database on it, by
    wildcard), on its own port and log: auth_type trust (an auth_file
    naming postgres), pool_mode session, transaction or statement,
    `pool_size` server connections per database and user, so that the
    services share backends. Started and stopped by its pid."""

    def __init__(self, name, upstream_port, ports, pool_mode, pool_size=8,
                 extra=None):
        if pool_mode not in POOL_MODES:
            raise ValueError(f"pool_mode {pool_mode!r}")
        self.name = name
        self.upstream_port = upstream_port
        self.ports = ports
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.extra = dict(extra or {})
        self.dir = _own_dir(f"outbox-chaos-{name}.")
        self.ini = os.path.join(self.dir, "pgbouncer.ini")
        self.logfile = os.path.join(self.dir, "pgbouncer.log")
        self.port = None
        self.popen = None

    def _write_config(self):
        users = os.path.join(self.dir, "userlist.txt")
        with open(users, "w") as f:
            f.write('"postgres" ""\n')
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": users,
            "admin_users": "postgres",
            "stats_users": "postgres",
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.pool_size),
            "min_pool_size": "0",
            "reserve_pool_size": "0",
            "max_client_conn": "400",
            "max_db_connections": "0",
            "logfile": self.logfile,
            "log_connections": "0",
            "log_disconnections": "0",
            "ignore_startup_parameters": "extra_float_digits",
            # what a client waits for a server before it is told no
            "query_wait_timeout": "30",
        }
        settings.update(self.extra)
        with open(self.ini, "w") as f:
            f.write("[databases]\n")
            f.write(f"* = host=127.0.0.1 port={self.upstream_port}\n\n")
            f.write("[pgbouncer]\n")
            for k, v in settings.items():
                f.write(f"{k} = {v}\n")
        if os.geteuid() == 0:
            for p in (users, self.ini):
                shutil.chown(p, "postgres", "postgres")

    def start(self):
        from . import procs as P  # noqa: the harness's registry of children
        last = ""
        for _ in range(3):
            self.port = self.ports.take()
            self._write_config()
            log = open(os.path.join(self.dir, "stdout.log"), "ab")
            try:
                self.popen = subprocess.Popen(
                    ["/usr/sbin/pgbouncer", self.ini],
                    stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, cwd=self.dir,
                    start_new_session=True, **_as_postgres())
            except OSError as e:
                raise TopologyError(f"cannot start pgbouncer: {e}")
            finally:
                log.close()
            P.track(self.popen)
            _register(self)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.popen.poll() is None:
                try:
                    self.admin("SHOW VERSION")
                    return self
                except SqlError as e:
                    last = str(e)
                time.sleep(0.1)
            last = f"{last} {self.log_tail(5)}"
            self.stop()
        raise TopologyError(f"pgbouncer ({self.pool_mode}) did not start: "
                            f"{last[-500:]}")

    def url(self, db):
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def psql(self, db, sql, timeout=15, app="chaos-pooler-probe"):
        """psql through the pooler, with no startup options (PgBouncer
        refuses an `options` parameter it does not know)."""
        argv = ["psql", self.url(db), "-XAtq", "-v", "ON_ERROR_STOP=1"]
        for s in [sql] if isinstance(sql, str) else sql:
            argv += ["-c", s]
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=timeout,
                               env=dict(os.environ, PGCONNECT_TIMEOUT="3",
                                        PGOPTIONS="", PGAPPNAME=app))
        except subprocess.TimeoutExpired as e:
            raise SqlError(f"psql through pgbouncer timed out after "
                           f"{timeout}s") from e
        if r.returncode != 0:
            raise SqlError(r.stderr.strip() or f"psql exited {r.returncode}")
        return r.stdout

    def admin(self, command, timeout=5):
        """A command of PgBouncer's admin console (SHOW POOLS, ...)."""
        return self.psql("pgbouncer", command, timeout=timeout,
                         app="chaos-pooler-admin")

    def log_tail(self, n=20):
        return _log_tail(self.logfile, n)

    def stop(self):
        from . import procs as P  # noqa
        p = self.popen
        if p is not None and p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGTERM)  # immediate shutdown
            except ProcessLookupError:
                pass
            if not P.reap(p, 5):
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                P.reap(p, 5)
        elif p is not None:
            P.untrack(p)
        _unregister(self)

    def remove(self, keep_log_in=None):
        self.stop()
        if keep_log_in:
            for f in ("pgbouncer.log", "pgbouncer.ini", "stdout.log"):
                try:
                    shutil.copy(os.path.join(self.dir, f), os.path.join(
                        keep_log_in, f"{self.name}.{f}"))
                except OSError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)


# -- dumps and restores -------------------------------------------------------


def _client_env():
    return dict(os.environ, PGCONNECT_TIMEOUT="5", PGOPTIONS="")


def dump(server, db, path, timeout=120):
    """pg_dump -Fc of `db` on `server` into `path` (a consistent snapshot,
    taken while the load runs). Returns its size in bytes."""
    try:
        r = subprocess.run([os.path.join(PG_BIN, "pg_dump"), "-Fc", "-f",
                            path, server.db_url(db)], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout,
                           env=_client_env())
    except subprocess.TimeoutExpired:
        raise TopologyError(f"pg_dump of {db} took more than {timeout}s")
    if r.returncode != 0:
        raise TopologyError(f"pg_dump of {db} failed: {r.stderr[-500:]}")
    return os.path.getsize(path)


def restore(server, db, path, timeout=180):
    """pg_restore of dump `path` into the (new, empty) database `db`, in
    one transaction: a service that connects meanwhile sees either no
    table or all of them, never half a restore."""
    try:
        r = subprocess.run([os.path.join(PG_BIN, "pg_restore"),
                            "--single-transaction", "--exit-on-error",
                            "--no-owner", "-d", server.db_url(db), path],
                           stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout, env=_client_env())
    except subprocess.TimeoutExpired:
        raise TopologyError(f"pg_restore into {db} took more than "
                            f"{timeout}s")
    if r.returncode != 0:
        raise TopologyError(f"pg_restore into {db} failed: "
                            f"{r.stderr[-500:]}")


_SNAPSHOT_DONE = "chaos-snapshot-done"


def _locked_snapshot(server, db, table, select, timeout=30):
    """A psql session that locks `table` (EXCLUSIVE: reads go on, writes
    wait) and prints `select`; returns (the session, its rows). The lock
    holds until the session ends, so nothing is written to `table` between
    the snapshot and what the caller does next (a DROP ... WITH (FORCE),
    which ends the session too)."""
    from . import procs as P  # noqa: the harness's registry of children
    from .pg import HARNESS_OPTIONS
    p = subprocess.Popen(
        ["psql", server.db_url(db), "-XAtq", "-v", "ON_ERROR_STOP=1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=dict(os.environ, PGCONNECT_TIMEOUT="5", PGAPPNAME="chaos-snapshot",
                 PGOPTIONS=HARNESS_OPTIONS + " -c lock_timeout=10s"))
    P.track(p)
    lines, done = [], threading.Event()

    def read():
        for ln in p.stdout:
            ln = ln.rstrip("\n")
            if ln == _SNAPSHOT_DONE:
                done.set()
                continue
            if not done.is_set():
                lines.append(ln)
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    p.stdin.write(f"BEGIN;\nLOCK TABLE {table} IN EXCLUSIVE MODE;\n"
                  f"COPY ({select}) TO STDOUT;\n\\echo {_SNAPSHOT_DONE}\n")
    p.stdin.flush()
    if not done.wait(timeout) or p.poll() is not None:
        _end(p)
        raise TopologyError(f"snapshot of {db}.{table} failed: "
                            + " | ".join(lines[-3:]))
    return p, lines


def _end(p):
    """Ends a snapshot session (DROP ... WITH (FORCE) usually did)."""
    from . import procs as P  # noqa
    try:
        p.stdin.close()
    except OSError:
        pass
    if not P.reap(p, 5):
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        P.reap(p, 5)
    p.stdout.close()


def replace_from_dump(server, db, path, snapshot=None):
    """What an operator restoring a backup does, with the services
    running: DROP DATABASE ... WITH (FORCE) (their sessions terminated),
    CREATE DATABASE, pg_restore into it. With `snapshot` = (table, select),
    first locks that table and reads `select`, so that the rows returned
    are exactly what the dropped database last held. Returns (the seconds
    it took, those rows)."""
    t = time.monotonic()
    session, rows = (None, [])
    if snapshot is not None:
        session, rows = _locked_snapshot(server, db, *snapshot)
    try:
        server.psql("postgres", f"DROP DATABASE {db} WITH (FORCE)",
                    timeout=60)
    finally:
        if session is not None:
            _end(session)
    server.psql("postgres", f"CREATE DATABASE {db}", timeout=60)
    restore(server, db, path)
    return time.monotonic() - t, rows


UUID_RE = re.compile(
    r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
