"""fan-out: a second subscription, "audit", next to billing.

Its own relays (`--subscription=audit`), its own consumer (`outbox-consumer
--handler=audit`) and its own database. The fan-out scenario's faults hit
only the audit consumer (SIGKILL, SIGSTOP); this module records each audit
outage, then checks that

- the audit subscription is complete, exactly once and in order, by SQL:
  the audit database's `inbox` and `audit_log` (and billing's inbox, for
  the latency) are copied into a scratch schema of the orders database and
  compared with the outbox there;
- the healthy billing subscription kept going while audit was down,
  judged by progress and never by time: during every audit outage in which
  events were committed (before its last second), billing applied events
  (billing `inbox.applied_at` within the outage, stamped by the same
  PostgreSQL server as the outage's bounds); and billing's backlog at each
  outage's end was applied afterwards (the checker's I1/I5). Latency
  figures are reported, never judged: a loaded 2-core machine stretches
  them both ways.
"""

import os
import re
import signal
import time

from .observe import Sampler, scrape
from .pg import SqlError

NAME = "audit"
SCRATCH = "chaos_fanout"  # schema in the orders database, for the checks
DELIVERED_RE = re.compile(
    r'^outbox_relay_delivered_total\{([^}]*)\}\s+([0-9.eE+]+)\s*$', re.M)
SUBSCRIPTION_RE = re.compile(r'subscription="([^"]*)"')

# An outage whose events were all committed in its last second may end
# before billing's relay (polling every 200 ms, NOTIFY aside) had them:
# billing must have applied something only in outages with events
# committed before then.
PROGRESS_LEAD = 1.0  # s
WARM_UP = 1.0        # s: the load's first second is no baseline

SCHEMA = f"""
DROP SCHEMA IF EXISTS {SCRATCH} CASCADE;
CREATE SCHEMA {SCRATCH};
CREATE TABLE {SCRATCH}.audit_inbox (event_id uuid, aggregate_id text
  COLLATE "C", seq bigint, apply_id bigint, applied_at timestamptz);
CREATE TABLE {SCRATCH}.audit_log (event_id uuid, aggregate_id text
  COLLATE "C", seq bigint, prev_seq bigint, event_type text,
  schema_version int);
CREATE TABLE {SCRATCH}.billing_inbox (event_id uuid, applied_at timestamptz);
CREATE TABLE {SCRATCH}.outages (i int, kind text, t0 timestamptz,
  t1 timestamptz);
"""

# Each owed event (not exempt: a dead letter for audit, or pending behind
# one) needs exactly one audit inbox row and one audit_log row; nothing in
# the audit database the outbox does not hold; per aggregate the inbox in
# apply_id order follows the outbox's prev_seq chain.
CHECK_CTE = f"""
WITH s AS (SELECT start_seq, chain_from FROM subscriptions
            WHERE name = '{NAME}'),
owed AS (SELECT o.* FROM outbox o, s WHERE o.seq >= s.start_seq),
dead AS (SELECT seq, aggregate_id FROM outbox_delivery
          WHERE subscription = '{NAME}' AND status = 'dead'),
exempt AS (SELECT d.seq FROM outbox_delivery d WHERE d.subscription =
            '{NAME}' AND (d.status = 'dead' OR d.aggregate_id IN
            (SELECT aggregate_id FROM dead))),
ni AS (SELECT event_id, count(*) AS n FROM {SCRATCH}.audit_inbox GROUP BY 1),
nl AS (SELECT event_id, count(*) AS n FROM {SCRATCH}.audit_log GROUP BY 1),
per AS (SELECT o.event_id, o.seq, o.aggregate_id, o.event_type,
               coalesce(ni.n, 0) AS n_in, coalesce(nl.n, 0) AS n_log,
               o.seq IN (SELECT seq FROM exempt) AS ex
          FROM owed o LEFT JOIN ni USING (event_id)
          LEFT JOIN nl USING (event_id)),
ord AS (SELECT a.event_id, a.aggregate_id, a.seq, a.apply_id,
               lag(a.seq, 1, 0::bigint) OVER (PARTITION BY a.aggregate_id
                 ORDER BY a.apply_id) AS after_seq,
               CASE WHEN o.prev_seq < s.chain_from THEN 0 ELSE o.prev_seq
               END AS prev_seq
          FROM {SCRATCH}.audit_inbox a JOIN owed o USING (event_id), s
         WHERE o.aggregate_id = a.aggregate_id AND o.seq = a.seq),
phantom AS (SELECT 'inbox' AS t, a.event_id, a.aggregate_id, a.seq
              FROM {SCRATCH}.audit_inbox a WHERE NOT EXISTS (SELECT 1 FROM
              owed o WHERE o.event_id = a.event_id AND o.aggregate_id =
              a.aggregate_id AND o.seq = a.seq)
            UNION ALL
            SELECT 'audit_log', l.event_id, l.aggregate_id, l.seq
              FROM {SCRATCH}.audit_log l WHERE NOT EXISTS (SELECT 1 FROM
              owed o WHERE o.event_id = l.event_id AND o.aggregate_id =
              l.aggregate_id AND o.seq = l.seq)),
differs AS (SELECT l.event_id, l.aggregate_id, l.seq, l.prev_seq,
                   l.event_type, l.schema_version, o.event_type AS o_type,
                   o.schema_version AS o_version, o.prev_seq AS o_prev
              FROM {SCRATCH}.audit_log l JOIN owed o USING (event_id), s
             WHERE (l.aggregate_id, l.seq, l.event_type, l.schema_version,
                    l.prev_seq) IS DISTINCT FROM (o.aggregate_id, o.seq,
                    o.event_type, o.schema_version, CASE WHEN o.prev_seq <
                    s.chain_from THEN 0 ELSE o.prev_seq END))
"""

CHECK_COUNTS = CHECK_CTE + f"""
SELECT (SELECT count(*) FROM owed),
       (SELECT count(*) FROM dead),
       (SELECT count(*) FROM per WHERE ex),
       (SELECT count(*) FROM per WHERE NOT ex AND n_in = 0),
       (SELECT count(*) FROM per WHERE NOT ex AND n_log = 0),
       (SELECT count(*) FROM per WHERE n_in > 1 OR n_log > 1),
       (SELECT count(*) FROM phantom),
       (SELECT count(*) FROM ord WHERE after_seq <> prev_seq),
       (SELECT count(*) FROM ord WHERE after_seq > 0 AND seq <= after_seq),
       (SELECT count(*) FROM differs),
       (SELECT count(*) FROM outbox_deliveries WHERE subscription = '{NAME}'
          AND status = 'pending'),
       (SELECT count(*) FROM {SCRATCH}.audit_inbox),
       (SELECT count(*) FROM {SCRATCH}.audit_log)
"""

CHECK_EXAMPLES = CHECK_CTE + """
(SELECT format('audit I1 lost: %s %s (seq %s, aggregate %s) has no inbox row '
               'in the audit database', event_type, event_id, seq,
               aggregate_id) FROM per WHERE NOT ex AND n_in = 0
  ORDER BY seq LIMIT 3)
UNION ALL
(SELECT format('audit I1 effect: %s %s (seq %s, aggregate %s) has no '
               'audit_log row', event_type, event_id, seq, aggregate_id)
   FROM per WHERE NOT ex AND n_log = 0 ORDER BY seq LIMIT 3)
UNION ALL
(SELECT format('audit I2 duplicate: %s %s (seq %s, aggregate %s) has %s '
               'inbox and %s audit_log rows', event_type, event_id, seq,
               aggregate_id, n_in, n_log)
   FROM per WHERE n_in > 1 OR n_log > 1 ORDER BY seq LIMIT 3)
UNION ALL
(SELECT format('audit I4 phantom: %s row for event %s (seq %s of %s), which '
               'the outbox does not hold', t, event_id, seq, aggregate_id)
   FROM phantom LIMIT 3)
UNION ALL
(SELECT format('audit I3 order: aggregate %s applied seq %s (prev_seq %s) '
               'after seq %s (apply_id %s)', aggregate_id, seq, prev_seq,
               after_seq, apply_id)
   FROM ord WHERE after_seq <> prev_seq ORDER BY apply_id LIMIT 3)
UNION ALL
(SELECT format('audit_log row of %s (seq %s of %s) says %s v%s prev_seq %s; '
               'the outbox %s v%s prev_seq %s', event_id, seq, aggregate_id,
               event_type, schema_version, prev_seq, o_type, o_version,
               o_prev) FROM differs LIMIT 3)
"""

# Billing's delivery latency (ms) by phase: "warm-up" the events of the
# load's first WARM_UP seconds (connections, caches: kept out of every
# other phase), "lead" the quiet lead-in before the first fault, "up"
# every event committed while audit was up (the lead-in too), "down"
# while audit was down. The same for audit.
LATENCY = f"""
WITH lat AS (
  SELECT extract(epoch FROM b.applied_at - o.created_at) * 1000 AS ms,
         o.created_at < (SELECT min(created_at) FROM outbox) +
           make_interval(secs => {WARM_UP}) AS warm,
         EXISTS (SELECT 1 FROM {SCRATCH}.outages x
                  WHERE o.created_at BETWEEN x.t0 AND x.t1) AS down,
         o.created_at < (SELECT min(t0) FROM {SCRATCH}.outages) AS lead
    FROM outbox o JOIN {SCRATCH}.%s b USING (event_id))
SELECT phase, count(*), round(percentile_cont(0.5) WITHIN GROUP
       (ORDER BY ms)::numeric, 1), round(percentile_cont(0.99) WITHIN GROUP
       (ORDER BY ms)::numeric, 1), round(max(ms)::numeric, 1)
  FROM (SELECT CASE WHEN warm THEN 'warm-up' WHEN down THEN 'down'
               ELSE 'up' END AS phase, ms FROM lat
        UNION ALL SELECT 'lead', ms FROM lat WHERE lead AND NOT warm) q
 GROUP BY phase
"""

# Per audit outage, afterwards from the timestamps (so that nothing is
# queried while the faults run): the events committed meanwhile, what
# billing and audit applied meanwhile, audit's backlog at its end (events
# committed before the end, applied by audit after it: the fault's reach),
# billing's backlog at its start (committed before, applied by billing
# after the start) and how long after the start that backlog was all
# applied, billing's backlog at its end, and audit's longest latency of
# the events committed meanwhile.
OUTAGES = f"""
WITH a AS (SELECT o.created_at, x.applied_at FROM outbox o
             JOIN {SCRATCH}.audit_inbox x USING (event_id)),
     b AS (SELECT o.created_at, x.applied_at FROM outbox o
             JOIN {SCRATCH}.billing_inbox x USING (event_id))
SELECT x.i, x.kind, round(extract(epoch FROM x.t1 - x.t0)::numeric, 2),
  (SELECT count(*) FROM outbox o WHERE o.created_at BETWEEN x.t0 AND x.t1),
  (SELECT count(*) FROM b WHERE b.applied_at BETWEEN x.t0 AND x.t1),
  (SELECT count(*) FROM a WHERE a.applied_at BETWEEN x.t0 AND x.t1),
  (SELECT count(*) FROM a WHERE a.created_at < x.t1 AND a.applied_at > x.t1),
  (SELECT count(*) FROM b WHERE b.created_at < x.t0 AND b.applied_at > x.t0),
  (SELECT round(extract(epoch FROM max(b.applied_at) - x.t0)::numeric, 2)
     FROM b WHERE b.created_at < x.t0 AND b.applied_at > x.t0),
  (SELECT count(*) FROM b WHERE b.created_at < x.t1 AND b.applied_at > x.t1),
  (SELECT round((extract(epoch FROM max(a.applied_at - a.created_at)) * 1000)
                ::numeric) FROM a WHERE a.created_at BETWEEN x.t0 AND x.t1),
  (SELECT count(*) FROM outbox o WHERE o.created_at BETWEEN x.t0 AND
     x.t1 - make_interval(secs => {PROGRESS_LEAD})),
  (SELECT count(*) FROM b WHERE b.created_at < x.t1 AND b.applied_at >= x.t1)
FROM {SCRATCH}.outages x ORDER BY x.i
"""

# Billing's pauses: the gaps between two successive applying transactions
# while events were being committed (after the warm-up). The longest one apart from the
# outages ("up"), and per outage the longest one overlapping it and how
# much of the outage it covers.
GAPS = f"""
WITH t AS (SELECT DISTINCT applied_at FROM {SCRATCH}.billing_inbox
            WHERE applied_at <= (SELECT max(created_at) FROM outbox)
              AND applied_at >= (SELECT min(created_at) FROM outbox) +
                  make_interval(secs => {WARM_UP})),
g AS (SELECT lag(applied_at) OVER (ORDER BY applied_at) AS a, applied_at AS b
        FROM t),
k AS (SELECT g.a, g.b, x.i, x.t0, x.t1 FROM g LEFT JOIN {SCRATCH}.outages x
        ON g.a < x.t1 AND g.b > x.t0 WHERE g.a IS NOT NULL)
SELECT 0, round(coalesce(max(extract(epoch FROM b - a)), 0)::numeric, 3), 0
  FROM k WHERE i IS NULL
UNION ALL
SELECT x.i, round(coalesce(max(extract(epoch FROM k.b - k.a)), 0)::numeric, 3),
       round(coalesce(max(extract(epoch FROM least(k.b, x.t1) -
             greatest(k.a, x.t0)) / nullif(extract(epoch FROM x.t1 - x.t0),
             0)), 0)::numeric, 3)
  FROM {SCRATCH}.outages x LEFT JOIN k ON k.i = x.i GROUP BY x.i
ORDER BY 1
"""


def _rows(text):
    return [ln.split("|") for ln in text.splitlines() if ln]


def _f(v):
    return float(v) if v not in (None, "") else None


def _ms(v):
    return "-" if v is None else f"{v:.0f}"


class AuditSubscription:
    def __init__(self, run, db):
        self.run = run
        self.db = db
        self.consumer = None
        self.relays = []
        self.sampler = None
        self.outages = []  # dicts: i, kind, t0, t1 (epoch seconds)
        self.drained = None
        self.drain_seconds = None
        self.stats = {}
        self.latency = {}        # billing: phase -> (n, p50, p99, max) ms
        self.audit_latency = {}  # audit: the same
        self.outage_rows = []
        self.gaps = (None, None, None)
        self.relay_delivered = {}  # subscription -> rows marked delivered
        self.examples = []

    # -- processes --------------------------------------------------------

    def setup(self):
        run = self.run
        run.suite.pg.drop_db(self.db)
        run.suite.pg.create_db(self.db)
        self.consumer = run._proc("consumer", 0, ["--handler=audit"],
                                  name="consumer-audit", db=self.db)
        for i in range(1, run.scn.audit_relays + 1):
            self.relays.append(run.relay_proc(
                i, self.consumer, name=f"relay-audit-{i}",
                extra_args=[f"--subscription={NAME}", "--start_from=oldest"]))

    def describe(self):
        return (f"audit: {len(self.relays)} relay(s) --subscription={NAME} "
                f"-> consumer-audit (--handler=audit, database {self.db})")

    def start_sampler(self):
        self.sampler = Sampler(self.run, [self.consumer], self.run.suite.pg,
                               self.db)
        self.sampler.start()

    def sql(self, sql, timeout=30):
        return self.run.suite.pg.psql(self.db, sql, timeout=timeout)

    # -- faults -----------------------------------------------------------

    def _record(self, kind, t0, t1):
        o = {"i": len(self.outages) + 1, "kind": kind, "t0": t0, "t1": t1}
        self.outages.append(o)
        self.run.log(f"audit outage {o['i']} ({kind}): {t1 - t0:.1f}s")

    def outage_kill(self, down):
        """SIGKILL the audit consumer, kept down `down` s; the outage lasts
        until the restarted consumer serves again."""
        run, c = self.run, self.consumer
        t0 = time.time()
        run.kill(c, signal.SIGKILL, down)
        time.sleep(down)
        run.wait_ready([c], 60)
        self._record("kill", t0, time.time())

    def outage_pause(self, seconds):
        """SIGSTOP the audit consumer for `seconds`, then SIGCONT."""
        run, c = self.run, self.consumer
        t0 = time.time()
        pid = run.sup.pause(c)
        if pid is None:
            return
        run.faults += 1
        run.log(f"paused {c.name} (pid {pid}, SIGSTOP) for {seconds:.1f}s")
        time.sleep(max(0.0, t0 + seconds - time.time()))
        # the end just before SIGCONT: the resumed consumer applies its
        # backlog within milliseconds, maybe before this thread runs again
        t1 = time.time()
        run.sup.resume(c)
        run.log(f"resumed {c.name} (pid {pid}, SIGCONT)")
        self._record("pause", t0, t1)

    # -- the checks -------------------------------------------------------

    def drain(self, wait):
        """Until no deliverable audit row is pending and nothing is held at
        the audit consumer, at most `wait` s from the checker's start."""
        run = self.run
        start = run.verify_started or time.monotonic()
        pending = held = None
        while True:
            try:
                pending = int(run.sql_orders(
                    f"SELECT count(*) FROM outbox_deliveries p WHERE "
                    f"p.subscription = '{NAME}' AND p.status = 'pending' AND "
                    f"NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE "
                    f"d.subscription = '{NAME}' AND d.aggregate_id = "
                    f"p.aggregate_id AND d.status = 'dead')").strip())
                held = int(self.sql("SELECT count(*) FROM held_events")
                           .strip())
            except (SqlError, ValueError):
                pending = held = None
            if pending == 0 and held == 0:
                self.drained = True
                break
            if time.monotonic() - start > wait:
                self.drained = False
                break
            time.sleep(0.2)
        self.drain_seconds = time.monotonic() - start
        return pending, held

    def sabotage(self):
        """--sabotage for audit (after its drain): one event's inbox row
        deleted (I1), one event moved behind its successor (I3), one inbox
        row nobody committed (I4)."""
        gone = self.sql(
            "DELETE FROM inbox WHERE event_id = (SELECT i.event_id FROM inbox "
            "i WHERE NOT EXISTS (SELECT 1 FROM inbox j WHERE j.aggregate_id = "
            "i.aggregate_id AND j.seq > i.seq) ORDER BY apply_id LIMIT 1) "
            "RETURNING event_id, aggregate_id, seq").strip()
        agg = gone.split("|")[1] if gone else ""
        moved = self.sql(
            "UPDATE inbox SET apply_id = DEFAULT WHERE event_id = (SELECT "
            "i.event_id FROM inbox i WHERE i.aggregate_id <> "
            f"'{agg}' AND EXISTS (SELECT 1 FROM inbox j WHERE j.aggregate_id "
            "= i.aggregate_id AND j.seq > i.seq) ORDER BY apply_id LIMIT 1) "
            "RETURNING event_id, aggregate_id, seq").strip()
        self.sql("INSERT INTO inbox (event_id, aggregate_id, seq, event_type) "
                 "VALUES (gen_random_uuid(), 'sabotage', 1, 'OrderCreated')")
        self.run.log(f"SABOTAGE (audit): deleted the inbox row {gone}, moved "
                     f"{moved} behind its successor (apply_id), inserted an "
                     "inbox row nobody committed")

    def _copy(self):
        run, pg = self.run, self.run.suite.pg
        run.sql_orders(SCHEMA)
        n = {}
        n["audit_inbox"] = pg.copy(
            self.db, "SELECT event_id, aggregate_id, seq, apply_id, "
            "applied_at FROM inbox", run.orders_db, f"{SCRATCH}.audit_inbox")
        n["audit_log"] = pg.copy(
            self.db, "SELECT event_id, aggregate_id, seq, prev_seq, "
            "event_type, schema_version FROM audit_log", run.orders_db,
            f"{SCRATCH}.audit_log")
        n["billing_inbox"] = pg.copy(
            run.billing_db, "SELECT event_id, applied_at FROM inbox",
            run.orders_db, f"{SCRATCH}.billing_inbox")
        values = ", ".join(
            f"({o['i']}, '{o['kind']}', to_timestamp({o['t0']:.6f}), "
            f"to_timestamp({o['t1']:.6f}))" for o in self.outages)
        run.sql_orders(
            (f"INSERT INTO {SCRATCH}.outages VALUES {values};" if values
             else "") +
            f"ANALYZE {SCRATCH}.audit_inbox, {SCRATCH}.audit_log, "
            f"{SCRATCH}.billing_inbox;")
        return n

    def _scrape_relays(self):
        """Rows marked delivered per subscription label, from every relay's
        /metrics; a relay whose series lack its own subscription's label is
        reported."""
        bad = []
        run = self.run
        for want, relays in (("billing", run.relays), (NAME, self.relays)):
            for r in relays:
                try:
                    text = scrape(r.metrics_port, timeout=3)
                except Exception as e:
                    # Unread, its labels are unchecked: a failure, not a note.
                    bad.append(f"metrics: could not scrape {r.name}'s "
                               f"/metrics: {e}")
                    continue
                series = DELIVERED_RE.findall(text)
                subs = {(SUBSCRIPTION_RE.search(labels) or [None, None])[1]
                        for labels, _ in series}
                if subs != {want}:
                    bad.append(f"metrics: {r.name} (--subscription={want}) "
                               "exports outbox_relay_delivered_total with "
                               f"subscription labels {sorted(map(str, subs))}")
                for labels, v in series:
                    m = SUBSCRIPTION_RE.search(labels)
                    key = m.group(1) if m else "?"
                    self.relay_delivered[key] = (
                        self.relay_delivered.get(key, 0) + int(float(v)))
        return bad

    def check(self, report):
        """The fan-out scenario's extra assertions (after outboxctl verify
        checked billing): audit complete, exactly once, in order; billing
        not held back by audit's outages."""
        run = self.run
        bad = []
        wait = run.wait or 120
        pending, held = self.drain(wait)
        if not self.drained:
            bad.append(f"audit I5 liveness: not drained within {wait}s after "
                       f"the faults stopped ({pending} pending, {held} held)")
        bad += self._scrape_relays()  # drained, every relay still up
        if run.suite.sabotage:
            self.sabotage()
        copied = self._copy()

        (events, dead, exempt, lost, missing_log, dups, phantoms, order,
         regressions, differs, pending_left, inbox_rows, log_rows) = (
            int(x) for x in run.sql_orders(CHECK_COUNTS, 120).strip()
            .split("|"))
        held_left = int(self.sql("SELECT count(*) FROM held_events").strip())
        self.examples = [ln for ln in run.sql_orders(
            CHECK_EXAMPLES, 120).splitlines() if ln]
        report.setdefault("examples", []).extend(self.examples)
        self.stats = {
            "events": events, "inbox": inbox_rows, "audit_log": log_rows,
            "dead_letters": dead, "exempt": exempt, "lost": lost,
            "missing_audit_log": missing_log, "duplicates": dups,
            "phantoms": phantoms, "order_violations": order,
            "seq_regressions": regressions, "audit_log_mismatches": differs,
            "pending": pending_left, "held": held_left, "copied": copied,
        }
        for n, label in (
                (lost, "audit I1 lost events (no inbox row)"),
                (missing_log, "audit I1 missing effects (no audit_log row)"),
                (dups, "audit I2 events with more than one inbox or "
                       "audit_log row"),
                (order, f"audit I3 order violations ({regressions} seq "
                        "regressions)"),
                (phantoms, "audit I4 phantoms (inbox or audit_log rows the "
                           "outbox does not hold)"),
                (differs, "audit_log rows that differ from the outbox"),
                (pending_left, "audit deliveries still pending"),
                (held_left, "events still held at the audit consumer")):
            if n:
                bad.append(f"{label}: {n}")
        if dead:
            bad.append(f"audit dead letters: {dead} (expected 0; killing or "
                       "pausing a consumer never dead-letters)")

        bad += self._outage_checks()
        run.log(f"audit checked: {events} events, {inbox_rows} inbox and "
                f"{log_rows} audit_log rows, drained in "
                f"{self.drain_seconds:.1f}s, lost {lost}, missing audit_log "
                f"{missing_log}, duplicates {dups}, order violations {order} "
                f"(regressions {regressions}), phantoms {phantoms}, pending "
                f"{pending_left}, dead letters {dead}")
        run.log("fan-out: " + self.figures())
        return bad

    def _outage_checks(self):
        run = self.run
        bad = []
        if not self.outages:
            run.errors.append("fan-out: no audit outage was injected (window "
                              "too short?): the run proves nothing")
            return bad
        for table, out in (("billing_inbox", self.latency),
                           ("audit_inbox", self.audit_latency)):
            for phase, n, p50, p99, mx in _rows(
                    run.sql_orders(LATENCY % table, 120)):
                out[phase] = (int(n), _f(p50), _f(p99), _f(mx))
        self.outage_rows = [
            {"i": int(r[0]), "kind": r[1], "seconds": float(r[2]),
             "committed": int(r[3]), "billing_applied": int(r[4]),
             "audit_applied": int(r[5]), "audit_backlog_at_end": int(r[6]),
             "billing_backlog_at_start": int(r[7]),
             "billing_backlog_applied_after": _f(r[8]),
             "billing_backlog_at_end": int(r[9]),
             "audit_max_lag_ms": _f(r[10]),
             "committed_before_last_second": int(r[11]),
             "billing_applied_after": int(r[12])}
            for r in _rows(run.sql_orders(OUTAGES, 120))]
        gaps = _rows(run.sql_orders(GAPS, 120))
        gap_up = _f(gaps[0][1]) if gaps and gaps[0][0] == "0" else 0.0
        for i, longest, covers in gaps:
            if int(i):
                row = self.outage_rows[int(i) - 1]
                row["billing_longest_pause"] = _f(longest)
                row["billing_pause_covers"] = _f(covers)
        worst = max(self.outage_rows,
                    key=lambda o: o.get("billing_longest_pause") or 0,
                    default=None)
        self.gaps = (gap_up, worst and worst.get("billing_longest_pause"),
                     worst and worst["i"])

        if not any(o["audit_backlog_at_end"] for o in self.outage_rows):
            run.errors.append(
                "fan-out: no audit outage left audit events pending: the "
                "faults never held the audit subscription back")
        # Billing kept going while audit was down, judged by progress: it
        # applied events during every outage in which events were committed
        # (before its last second), and what was committed before an
        # outage ended was applied after it as much as needed (the
        # checker's I1 and I5 require all of it). No latency ratio: on a
        # loaded machine a latency stretches without anything stalling.
        for o in self.outage_rows:
            if o["committed_before_last_second"] and not o["billing_applied"]:
                bad.append(
                    f"fan-out: billing applied nothing during audit outage "
                    f"{o['i']} ({o['kind']}, {o['seconds']:.1f}s), though "
                    f"{o['committed_before_last_second']} events were "
                    f"committed in it before its last second; billing's "
                    f"backlog {o['billing_backlog_at_start']} at its start, "
                    f"{o['billing_backlog_at_end']} at its end")
        return bad

    # -- reporting --------------------------------------------------------

    def figures(self):
        """One line: the audit check, the outages, billing's latency."""
        st = self.stats
        if not st:
            return "audit: not checked"

        def lat(phase, table=None):
            v = (table or self.latency).get(phase)
            if not v:
                return f"{phase} -"
            return f"{phase} {_ms(v[1])}/{_ms(v[2])} (n={v[0]})"

        totals = self.sampler.totals() if self.sampler else {}
        outages = "; ".join(
            f"{o['kind']} {o['seconds']:.1f}s: audit backlog "
            f"{o['audit_backlog_at_end']} at its end, lag max "
            f"{_ms(o['audit_max_lag_ms'])} ms, billing applied "
            f"{o['billing_applied']} of {o['committed']} committed, backlog "
            f"{o['billing_backlog_at_start']}->{o['billing_backlog_at_end']}"
            for o in self.outage_rows)
        gap_up, gap_down, _ = self.gaps
        aud = self.audit_latency
        amax = max((v[3] or 0) for v in aud.values()) if aud else None
        return (
            f"audit: {st['events']} events -> {st['inbox']} inbox / "
            f"{st['audit_log']} audit_log rows, lost {st['lost']}, dup "
            f"{st['duplicates']}, order {st['order_violations']}, phantoms "
            f"{st['phantoms']}, pending {st['pending']}, dead "
            f"{st['dead_letters']}, drained "
            + (f"{self.drain_seconds:.1f}s" if self.drained else
               f"NO>{self.drain_seconds:.0f}s")
            + f", deliveries {totals.get('deliveries', '-')} "
            f"({totals.get('duplicate', '-')} dups), lag max {_ms(amax)} ms | "
            f"outages: {outages} | billing latency p50/p99 ms: "
            f"{lat('warm-up')}, {lat('lead')}, audit {lat('up')}, audit "
            f"{lat('down')}; longest pause "
            + (f"{gap_up:.2f}s" if gap_up is not None else "-")
            + " up, " + (f"{gap_down:.2f}s" if gap_down is not None else "-")
            + " down | relays delivered " + ", ".join(
                f"{k} {v}" for k, v in sorted(self.relay_delivered.items())))

    def result(self):
        def lat(d):
            return {k: {"n": v[0], "p50_ms": v[1], "p99_ms": v[2],
                        "max_ms": v[3]} for k, v in d.items()}
        return {
            "audit": dict(self.stats, drained=self.drained,
                          drain_seconds=self.drain_seconds and round(
                              self.drain_seconds, 2)),
            "audit_deliveries": (self.sampler.totals() if self.sampler
                                 else None),
            "audit_held_peak": self.sampler.held_peak if self.sampler else None,
            "outages": self.outage_rows,
            "billing_latency": lat(self.latency),
            "audit_latency": lat(self.audit_latency),
            "billing_longest_pause_up_s": self.gaps[0],
            "billing_longest_pause_down_s": self.gaps[1],
            "relay_delivered": self.relay_delivered,
        }

    def evidence(self):
        """Evidence of the audit side (for evidence.txt), and CSV copies of
        its tables."""
        run = self.run
        parts = []

        def q(title, fn, sql):
            try:
                parts.append(f"-- {title}\n{fn(sql, 60)}")
            except Exception as e:
                parts.append(f"-- {title}\n(failed: {e})")

        q("audit: held events", self.sql,
          "SELECT h.seq, h.prev_seq, h.aggregate_id, coalesce(c.last_seq, 0) "
          "AS cursor, h.received_at FROM held_events h LEFT JOIN "
          "aggregate_cursors c USING (aggregate_id) ORDER BY h.seq LIMIT 20")
        q("audit: partitions owned, by lease",
          run.sql_orders,
          "SELECT owner, count(*), min(expires_at) FILTER (WHERE "
          "isfinite(expires_at)) - now() AS expires_in "
          "FROM outbox_partition_leases WHERE subscription = "
          f"'{NAME}' GROUP BY 1 ORDER BY 1")
        parts.append("-- audit outages (epoch seconds; then what the check "
                     "measured)\n" + "\n".join(
                         f"{o['i']} {o['kind']} {o['t0']:.3f}-{o['t1']:.3f}"
                         for o in self.outages) + "\n" + "\n".join(
                         str(r) for r in self.outage_rows))
        if self.examples:
            parts.append("-- audit check examples\n" + "\n".join(
                self.examples))
        for table, sql in (
                ("audit_inbox", "SELECT * FROM inbox ORDER BY apply_id"),
                ("audit_log", "SELECT event_id, aggregate_id, seq, prev_seq, "
                 "event_type, schema_version, recorded_at FROM audit_log "
                 "ORDER BY recorded_at"),
                ("audit_held_events", "SELECT event_id, aggregate_id, seq, "
                 "prev_seq, received_at FROM held_events ORDER BY seq")):
            try:
                csv = self.sql(f"COPY ({sql}) TO STDOUT WITH CSV HEADER", 120)
                with open(os.path.join(run.workdir, f"{table}.csv"), "w") as f:
                    f.write(csv)
            except Exception:
                pass
        return parts
