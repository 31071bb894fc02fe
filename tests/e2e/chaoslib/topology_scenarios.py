"""The topology scenarios: the databases on the servers production runs
(an asynchronous standby promoted after a crash, a database restored from
a dump, PgBouncer in each pool mode, a hung server), under the usual load,
each ending with `outboxctl verify` and `outboxctl reconcile`.

A TopologyScenario's `build` starts its servers (chaoslib/topology.py) and
says where each database lives (`Home`: the server holding it now, which a
promotion changes, and the address the services dial: a movable proxy or
a pooler). TopologyRun is the runner's Run with those homes; everything
else (processes, supervisor, load, heal, checker, evidence) is the same.

What each scenario requires of the product is in its `check` (and, for
failover-orders, in `before_verify`); see tests/e2e/README.md.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from . import procs as P
from .gray import HealthWatch
from .observe import scrape
from .pg import SqlError
from .runner import HarnessError, Run, SHUTDOWN_TIMEOUT
from .scenarios import (ACK_TIMEOUT, RETENTION_FLAGS, Scenario, check_gray,
                        check_retention, on_partitioned, on_rows)
from .tls import HARNESS
from .topology import (Cluster, PgBouncer, StandbyPair, TopologyError,
                       UUID_RE, dump, replace_from_dump, restore)

GROUP = "topology"
CUT_SECONDS = (2.5, 3.5)     # replication cut before the primary dies
RESTORE_AFTER = (3.0, 4.5)   # s between the dump and the restore
# restore-orders: the old server's transaction ids run this far ahead of a
# new one's (besides what the load adds), as a server in service for a
# while is ahead of one just made
AGE_XIDS = 5000
LOST_AFTER_DUMP = (1.5, 2.5)   # restore-orders: s of commits the dump lacks
RELAYS_BACK_AFTER = (2.0, 3.0)  # restore-orders: s the producer writes alone
FREEZE_SECONDS = 15.0        # hung-db: the server frozen this long
REFUSAL_BOUND = 20.0         # s a binary may take to refuse a pooler
RECONCILE_GRACE = "1s"
# How long the listing waits for a due heal: a relay runs it within
# seconds of seeing a database change, in well under a second for a
# thousand lost aggregates.
HEAL_BOUND = 60
RESOLVE_MAX = 5000           # failover-orders: orders the operator resolves
LEAK_BATCH = 20              # sampler: statements per pooler session
# Transaction mode: few backends, shared by every service. Session mode
# pins a backend to each client connection for its life, so its pool must
# hold every service's connections (the services open 8 on the orders
# database today), as a session-mode deployment's does.
TRANSACTION_POOL = 8
SESSION_POOL = 20
# A binary that notices its database failed over logs an error naming the
# word and the timelines (DESIGN.md section 7).
FAILOVER_RE = re.compile(r"(?i)failover")
TIMELINE_RE = re.compile(r"(?i)timeline")
NUMBER_RE = re.compile(r"(?<![\w.:+-])(\d+)(?![\w.:-])")
LEVEL_RE = re.compile(r'^\S+Z\s+(\w+)\s|"level":"(\w+)"')
POOLER_RE = re.compile(r"(?i)pgbouncer|pooler")
STATEMENT_RE = re.compile(r"(?i)statement")
# The relay that finds the outbox's transaction ids behind its log's
# (relay/dispatcher.cc, Rebase).
REBASE_RE = re.compile(r"(?i)transaction ids lie behind")
REDELIVERY_METRIC_RE = re.compile(
    r"^(outbox_relay_\w*(?:redeliver|failover|rewind|diverg|identity)\w*)"
    r"(\{[^}]*\})?\s+([0-9.eE+]+)\s*$", re.M)


# -- where a database lives -------------------------------------------------


class Home:
    """Where a database lives now (`server()`: a promotion changes it) and
    the port the services dial (a movable proxy, a pooler, or the server
    itself). Has the psql/db_url/create_db/drop_db of a server, so the
    runner, the sampler and the evidence follow a failover."""

    def __init__(self, server, service_port=None):
        self.server = server  # a callable: the server holding it now
        self.service_port = service_port

    def psql(self, db, sql, **kw):
        return self.server().psql(db, sql, **kw)

    def db_url(self, db):
        return self.server().db_url(db)

    def create_db(self, db):
        self.server().create_db(db)

    def drop_db(self, db):
        self.server().drop_db(db)

    def service_url(self, db):
        port = self.service_port or self.server().port
        return f"postgresql://postgres@127.0.0.1:{port}/{db}"


# Every outbox row, kept where retention does not delete it (the copy is
# written in the producer's transaction by a trigger, before the load).
OUTBOX_HISTORY = """
CREATE TABLE chaos_outbox_history (event_id uuid PRIMARY KEY,
                                   seq bigint NOT NULL,
                                   aggregate_id text NOT NULL);
CREATE FUNCTION chaos_outbox_keep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO chaos_outbox_history VALUES (NEW.event_id, NEW.seq,
                                           NEW.aggregate_id);
  RETURN NULL;
END $$;
CREATE TRIGGER chaos_outbox_keep AFTER INSERT ON outbox
  FOR EACH ROW EXECUTE FUNCTION chaos_outbox_keep();
"""


@dataclass
class TopologyScenario(Scenario):
    # starts the scenario's servers and sets run.homes (before the
    # databases are created and the services start)
    build: Optional[Callable] = None
    # a run is at least this long (--ci's 7 s leave no room for a lead-in,
    # a replication cut, a promotion and load on the new primary)
    min_seconds: float = 15.0
    # runs after the load and the heal, before the checker (the truth of
    # what a failover lost; failover-orders: the operator's part)
    before_verify: Optional[Callable] = None
    group: str = GROUP

    @property
    def run_class(self):
        return TopologyRun


class TopologyRun(Run):
    """A Run whose databases live in `homes` (else on the suite's server);
    it stops its own servers and pooler at its end, after the processes,
    and keeps their logs in the scenario's folder when that is kept."""

    def __init__(self, suite, scenario, seconds, seed, index):
        super().__init__(suite, scenario, max(seconds, scenario.min_seconds),
                         seed, index)
        self.homes = {}    # database -> Home
        self.pairs = {}    # "orders" / "billing" -> StandbyPair
        self.clusters = []  # servers of its own (not in a pair)
        self.bouncer = None
        self.leak_sampler = None
        self.topo = {}     # figures for the notes and --json
        self.truth = {}    # sets of event ids read from the databases
        self.topo_notes = []
        self.refusals = []  # pgbouncer-statement: each binary's refusal
        self.listing_violations = []  # failover-orders, before the checker

    # -- the runner's hooks -------------------------------------------------

    def pg_of(self, db):
        return self.homes.get(db) or self.suite.pg

    def _db_url(self, proc_name, db):
        home = self.homes.get(db)
        if home is None:
            return super()._db_url(proc_name, db)
        return home.service_url(db)

    def setup(self):
        try:
            if self.scn.build is not None:
                self.scn.build(self)
        except (TopologyError, SqlError) as e:
            raise HarnessError(f"topology: {e}")
        super().setup()
        self.log("databases: " + "; ".join(
            f"{db} on {self._where(db)}" for db in (self.orders_db,
                                                     self.billing_db)))
        if self.keeps_history():
            self.sql_orders(OUTBOX_HISTORY)
            self.log("orders: every outbox row also kept in "
                     "chaos_outbox_history, in the producer's transaction "
                     "(--retention deletes from the outbox; the truth of "
                     "what a failover or restore lost must not depend on it)",
                     quiet=True)

    def keeps_history(self):
        """With --retention, what the outbox held is read from a copy that
        retention leaves alone: before the load starts, every outbox row is
        also written, in the producer's transaction, to
        chaos_outbox_history, which replicates, dumps and restores with
        the outbox and loses what it loses."""
        return ("retention" in self.scn.relay_flags
                and self.scn.before_verify is not None)

    def outbox_rows_sql(self):
        """SELECT event_id, seq, aggregate_id of every event the orders
        database's history holds."""
        return ("SELECT event_id, seq, aggregate_id FROM "
                + ("chaos_outbox_history" if self.keeps_history()
                   else "outbox"))

    def _where(self, db):
        home = self.homes.get(db)
        if home is None:
            return f"the suite's server (:{self.suite.pg.port})"
        server = home.server()
        via = home.service_url(db).rsplit(":", 1)[1].split("/")[0]
        return (f"{getattr(server, 'name', 'the suite server')} "
                f"(:{server.port}), services dial :{via}")

    def verify(self):
        if self.scn.before_verify is not None:
            try:
                self.scn.before_verify(self)
            except (TopologyError, SqlError) as e:
                raise HarnessError(f"topology: {e}")
        super().verify()

    def _finish(self, started, verified):
        for c in self._servers():
            c.thaw()  # a frozen server would hang the evidence and drops
        if self.leak_sampler is not None:
            self.leak_sampler.stop()
        super()._finish(started, verified)
        keep = self.workdir if os.path.isdir(self.workdir) else None
        for pair in self.pairs.values():
            pair.stop(keep)
        for c in self.clusters:
            c.remove(keep)
        if self.bouncer is not None:
            self.bouncer.remove(keep)

    def _servers(self):
        out = list(self.clusters)
        for pair in self.pairs.values():
            out += [pair.primary, pair.standby]
        return out

    def result(self):
        r = super().result()
        r["notes"] = r["notes"] + self.topo_notes
        r["topology"] = self.topo
        return r

    # -- helpers for the scenarios ------------------------------------------

    def note(self, text):
        self.topo_notes.append(text)
        self.log(text)

    def outboxctl(self, args, timeout=120, name=None):
        """Runs outboxctl; (returncode, stdout, stderr), also written to
        `name` in the scenario's folder."""
        argv = [os.path.join(self.suite.bin, "outboxctl")] + list(args)
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL,
                               capture_output=True, text=True,
                               timeout=timeout, env=P.clean_env({}))
        except subprocess.TimeoutExpired:
            raise HarnessError(f"outboxctl {args[0]} did not finish within "
                               f"{timeout}s")
        if name:
            with open(os.path.join(self.workdir, name), "w") as f:
                f.write(r.stdout + r.stderr)
        return r.returncode, r.stdout, r.stderr

    def db_flags(self):
        """outboxctl's database flags: each database where it lives now,
        directly (not through a proxy or a pooler)."""
        return [f"--{k}_db={self.pg_of(db).db_url(db)}" for k, db in
                (("orders", self.orders_db), ("billing", self.billing_db))]

    def reconcile(self, name):
        """outboxctl reconcile --format=json over a window that covers the
        whole run, a short grace; (returncode, report)."""
        window = int(self.t()) + 120
        rc, out, err = self.outboxctl(
            ["reconcile"] + self.db_flags() +
            [f"--window={window}s", f"--grace={RECONCILE_GRACE}",
             "--limit=1000", "--format=json"], name=name)
        line = next((ln for ln in reversed(out.splitlines())
                     if ln.startswith("{")), None)
        if rc not in (0, 1) or line is None:
            raise HarnessError(f"outboxctl reconcile failed (rc {rc}): "
                               f"{(err or out).strip()[-400:]}")
        return rc, json.loads(line)

    def relay_admin_flags(self):
        tls = self.certs.ctl_flags(HARNESS) if self.certs else []
        return [f"--relay=127.0.0.1:{self.relays[0].listen_port}"] + tls

    def outboxctl_commands(self):
        """The commands outboxctl's usage names (its --help and its usage
        line), to call the operator's commands only once they exist."""
        _, out, err = self.outboxctl(["--help"], timeout=30)
        _, out2, err2 = self.outboxctl([], timeout=30)
        return out + err + out2 + err2

    def relay_metrics(self):
        """Each relay's counters whose name speaks of a redelivery, a
        failover or a database identity: {name: value} summed."""
        out = {}
        for r in self.relays:
            if r.metrics_port is None or r.pid is None:
                continue
            try:
                text = scrape(r.metrics_port, timeout=2)
            except Exception:
                continue
            for name, _labels, value in REDELIVERY_METRIC_RE.findall(text):
                out[name] = out.get(name, 0) + float(value)
        return out

    def ids(self, home_db, sql):
        """Rows of `sql` in `home_db` as a list of '|'-split tuples."""
        out = self.pg_of(home_db).psql(home_db, sql, timeout=120)
        return [ln.split("|") for ln in out.splitlines() if ln]


# -- building blocks ----------------------------------------------------------


def _need(tool, package):
    if not os.access(tool, os.X_OK):
        raise TopologyError(f"{tool} is missing (Debian package {package})")


def build_pair(which):
    """The `which` ("orders" or "billing") database on a primary with an
    asynchronous streaming standby; the services dial a movable address."""
    def build(run):
        from .pg import PG_BIN
        _need(os.path.join(PG_BIN, "pg_basebackup"), "postgresql-15")
        pair = StandbyPair(run.suite.root, run.suite.ploop, run.suite.ports,
                           which)
        run.pairs[which] = pair  # stopped by _finish, even half-built
        pair.start()
        db = run.orders_db if which == "orders" else run.billing_db
        run.homes[db] = Home(lambda: pair.current, pair.address.port)
        pair.start_standby()
        run.log(f"{which}: primary {pair.primary}, asynchronous standby "
                f"{pair.standby} streaming through :{pair.link.port} (slot "
                f"{which}_standby), timeline {pair.standby.timeline()}; "
                f"services dial :{pair.address.port}")
    return build


def build_bouncer(mode, services=True, pool_size=TRANSACTION_POOL):
    """PgBouncer in front of the suite's server (both databases). With
    `services`, every service dials it; else it is only there to be
    refused (pgbouncer-statement)."""
    def build(run):
        _need("/usr/sbin/pgbouncer", "pgbouncer")
        run.bouncer = PgBouncer(f"pgbouncer-{mode}", run.suite.pg.port,
                                run.suite.ports, mode, pool_size).start()
        if services:
            for db in (run.orders_db, run.billing_db):
                run.homes[db] = Home(lambda: run.suite.pg, run.bouncer.port)
        run.log(f"PgBouncer {mode} mode on :{run.bouncer.port} in front of "
                f":{run.suite.pg.port}, default_pool_size {pool_size}"
                + (", every service through it" if services else ""))
    return build


def build_own_server(run):
    """Both databases on a server of the scenario's own (so that freezing
    it hits no other scenario's and not the suite's)."""
    c = Cluster(run.suite.root, "hung-db", run.suite.ports)
    run.clusters.append(c)
    c.initdb().start()
    for db in (run.orders_db, run.billing_db):
        run.homes[db] = Home(lambda: c)
    run.log(f"both databases on a server of their own, {c}")


def inbox_ids(run):
    return {r[0] for r in run.ids(run.billing_db,
                                  "SELECT event_id FROM inbox")}


# -- failover -----------------------------------------------------------------


def failover(which):
    """Under load: replication from the `which` database's primary is cut
    (its link blackholed) for 2.5-3.5 s, so the asynchronous standby falls
    behind; the primary dies (pg_ctl stop -m immediate); the standby is
    promoted (timeline 2) and the services' address moves to it, their
    connections reset. The load continues on the new primary."""
    def inject(run):
        pair = run.pairs[which]
        db = run.orders_db if which == "orders" else run.billing_db
        lead = min(6.0, max(3.0, 0.3 * run.seconds))
        run.sleep(lead)
        cut = run.rng.uniform(*CUT_SECONDS)
        pair.cut_replication()
        run.faults += 1
        t_cut = time.monotonic()
        run.log(f"{which}: replication cut (standby link blackholed) for "
                f"{cut:.1f}s")
        run.hold(cut)
        # No query in between: the cut is what the primary's last commits
        # miss; what the standby lacked is read back after the run.
        t = time.monotonic()
        f = {"cut_seconds": round(t - t_cut, 2)}
        pair.crash_primary()
        run.faults += 1
        run.log(f"{which}: primary stopped -m immediate after "
                f"{f['cut_seconds']:.1f}s without replication")
        old_tli, new_tli = pair.promote()
        f["promote_seconds"] = round(time.monotonic() - t, 2)
        f["timelines"] = [old_tli, new_tli]
        run.log(f"{which}: standby promoted in {f['promote_seconds']:.1f}s: "
                f"timeline {old_tli} -> {new_tli}")
        if which == "billing":
            # what the new primary has before anyone writes to it
            run.truth["promoted_inbox"] = inbox_ids(run)
        else:
            run.topo["promoted_max_seq"] = int(pair.current.psql(
                db, "SELECT coalesce(max(seq), 0) FROM outbox").strip())
        n = pair.move_address()
        f["address_moved_after_seconds"] = round(time.monotonic() - t, 2)
        run.log(f"{which}: services' address :{pair.address.port} moved to "
                f"the new primary {pair.current}; {n} connections reset")
        run.topo["failover"] = f
        while run.sleep(0.5):
            pass
    return inject


def read_truth(which):
    """Before the checker: the old primary started again alone, on a port
    nobody else knows, to read what it had (the truth of what the
    failover lost)."""
    def before(run):
        pair = run.pairs[which]
        if pair.old is None:
            raise HarnessError(f"{which}: no failover happened (the window "
                               "was too short?)")
        if which == "orders":
            got = pair.read_old_primary({"outbox": (
                run.orders_db, run.outbox_rows_sql())}, run.suite.ports)
            run.truth["old_outbox"] = {
                ln.split("|")[0]: ln.split("|")[1:]
                for ln in got["outbox"].splitlines() if ln}
        else:
            got = pair.read_old_primary({"inbox": (
                run.billing_db, "SELECT event_id FROM inbox")},
                run.suite.ports)
            run.truth["old_inbox"] = {ln for ln in got["inbox"].splitlines()
                                     if ln}
        run.log(f"{which}: old primary read back (alone, on its own port) "
                "and stopped again")
    return before


def lines_saying(proc, pattern):
    """The lines of `proc`'s log (every incarnation) that match `pattern`."""
    try:
        with open(proc.log_path, errors="replace") as f:
            return [ln for ln in f.read().splitlines() if pattern.search(ln)]
    except OSError:
        return []


def failover_lines(proc, old_tli, new_tli):
    """The lines of `proc`'s log (every incarnation) that say 'failover'
    and name both timelines, at level error (or without a level we can
    read); and the lines that say 'failover' at all."""
    good, any_ = [], lines_saying(proc, FAILOVER_RE)
    for ln in any_:
        m = LEVEL_RE.search(ln)
        level = (m.group(1) or m.group(2)).lower() if m else None
        if level is not None and level not in ("error", "critical", "err",
                                                "crit", "fatal"):
            continue
        nums = set(NUMBER_RE.findall(ln))
        if TIMELINE_RE.search(ln) and str(old_tli) in nums and \
                str(new_tli) in nums:
            good.append(ln)
    return good, any_


def check_failover_noticed(run, kinds):
    """Every process of `kinds` logged that its database failed over,
    naming the old and the new timeline."""
    bad = []
    f = run.topo.get("failover", {})
    old_tli, new_tli = (f.get("timelines") or [1, 2])
    noticed, silent = [], []
    for p in run.sup.procs:
        if p.kind not in kinds:
            continue
        good, any_ = failover_lines(p, old_tli, new_tli)
        if good:
            noticed.append(p.name)
        else:
            silent.append(p.name)
            bad.append(
                f"failover not noticed: {p.name} logged no error saying "
                f"'failover' with timelines {old_tli} and {new_tli}"
                + (f" (it said: {any_[0][-160:]!r})" if any_ else ""))
    run.topo["failover_noticed_by"] = noticed
    run.note("failover noticed by: " + (", ".join(noticed) or "nobody")
             + (f" (silent: {', '.join(silent)})" if silent else ""))
    return bad


def check_reconcile(run, report, name="reconcile.json"):
    rc, rep = run.reconcile(name)
    run.topo["reconcile"] = {k: rep.get(k) for k in (
        "events", "applied", "pending", "behind_dead", "dead", "held",
        "lost")}
    if rc != 0:
        return [f"reconcile: exit {rc}, not applied: "
                + ", ".join(f"{k} {rep.get(k)}" for k in (
                    "pending", "behind_dead", "dead", "held", "lost")
                    if rep.get(k))]
    return []


def healed(run, lost, since, what):
    """How the events `lost` (applied, then gone with the database) came
    back: how many are in the inbox again, and the last one's applied_at
    since `since` (wall clock). Returns violations."""
    bad = []
    if not lost:
        run.note(f"healed: the {what} lost no applied event (nothing to "
                 "redeliver)")
        run.topo["healed"] = {"lost": 0}
        return bad
    rows = run.ids(run.billing_db, "SELECT event_id, extract(epoch FROM "
                   "applied_at) FROM inbox")
    applied_at = {r[0]: float(r[1]) for r in rows}
    back = [applied_at[e] for e in lost if e in applied_at]
    missing = len(lost) - len(back)
    took = (max(back) - since) if back else None
    metrics = run.relay_metrics()
    run.topo["healed"] = {"lost": len(lost), "redelivered": len(back),
                          "missing": missing,
                          "seconds": round(took, 1) if took is not None
                          else None, "relay_metrics": metrics}
    run.note(f"healed: {len(back)} events"
             + (f" in {took:.1f}s" if took is not None else "")
             + f" (of {len(lost)} applied events lost with the {what}; from "
             "the new database taking over to the last one applied again)"
             + (" (relay counters: " + ", ".join(
                 f"{k} {v:g}" for k, v in sorted(metrics.items())) + ")"
                if metrics else ""))
    if missing:
        bad.append(f"not healed: {missing} of {len(lost)} events applied "
                   f"before the {what} and lost with it were never applied "
                   "again")
    return bad


def check_failover_billing(run, report):
    bad = check_reconcile(run, report)
    bad += check_failover_noticed(run, ("consumer", "relay"))
    old = run.truth.get("old_inbox", set())
    promoted = run.truth.get("promoted_inbox", set())
    lost = old - promoted
    run.topo["failover"]["applied_only_on_old_primary"] = len(lost)
    run.note(f"billing failover: {len(lost)} applied events existed only "
             f"on the old primary; held peak {run.sampler.held_peak}")
    pair = run.pairs["billing"]
    bad += healed(run, lost, pair.moved_at, "failover")
    return bad


# -- failover-orders: the operator's part -------------------------------------


def divergence(run):
    """Events the consumer applied whose event the (new) producer database
    does not hold: those only the old primary had (what a lossy failover
    leaves behind, to be listed for an operator) and any other (a
    phantom). Also how many events only the old primary had, and how many
    seqs the new primary handed out again."""
    old = run.truth.get("old_outbox", {})
    new = {r[0]: r[1:] for r in run.ids(run.orders_db, run.outbox_rows_sql())}
    inbox = run.ids(run.billing_db, "SELECT event_id, aggregate_id FROM inbox")
    only_old = {e: v for e, v in old.items() if e not in new}
    # every aggregate id either database knows: tells an aggregate's id
    # from an event's in a listing of any format
    known = ({a for _, a in inbox} | {v[1] for v in new.values()}
             | {v[1] for v in old.values()})
    applied = [(e, a) for e, a in inbox if e not in new]
    diverged = {(e, a) for e, a in applied if e in only_old}
    phantoms = [(e, a) for e, a in applied if e not in only_old]
    old_seqs = {int(v[0]) for v in only_old.values()}
    reused = sum(1 for v in new.values() if int(v[0]) in old_seqs)
    return {"only_old": only_old, "diverged": diverged, "phantoms": phantoms,
            "reused_seqs": reused, "aggregates": known}


def wait_drained_except(run, aggregates, bound):
    """Waits (at most `bound` s) until nothing is pending or held outside
    `aggregates`: the failover's divergent aggregates may wait for an
    operator, the rest may not. True when drained."""
    lst = ",".join(f"'{a}'" for a in sorted(aggregates)) or "''"
    deadline = time.monotonic() + bound
    while True:
        try:
            pend = int(run.sql_orders(
                "SELECT count(*) FROM outbox_deliveries WHERE subscription = "
                f"'billing' AND status = 'pending' AND aggregate_id NOT IN "
                f"({lst})").strip())
            held = int(run.sql_billing(
                f"SELECT count(*) FROM held_events WHERE aggregate_id NOT IN "
                f"({lst})").strip())
        except (SqlError, ValueError):
            pend = held = -1
        if pend == 0 and held == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def orders_listing(run):
    """failover-orders, before the checker: the truth of what the failover
    lost, then lost_commits_listing."""
    read_truth("orders")(run)
    lost_commits_listing(run)


def lost_commits_listing(run):
    """After the orders database lost commits (run.truth["old_outbox"]:
    what it held before): verify and reconcile must list every effect
    whose event the producer no longer has (exit non-zero); then the
    operator resolves each listed divergence (outboxctl diverged / resolve,
    once outboxctl has them), after which the checker must find everything
    clean."""
    d = divergence(run)
    run.truth["divergence"] = d
    aggs = {a for _, a in d["diverged"]}
    only_old_aggs = {v[1] for v in d["only_old"].values()}
    run.note(f"orders lost commits: {len(d['only_old'])} events (of "
             f"{len(only_old_aggs)} orders) existed only in the lost database "
             "(the old primary, or the one the restore replaced); "
             f"the consumer had applied {len(d['diverged'])} of them (of "
             f"{len(aggs)} orders); the database handed out "
             f"{d['reused_seqs']} of their seqs again")
    bad = []
    bound = 120  # the I5 bound's base (README "Guarantees")
    if not wait_drained_except(run, aggs, bound):
        bad.append("I5 liveness: events of orders the failover did not "
                   f"touch not drained within {bound}s")
    if d["phantoms"]:
        e, a = d["phantoms"][0]
        bad.append(f"I4 phantom: {len(d['phantoms'])} applied events neither "
                   f"database ever held (e.g. {e} of {a})")
    commands = run.outboxctl_commands()
    listed, more = list_divergences(run, d, aggs, commands)
    bad += more
    if aggs:
        if re.search(r"\bresolve\b", commands):
            # `outboxctl diverged` listed them all: the operator resolves
            # every one with one command, when outboxctl has it.
            at_once = ("--parallel" in commands and listed == aggs
                       and len(listed) <= RESOLVE_MAX)
            bad += resolve_divergences(run, sorted(listed)[:RESOLVE_MAX],
                                       at_once)
        else:
            bad.append(f"operator: {len(aggs)} diverged orders cannot be "
                       "resolved: outboxctl has no `resolve` command")
    run.listing_violations = bad


def list_divergences(run, d, aggs, commands):
    """verify (--wait=0s) and reconcile, and `outboxctl diverged` when it
    exists: each must say what diverged. Returns (the orders listed for
    the operator, violations)."""
    bad = []
    # As an operator would: verify again while it says a heal is due (a
    # relay has yet to compare the consumer with the outbox, so not every
    # divergence is recorded), then list.
    bound, t0 = HEAL_BOUND, time.monotonic()
    while True:
        rc_v, out_v, err_v = run.outboxctl(
            ["verify"] + run.db_flags() + ["--wait=0s", "--format=json"],
            name="verify-listing.json")
        try:
            heal_due = json.loads(out_v).get("heal_due")
        except ValueError:
            heal_due = None
        if heal_due is None and rc_v not in (0, 1):
            bad.append(f"verify exited {rc_v}: "
                       f"{(err_v or out_v).strip()[-200:]}")
        if not heal_due or time.monotonic() - t0 > bound:
            break
        time.sleep(1)
    run.topo["heal_wait_s"] = round(time.monotonic() - t0, 1)
    if heal_due:
        bad.append(f"heal not done: verify still said a heal is due after "
                   f"{bound}s ({heal_due[:160]})")
    elif run.topo["heal_wait_s"] >= 1:
        run.note(f"verify said a heal was due; done after "
                 f"{run.topo['heal_wait_s']}s")
    rc_r, out_r, err_r = run.outboxctl(
        ["reconcile"] + run.db_flags() +
        [f"--window={int(run.t()) + 120}s", f"--grace={RECONCILE_GRACE}",
         "--limit=1000", "--format=json"], name="reconcile-listing.json")
    text = out_v + err_v + out_r + err_r
    has_diverged = re.search(r"\bdiverged\b", commands) is not None
    diverged = None
    if has_diverged:
        rc_d, out_d, err_d = run.outboxctl(
            ["diverged", "--limit=10000"] + run.relay_admin_flags(),
            name="diverged.txt")
        text += out_d + err_d
        diverged = set(UUID_RE.findall(out_d)) & d["aggregates"]
        if rc_d not in (0, 1):
            bad.append(f"outboxctl diverged exited {rc_d}: "
                       f"{(err_d or out_d).strip()[-200:]}")
    named = set(UUID_RE.findall(text)) & d["aggregates"]
    unlisted = sorted(aggs - named)
    if aggs and rc_v == 0:
        bad.append(f"not listed: verify exited 0 although the consumer "
                   f"applied {len(d['diverged'])} events of {len(aggs)} "
                   "orders that the producer's database no longer holds")
    if unlisted:
        bad.append(f"not listed for an operator: {len(unlisted)} of "
                   f"{len(aggs)} orders whose applied events only the old "
                   "primary had are named by neither verify, reconcile nor "
                   "outboxctl diverged (e.g. " + ", ".join(unlisted[:3])
                   + ")")
    run.topo["listing"] = {"diverged_orders": len(aggs),
                           "named": len(aggs & named),
                           "verify_rc": rc_v, "reconcile_rc": rc_r,
                           "diverged_command": has_diverged}
    run.note("listed for an operator: "
             + (f"{len(aggs & named)} of {len(aggs)} diverged orders named "
                f"(verify exit {rc_v}, reconcile exit {rc_r}"
                + (f", outboxctl diverged {len(diverged)} orders"
                   if has_diverged else ", no outboxctl diverged") + ")"
                if aggs else "nothing diverged"))
    return (diverged if diverged is not None else named), bad


# The first line outboxctl prints of a divergence: [TYPE ]AGGREGATE  KIND
RESOLVED_RE = re.compile(r"^(?:\S+ )?(" + UUID_RE.pattern[2:-2] + r")  \S",
                         re.M)


def resolve_divergences(run, todo, at_once=False):
    """The operator's part: `outboxctl resolve --aggregate ID --reason TEXT
    --relay HOST:PORT` for each listed order, four at a time, within
    max(120 s, 0.25 s an order); or, `at_once`, `outboxctl resolve --all
    --parallel=4`, which must close exactly those. Returns violations."""
    from concurrent.futures import ThreadPoolExecutor
    reason = (f"chaos {run.name}: effects applied from the old primary, "
              "whose events the failover lost")
    bound = max(120.0, 0.25 * len(todo))
    if at_once:
        return resolve_all(run, todo, reason, bound)
    deadline = time.monotonic() + bound
    failed = []

    def one(a):
        if time.monotonic() > deadline or failed:
            return None
        rc, out, err = run.outboxctl(
            ["resolve", f"--aggregate={a}", f"--reason={reason}"]
            + run.relay_admin_flags(), timeout=30)
        if rc != 0:
            failed.append(f"outboxctl resolve --aggregate {a} exited {rc}: "
                          f"{(err or out).strip()[-200:]}")
        return rc == 0

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, todo))
    resolved = sum(1 for r in results if r)
    bad = failed[:1]
    if not failed and resolved < len(todo):
        bad.append(f"resolve: {len(todo) - resolved} orders left unresolved "
                   f"after {bound:.0f}s")
    run.topo["listing"]["resolved"] = resolved
    run.note(f"operator: resolved {resolved} of {len(todo)} listed orders "
             "with outboxctl resolve")
    return bad


def resolve_all(run, todo, reason, bound):
    """resolve_divergences with one `outboxctl resolve --all`."""
    t0 = time.monotonic()
    try:
        rc, out, err = run.outboxctl(
            ["resolve", "--all", "--parallel=4", f"--reason={reason}"]
            + run.relay_admin_flags(), timeout=bound, name="resolve-all.txt")
    except HarnessError as e:
        return [f"resolve --all: {e}"]
    closed = set(RESOLVED_RE.findall(out))
    resolved = len(closed & set(todo))
    bad = []
    if rc != 0:
        bad.append(f"outboxctl resolve --all exited {rc}: "
                   f"{(err or out).strip()[-200:]}")
    extra = sorted(closed - set(todo))
    if extra:
        bad.append(f"resolve --all closed {len(extra)} divergences of orders "
                   "the failover did not touch (e.g. " + ", ".join(extra[:3])
                   + ")")
    if resolved < len(todo):
        bad.append(f"resolve --all: {len(todo) - resolved} of {len(todo)} "
                   "listed orders left unresolved")
    run.topo["listing"]["resolved"] = resolved
    run.note(f"operator: resolved {resolved} of {len(todo)} listed orders "
             f"with outboxctl resolve --all in {time.monotonic() - t0:.1f}s")
    return bad


def check_failover_orders(run, report):
    bad = list(run.listing_violations)
    bad += check_reconcile(run, report)
    bad += check_failover_noticed(run, ("producer", "relay"))
    d = run.truth.get("divergence")
    if d:
        run.topo["failover"]["only_on_old_primary"] = len(d["only_old"])
        run.topo["failover"]["applied_only_on_old_primary"] = len(
            d["diverged"])
        run.topo["failover"]["seqs_handed_out_again"] = d["reused_seqs"]
    return bad


# -- restore-billing ----------------------------------------------------------


def restore_billing(run):
    """Under load: pg_dump -Fc of the billing database; 3-4.5 s later, as
    an operator restoring that backup: DROP DATABASE ... WITH (FORCE),
    CREATE DATABASE, pg_restore (one transaction). The services keep
    running and reconnect."""
    db = run.billing_db
    server = run.pg_of(db)
    path = os.path.join(run.workdir, "billing.dump")
    run.sleep(min(5.0, max(2.0, 0.25 * run.seconds)))
    t = time.monotonic()
    size = dump(server, db, path)
    run.faults += 1
    run.topo["dump"] = {"bytes": size, "seconds": round(time.monotonic() - t,
                                                         2)}
    run.log(f"billing: pg_dump -Fc under load: {size} bytes in "
            f"{time.monotonic() - t:.1f}s")
    run.sleep(run.rng.uniform(*RESTORE_AFTER))
    run.log("billing: restoring the dump: DROP DATABASE ... WITH (FORCE), "
            "CREATE DATABASE, pg_restore --single-transaction")
    took, rows = replace_from_dump(server, db, path, snapshot=(
        "inbox", "SELECT event_id FROM inbox"))
    before = set(rows)
    run.faults += 1
    run.topo["restored_at"] = time.time()
    run.topo["restore"] = {"seconds": round(took, 2),
                           "inbox_before": len(before)}
    run.truth["inbox_before_restore"] = before
    run.log(f"billing: restored from the dump in {took:.1f}s (the dropped "
            f"database held {len(before)} inbox rows)")
    while run.sleep(0.5):
        pass


def check_restore_billing(run, report):
    bad = check_reconcile(run, report)
    before = run.truth.get("inbox_before_restore", set())
    # What the dump held: restored into a scratch database of its own.
    scratch = f"{run.billing_db}_dump"
    server = run.pg_of(run.billing_db)
    server.drop_db(scratch)
    server.create_db(scratch)
    try:
        restore(server, scratch, os.path.join(run.workdir, "billing.dump"))
        in_dump = {ln for ln in server.psql(
            scratch, "SELECT event_id FROM inbox", timeout=60).splitlines()
            if ln}
    finally:
        server.drop_db(scratch)
    lost = before - in_dump
    run.topo["restore"]["applied_after_dump"] = len(lost)
    run.note(f"restore: the dump held {len(in_dump)} applied events; "
             f"{len(lost)} applied after it were gone with the restore; held "
             f"peak {run.sampler.held_peak}")
    bad += healed(run, lost, run.topo.get("restored_at"), "restore")
    return bad


# -- restore-orders -----------------------------------------------------------


def build_restore_pair(run):
    """The orders database on a server whose transaction ids were moved
    AGE_XIDS ahead, and an empty server beside it (initdb): the one its dump
    is restored into. The services dial a movable address."""
    pair = StandbyPair(run.suite.root, run.suite.ploop, run.suite.ports,
                       "orders")
    run.pairs["orders"] = pair  # stopped by _finish, even half-built
    pair.start()
    pair.primary.psql("postgres", "DO $$ BEGIN FOR i IN 1..%d LOOP PERFORM "
                      "txid_current(); COMMIT; END LOOP; END $$" % AGE_XIDS,
                      timeout=120)
    run.homes[run.orders_db] = Home(lambda: pair.current, pair.address.port)
    pair.start_spare()
    run.log(f"orders: on {pair.primary} (aged by {AGE_XIDS} transaction "
            f"ids), an empty server {pair.standby} beside it; services dial "
            f":{pair.address.port}")


def restore_orders(in_place):
    """Under load: pg_dump -Fc of the orders database; 1.5-2.5 s later the
    relays go down (one frozen, one killed and held down) and, as an
    operator restoring that backup: with `in_place`, DROP DATABASE ...
    WITH (FORCE), CREATE DATABASE and pg_restore on the same server; else
    its server is lost (pg_ctl stop -m immediate), the dump is restored
    into a new server, whose transaction ids lie behind the dump's, and the
    services' address moves there. The relays come back after the producer
    has written alone for 2-3 s: on a new server, its events carry
    transaction ids below every snapshot of the restored log. The commits
    after the dump are gone, as in a lossy failover."""
    def inject(run):
        db = run.orders_db
        pair = run.pairs.get("orders")
        server = run.pg_of(db) if in_place else pair.primary
        path = os.path.join(run.workdir, "orders.dump")
        run.sleep(min(5.0, max(2.0, 0.25 * run.seconds)))
        t = time.monotonic()
        size = dump(server, db, path)
        run.faults += 1
        run.topo["dump"] = {"bytes": size,
                            "seconds": round(time.monotonic() - t, 2)}
        run.log(f"orders: pg_dump -Fc under load: {size} bytes in "
                f"{time.monotonic() - t:.1f}s")
        run.sleep(run.rng.uniform(*LOST_AFTER_DUMP))
        if not in_place:
            old_xid = int(server.psql("postgres",
                                      "SELECT txid_current()").strip())
        relays = [p for p in run.sup.procs if p.kind == "relay"]
        for i, p in enumerate(relays):
            if i % 2 == 0:
                run.sup.pause(p)
            else:
                run.sup.kill(p, signal.SIGKILL, down=600.0)
        run.faults += 1
        t = time.monotonic()
        if in_place:
            run.log(f"orders: relays {', '.join(p.name for p in relays)} "
                    "down (frozen / killed); restoring the dump: DROP "
                    "DATABASE ... WITH (FORCE), CREATE DATABASE, pg_restore")
            took, rows = replace_from_dump(server, db, path, snapshot=(
                "outbox", run.outbox_rows_sql()))
            # What the dropped database held: the truth of what was lost.
            run.truth["old_outbox"] = {
                r.split("\t")[0]: r.split("\t")[1:] for r in rows if r}
            identity = server.psql("postgres", "SELECT oid FROM pg_database "
                                   f"WHERE datname = '{db}'").strip()
            run.topo["restore"] = {"seconds": round(took, 2),
                                   "outbox_before": len(rows),
                                   "database_oid": identity}
            run.log(f"orders: restored in {took:.1f}s (the dropped database "
                    f"held {len(rows)} events; new database oid {identity})")
        else:
            pair.crash_primary()
            run.faults += 1
            run.log(f"orders: relays {', '.join(p.name for p in relays)} "
                    "down (frozen / killed); its server stopped -m immediate "
                    f"(transaction id {old_xid}); restoring the dump into "
                    f"{pair.standby}")
            pair.standby.create_db(db)
            restore(pair.standby, db, path)
            new_xid = int(pair.standby.psql(
                "postgres", "SELECT txid_current()").strip())
            pair.replace_primary()
            n = pair.move_address()
            identity = pair.current.system_identifier()
            run.topo["restore"] = {"seconds": round(time.monotonic() - t, 2),
                                   "old_xid": old_xid, "new_xid": new_xid,
                                   "connections_reset": n,
                                   "system_identifier": identity}
            run.log(f"orders: restored in {time.monotonic() - t:.1f}s "
                    f"(transaction id {new_xid}); services' address "
                    f":{pair.address.port} moved to {pair.current}; {n} "
                    "connections reset")
        run.faults += 1
        run.truth["restored_identity"] = identity
        run.topo["restored_max_seq"] = int(run.pg_of(db).psql(
            db, "SELECT coalesce(max(seq), 0) FROM outbox").strip())
        alone = run.rng.uniform(*RELAYS_BACK_AFTER)
        run.hold(alone)
        run.sup.heal()  # the frozen relay thaws, the killed one starts
        run.topo["restore"]["producer_alone_seconds"] = round(alone, 2)
        run.log(f"orders: relays back after the producer wrote {alone:.1f}s "
                "to the restored database alone")
        while run.sleep(0.5):
            pass
    return inject


def check_restore_noticed(run):
    """Every producer, and a relay, logged that the orders database is
    another now, naming the new server's system identifier or the new
    database's oid (a relay that starts after another recorded it has
    nothing to notice); into a new server on the outbox log, a relay logged
    the rebase (the ids went behind)."""
    bad = []
    system = run.truth["restored_identity"]
    noticed, silent = [], []
    for p in run.sup.procs:
        if p.kind not in ("producer", "relay"):
            continue
        if any(system in NUMBER_RE.findall(ln) for ln in
               lines_saying(p, FAILOVER_RE)):
            noticed.append(p.name)
        else:
            silent.append(p.name)
    by_kind = {k: [p for p in run.sup.procs if p.kind == k]
               for k in ("producer", "relay")}
    bad += [f"restore not noticed: {p.name} logged nothing naming the new "
            f"database ({system})"
            for p in by_kind["producer"] if p.name in silent]
    if not any(p.name in noticed for p in by_kind["relay"]):
        bad.append(f"restore not noticed: no relay logged the new database "
                   f"({system})")
    rebased = [p.name for p in run.sup.procs if p.kind == "relay"
               and lines_saying(p, REBASE_RE)]
    on_log = run.scn.relay_flags.get("log_delivery", "true") != "false"
    if on_log and "orders" in run.pairs and not rebased:
        bad.append("rebase not noticed: no relay logged that the outbox's "
                   "transaction ids lie behind its log's")
    run.note("restored database noticed by " + (", ".join(noticed) or "nobody")
             + (f" (not by {', '.join(silent)})" if silent else "")
             + (f"; log rebased by {', '.join(rebased)}" if rebased else
                "; no rebase logged"))
    return bad


def check_restore_orders(run, report):
    bad = list(run.listing_violations)
    bad += check_reconcile(run, report)
    bad += check_restore_noticed(run)
    d = run.truth.get("divergence")
    if d:
        run.topo["restore"]["only_on_old_server"] = len(d["only_old"])
        run.topo["restore"]["applied_only_on_old_server"] = len(d["diverged"])
        run.topo["restore"]["seqs_handed_out_again"] = d["reused_seqs"]
    return bad


# -- PgBouncer ----------------------------------------------------------------


def kill_relays_now_and_then(run):
    """Behind the pooler: one relay or the other SIGKILLed every 2-4 s and
    kept down 0.5-1.5 s (its partitions change hands; a pooler's server
    connection it held goes back to the pool)."""
    if run.scn.name.startswith("pgbouncer-transaction"):
        run.leak_sampler = LeakSampler(run, run.bouncer).start()
    while run.sleep(run.rng.uniform(2.0, 4.0)):
        run.kill(run.rng.choice(run.relays), signal.SIGKILL,
                 run.rng.uniform(0.5, 1.5))
    if run.leak_sampler is not None:
        run.leak_sampler.stop()


# The settings a service sets in its sessions, and what a backend a client
# got from the pooler may carry of another's session.
LEAK_SQL = ("SELECT pg_backend_pid(), current_setting('synchronous_commit'), "
            "current_setting('statement_timeout'), "
            "current_setting('lock_timeout'), "
            "current_setting('idle_in_transaction_session_timeout'), "
            "current_setting('plan_cache_mode'), current_setting('jit'), "
            "(SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND "
            "locktype = 'advisory'), "
            "(SELECT count(*) FROM pg_listening_channels()), "
            "(SELECT count(*) FROM pg_prepared_statements)")
LEAK_FIELDS = ("synchronous_commit", "statement_timeout", "lock_timeout",
               "idle_in_transaction_session_timeout", "plan_cache_mode",
               "jit", "advisory locks", "LISTEN channels", "prepared statements")


class LeakSampler:
    """From a client of its own, through the pooler, runs SHOW (as
    current_setting) of the settings the services set, and counts the
    session state a backend carries (advisory locks, LISTEN, prepared
    statements), LEAK_BATCH times per pooler session, every 0.25 s, on
    both databases. Each backend it gets should look like a fresh session;
    anything else was left behind by another client."""

    def __init__(self, run, bouncer):
        self.run = run
        self.bouncer = bouncer
        self.samples = 0
        self.failures = 0
        self.backends = set()
        self.leaks = {}      # setting -> samples that carried another value
        self.leak_values = {}    # setting -> {values seen}
        self.leak_backends = {}  # setting -> {(db, pid)}
        self.first = {}      # setting -> t of the first such sample
        self._stop = threading.Event()
        self._threads = []
        self.defaults = {db: self._defaults(db)
                         for db in (run.orders_db, run.billing_db)}

    def _defaults(self, db):
        """What a fresh session of `db` shows (the server's, the database's
        and the role's settings; no advisory lock, LISTEN or prepared
        statement): the same query on a direct session with no option of
        ours, so that values compare as printed."""
        out = self.run.pg_of(db).psql(db, LEAK_SQL, timeout=10, options="",
                                      app="chaos-leak-defaults")
        f = out.strip().split("|")
        if len(f) != 1 + len(LEAK_FIELDS):
            raise HarnessError(f"leak sampler: unexpected {out.strip()!r}")
        return dict(zip(LEAK_FIELDS, f[1:]))

    def start(self):
        for db in (self.run.orders_db, self.run.billing_db):
            t = threading.Thread(target=self._loop, args=(db,),
                                 name=f"leaks-{db}", daemon=True)
            self._threads.append(t)
            t.start()
        self.run.log("leak sampler: SHOW synchronous_commit, statement_timeout"
                     ", lock_timeout, ... through the pooler, "
                     f"{LEAK_BATCH} per session every 0.25s, both databases")
        return self

    def _loop(self, db):
        script = ";\n".join([LEAK_SQL] * LEAK_BATCH) + ";\n"
        while not self._stop.wait(0.25):
            try:
                out = self.bouncer.psql(db, script, timeout=10,
                                        app="chaos-leak-sampler")
            except SqlError:
                self.failures += 1
                continue
            t = self.run.t()
            for ln in out.splitlines():
                f = ln.split("|")
                if len(f) != 1 + len(LEAK_FIELDS):
                    continue
                self.samples += 1
                pid = f[0]
                self.backends.add((db, pid))
                for name, value in zip(LEAK_FIELDS, f[1:]):
                    want = self.defaults[db].get(name, "0")
                    if value == want:
                        continue
                    self.leaks[name] = self.leaks.get(name, 0) + 1
                    self.leak_values.setdefault(name, set()).add(value)
                    self.leak_backends.setdefault(name, set()).add((db, pid))
                    self.first.setdefault(name, t)

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)
        self._threads = []


def check_pgbouncer(run, report):
    b = run.bouncer
    if b.popen is None or b.popen.poll() is not None:
        raise HarnessError(f"pgbouncer exited during the scenario: "
                           f"{b.log_tail(3)}")
    bad = check_reconcile(run, report)
    try:
        pools = b.admin("SHOW POOLS")
        with open(os.path.join(run.workdir, "pgbouncer-pools.txt"), "w") as f:
            f.write(pools + "\n" + b.admin("SHOW SERVERS") + "\n"
                    + b.admin("SHOW CLIENTS"))
    except SqlError:
        pass
    run.note(f"behind PgBouncer ({b.pool_mode}, default_pool_size "
             f"{b.pool_size}): {report.get('applied')} of "
             f"{report.get('events')} events applied, relays killed "
             f"{run.faults} times")
    s = run.leak_sampler
    if s is not None:
        run.topo["leaks"] = {"samples": s.samples,
                             "backends": len(s.backends),
                             "failed_sessions": s.failures,
                             "defaults": s.defaults,
                             "seen": {k: {"samples": n, "backends": len(
                                 s.leak_backends[k]),
                                 "values": sorted(s.leak_values[k]),
                                 "first_t": round(s.first[k], 1)}
                                 for k, n in s.leaks.items()}}
        if s.samples == 0:
            # the pooler ran, yet no session of the sampler got a backend
            # (each waits up to query_wait_timeout): the services held
            # every one of them
            bad.append(f"pooler: the leak sampler got no backend through "
                       f"PgBouncer in {s.failures} sessions (pool of "
                       f"{b.pool_size} held by the services?)")
        elif s.leaks:
            seen = "; ".join(
                f"{k} {'/'.join(sorted(s.leak_values[k])[:4])} ({n} samples, "
                f"{len(s.leak_backends[k])} backends)"
                for k, n in sorted(s.leaks.items()))
            run.note(f"leaks seen: {seen} in {s.samples} samples of "
                     f"{len(s.backends)} backends")
            bad.append(f"session state leaked through the pooler: {seen}")
        else:
            run.note(f"leaks seen: none in {s.samples} samples of "
                     f"{len(s.backends)} backends")
    else:
        run.note(f"leaks seen: not sampled ({b.pool_mode} mode: each client "
                 "keeps its backend)")
    return bad


def statement_refusals(run):
    """The services run on direct connections under the usual load; one
    more of each binary is started against PgBouncer in statement mode
    (where a transaction of more than one statement cannot work) and must
    refuse to start: exit non-zero within REFUSAL_BOUND s, with a message
    that names the pooler and the mode."""
    run.sleep(1.0)
    b = run.bouncer
    started = []
    for kind in ("producer", "relay", "consumer"):
        name = f"{kind}-via-statement-pooler"
        port, mport = run.suite.ports.take(), run.suite.ports.take()
        db = run.billing_db if kind == "consumer" else run.orders_db
        argv = [os.path.join(run.suite.bin, f"outbox-{kind}"),
                f"--listen=127.0.0.1:{port}", f"--db={b.url(db)}",
                f"--metrics_listen=127.0.0.1:{mport}",
                f"--shutdown_timeout={SHUTDOWN_TIMEOUT:g}s"]
        if run.certs:
            argv += run.certs.server_flags(kind)
        if kind == "relay":
            argv += [f"--consumer=127.0.0.1:{run.consumers[0].listen_port}",
                     f"--ack_timeout={ACK_TIMEOUT:g}s"]
            if run.certs:
                argv += run.certs.relay_client_flags()
        log_path = os.path.join(run.workdir, f"{name}.log")
        with open(log_path, "wb") as log:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT,
                                 env=P.clean_env({}), start_new_session=True)
        P.track(p)
        started.append((kind, name, p, time.monotonic(), log_path))
        run.faults += 1
        run.log(f"{name}: started against PgBouncer statement mode "
                f"(:{b.port}, pid {p.pid})")
    for kind, name, p, t0, log_path in started:
        exited = P.reap(p, max(0.1, t0 + REFUSAL_BOUND - time.monotonic()))
        took = time.monotonic() - t0
        if not exited:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            P.reap(p, 5)
        with open(log_path, errors="replace") as f:
            text = f.read()
        line = next((ln for ln in text.splitlines() if POOLER_RE.search(ln)
                     and STATEMENT_RE.search(ln)), None)
        r = {"binary": kind, "exited": exited,
             "code": p.returncode if exited else None,
             "seconds": round(took, 1),
             "served": bool(P.READY_RE.search(text)),
             "message": line, "last": (text.strip().splitlines() or [""])[-1]}
        run.refusals.append(r)
        run.log(f"{name}: " + (f"exited {P.signame(p.returncode)} after "
                               f"{took:.1f}s" if exited else
                               f"still running after {REFUSAL_BOUND:g}s; "
                               "killed") +
                (f"; says {line.strip()[-160:]!r}" if line else
                 f"; last line {r['last'][-160:]!r}"))
    while run.sleep(0.5):
        pass


def check_statement(run, report):
    bad = check_reconcile(run, report)
    parts = []
    for r in run.refusals:
        who = f"outbox-{r['binary']}"
        if not r["exited"]:
            bad.append(f"pooler: {who} against PgBouncer statement mode did "
                       f"not refuse to start: still running after "
                       f"{REFUSAL_BOUND:g}s (killed)")
        elif r["code"] == 0:
            bad.append(f"pooler: {who} against PgBouncer statement mode "
                       "exited 0")
        if r["served"]:
            bad.append(f"pooler: {who} served gRPC against PgBouncer "
                       "statement mode before it exited")
        if r["exited"] and not r["message"]:
            bad.append(f"pooler: {who} exited {P.signame(r['code'])} "
                       "without a message naming the pooler and statement "
                       f"mode (last line: {r['last'][-200:]!r})")
        parts.append(f"{r['binary']} " + (
            f"{P.signame(r['code'])} in {r['seconds']:.1f}s" if r["exited"]
            else "kept running") + (" (message names the pooler and mode)"
                                    if r["message"] else ""))
    if len(run.refusals) != 3:
        raise HarnessError("pgbouncer-statement: the binaries against the "
                           "pooler were not all started")
    run.topo["refusals"] = run.refusals
    run.note("statement pooler: " + "; ".join(parts))
    return bad


# -- hung-db ------------------------------------------------------------------


def hung_db(run):
    """Under load: every process of the scenario's own PostgreSQL (both
    databases) SIGSTOPped for FREEZE_SECONDS, then SIGCONT. While it hangs
    the health of the producers and relays (their work needs it) is
    polled."""
    c = run.clusters[0]
    run.sleep(min(4.0, max(2.0, 0.15 * run.seconds)))
    watch = HealthWatch(run, run.producers + run.relays).start() \
        if run.buf() is not None else None
    t = time.monotonic()
    frozen = c.freeze()
    run.faults += 1
    run.log(f"hung-db: {len(frozen)} PostgreSQL processes SIGSTOPped for "
            f"{FREEZE_SECONDS:g}s")
    try:
        run.hold(FREEZE_SECONDS)
    finally:
        c.thaw()
        seen = watch.stop() if watch else None
    run.topo["frozen"] = {"processes": len(frozen),
                          "seconds": round(time.monotonic() - t, 1)}
    run.topo["health_while_frozen"] = seen
    run.log(f"hung-db: SIGCONT after {time.monotonic() - t:.1f}s")
    while run.sleep(0.5):
        pass


def check_hung_db(run, report):
    bad = check_reconcile(run, report) + check_gray(run, report)
    seen = run.topo.get("health_while_frozen")
    if seen is None:
        run.note("health while frozen: not polled (no buf)")
        return bad
    parts = []
    for name, h in sorted(seen.items()):
        parts.append(f"{name} NOT_SERVING {h['not_serving']}, SERVING "
                     f"{h['serving']}, no answer {h['other']} of "
                     f"{h['polls']} polls"
                     + (f", first NOT_SERVING {h['first_not_serving']:.1f}s "
                        "into the freeze"
                        if h["first_not_serving"] is not None else ""))
        if not h["not_serving"]:
            bad.append(f"watchdog: {name} never said NOT_SERVING while the "
                       f"database hung for {FREEZE_SECONDS:g}s "
                       f"(--stall_timeout={HUNG_FLAGS['stall_timeout']})")
    run.note("health while frozen: " + "; ".join(parts))
    return bad


HUNG_FLAGS = {"stall_timeout": "3s"}
# Retention that lets the heal after a promotion run first: events the old
# primary lost carry seqs the new one hands out again, and once retention
# deleted those new events, a lost event's seq lies below what the outbox
# retains and reads as deleted by retention (README "Retention").
FAILOVER_RETENTION_FLAGS = {"retention": "5s", "retention_interval": "500ms"}


SCENARIOS = [
    TopologyScenario(
        "failover-orders",
        "the orders database on a primary + asynchronous standby: "
        "replication cut ~3 s under load, the primary stopped -m immediate, "
        "the standby promoted, the address moved; verify must list what the "
        "consumer applied from the lost commits until an operator resolves "
        "it",
        failover("orders"), relays=2, build=build_pair("orders"),
        before_verify=orders_listing,
        check=lambda run, report: (check_failover_orders(run, report)
                                   + check_retention(run, report)),
        relay_flags=FAILOVER_RETENTION_FLAGS),
    TopologyScenario(
        "failover-billing",
        "the billing database on a primary + asynchronous standby: "
        "replication cut ~3 s under load, the primary stopped -m immediate, "
        "the standby promoted, the address moved; what the new primary "
        "lacks must be redelivered",
        failover("billing"), relays=2, build=build_pair("billing"),
        before_verify=read_truth("billing"), check=check_failover_billing),
    TopologyScenario(
        "restore-billing",
        "the billing database dropped (FORCE) and restored from a pg_dump "
        "taken under load 3-4.5 s earlier; what it lacks must be "
        "redelivered",
        restore_billing, relays=2, check=check_restore_billing,
        min_seconds=12.0),
    TopologyScenario(
        "restore-orders",
        "the orders database's server lost (stopped -m immediate) 1.5-2.5 s "
        "after a pg_dump taken under load, the dump restored into a new "
        "server whose transaction ids lie behind the dump's, the address "
        "moved; the relays down meanwhile (one frozen, one killed) and back "
        "2-3 s after the producer; what the consumer applied from the lost "
        "commits must be listed until an operator resolves it",
        restore_orders(in_place=False), relays=2, build=build_restore_pair,
        before_verify=orders_listing, check=check_restore_orders),
    TopologyScenario(
        "restore-orders-in-place",
        "the orders database dropped (FORCE) and restored on its server "
        "from a pg_dump taken under load 1.5-2.5 s earlier; the relays down "
        "meanwhile (one frozen, one killed) and back 2-3 s after the "
        "producer; what the consumer applied from the lost commits must be "
        "listed until an operator resolves it",
        restore_orders(in_place=True), relays=2,
        before_verify=lost_commits_listing, check=check_restore_orders,
        min_seconds=12.0),
    TopologyScenario(
        "pgbouncer-transaction",
        "every service through PgBouncer in transaction mode "
        f"(default_pool_size {TRANSACTION_POOL}), 2 relays, one SIGKILLed "
        "now and then, --retention deleting what was applied; a sampler "
        "looks for session state left on the shared backends",
        kill_relays_now_and_then, relays=2,
        build=build_bouncer("transaction", pool_size=TRANSACTION_POOL),
        check=lambda run, report: (check_pgbouncer(run, report)
                                   + check_retention(run, report)),
        relay_flags=RETENTION_FLAGS, min_seconds=12.0),
    TopologyScenario(
        "pgbouncer-session",
        "every service through PgBouncer in session mode "
        f"(default_pool_size {SESSION_POOL}: a backend per client "
        "connection), 2 relays, one SIGKILLed now and then",
        kill_relays_now_and_then, relays=2,
        build=build_bouncer("session", pool_size=SESSION_POOL),
        check=check_pgbouncer, min_seconds=12.0),
    TopologyScenario(
        "pgbouncer-statement",
        "each binary started against PgBouncer in statement mode must "
        "refuse to start, naming the pooler and the mode (the services "
        "under load run on direct connections)",
        statement_refusals, build=build_bouncer("statement", services=False),
        check=check_statement, min_seconds=10.0),
    TopologyScenario(
        "hung-db",
        f"every process of the scenario's own PostgreSQL SIGSTOPped for "
        f"{FREEZE_SECONDS:g} s under load, then SIGCONT; "
        "--stall_timeout=3s: the producer and relays must say NOT_SERVING; "
        "--retention deleting what was applied",
        hung_db, relays=2, build=build_own_server,
        check=lambda run, report: (check_hung_db(run, report)
                                   + check_retention(run, report)),
        service_flags=HUNG_FLAGS, relay_flags=RETENTION_FLAGS,
        health_after_heal=True,
        min_seconds=FREEZE_SECONDS + 8),
]

# Four of them on a partitioned outbox (rotation): a promotion, whose
# standby may lack the children the old primary made last; through the
# pooler; a restore, whose dump carries the children; and a hung server,
# whose drop waits on its lock and children ahead.
_ROTATED = {
    "failover-orders":
        "the standby holds the children, outbox_rotation and the sequence "
        "as far as it replayed them; the new primary's relays make the "
        "children it lacks and retention drops whole children after the "
        "heal",
    "hung-db":
        "children are made ahead and dropped by relays whose server stops "
        "answering mid-statement and then goes on",
    "pgbouncer-transaction":
        "retention drops whole children (a savepoint, a lock with "
        "lock_timeout and a DROP in one pooled transaction) and every relay "
        "makes children ahead through the pooler",
    "restore-orders":
        "the dump holds the children, outbox_rotation and the sequence; "
        "--retention drops whole children before and after the restore",
}
SCENARIOS += [on_partitioned(s, _ROTATED[s.name]) for s in list(SCENARIOS)
              if s.name in _ROTATED]

# The topologies above run with the subscription on the outbox log (the
# relays' default): its ticks and positions live in the orders database and
# go through the same promotion, restore, pooler and freeze as everything
# else there. The same topologies with a subscription delivered by rows
# (--log_delivery=false): group "rows".
ROWS_SCENARIOS = [
    on_rows(s) for s in SCENARIOS
    if s.name in ("failover-orders", "failover-billing", "restore-billing",
                  "restore-orders", "restore-orders-in-place",
                  "pgbouncer-transaction", "hung-db")]
