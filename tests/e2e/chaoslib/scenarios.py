"""The failure scenarios: a topology, relay (or every service's) flags, and
a fault injector that runs for the scenario's window. Every random choice
comes from run.rng (random.Random seeded with "<scenario>/<seed>"), so
`--seed N --scenario NAME` replays the same schedule of faults."""

import signal
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

# Crash points armed in the crash-points scenario (probability per pass).
# A producer passes its points once per group write (a few hundred a
# second), a relay once per batch, a consumer once per batch transaction:
# the numbers make each binary crash a few times in a short window and
# still progress. (At 0.0005 the producer's points once fired in none of
# the CI's 7 s runs: the scenario now fails when an armed point never
# fires.)
CRASH_POINTS = ",".join([
    "relay.after_send_before_mark:0.03",
    "relay.after_claim_before_send:0.02",
    "relay.before_mark_commit:0.02",
    "relay.after_mark_commit:0.02",
    "consumer.before_commit:0.03",
    "consumer.after_commit_before_answer:0.04",
    "producer.before_commit:0.002",
    "producer.after_commit_before_answer:0.002",
])

ACK_TIMEOUT = 2.0  # the relay's --ack_timeout in every scenario
# rogue-lock: a lock wait fails fast, a stalled loop shows within seconds
ROGUE_LOCK_FLAGS = {"lock_timeout": "500ms", "stall_timeout": "2s"}
# retention (its deletes and their pauses) fast enough for a short run
RETENTION_FLAGS = {"retention": "300ms", "retention_interval": "100ms"}
ROGUE_LOCK_OVERRUN = 8.0  # s the last rogue lock may end after the window
AFTER_HEAL = 20.0  # how long a binary may stay NOT_SERVING after the heal
FAN_OUT_OVERRUN = 5.0  # s fan-out's last audit outage may end after the window
# crash-points: how long the points stay armed after the window, with the
# load running, for one that has not fired yet
CRASH_POINTS_OVERRUN = 20.0
# ... and the probability a point not fired by then gets, armed alone on
# every binary of its kind
CRASH_POINTS_ESCALATED = 0.3


@dataclass
class Scenario:
    name: str
    summary: str
    inject: Callable
    producers: int = 1
    relays: int = 1
    consumers: int = 1
    relay_flags: dict = field(default_factory=dict)
    service_flags: dict = field(default_factory=dict)  # every service
    fault_env: Optional[str] = None  # OUTBOX_FAULT for every binary
    proxy_relay_consumer: bool = False
    proxy_db: bool = False
    pairs: bool = False  # relay i -> consumer i (else all -> consumer 1)
    expect_dead: int = 0
    check: Optional[Callable] = None  # extra assertions -> list of strings
    # after the heal every process must say SERVING by itself (within
    # AFTER_HEAL); one still NOT_SERVING is recorded in
    # run.gray.after_heal (check_gray reports it)
    health_after_heal: bool = False
    # the client load runs this much longer than the fault window (for an
    # injector whose last fault may outlast the window)
    load_extra: float = 0.0
    # fan-out: this many relays of a second subscription, "audit", with a
    # consumer (--handler=audit) and a database of its own
    # (chaoslib/fanout.py; run.audit)
    audit_relays: int = 0
    # the orders database's outbox partitioned by seq range in children of
    # this many seqs before the services start (outboxctl partition-outbox):
    # retention then drops whole children (rotation)
    partition_span: int = 0


# -- injectors ---------------------------------------------------------------


def hit_relays(run, victims):
    """SIGKILL `victims` (1 in 5: SIGTERM, a clean bounce; 1 in 7: SIGSTOP
    the first for 1-3 s, a relay that hangs with its partitions), kept
    down 0-1.5 s; the supervisor restarts them."""
    how = run.rng.random()
    down = run.rng.uniform(0.0, 1.5)
    if how < 1 / 7:
        run.pause(victims[0], run.rng.uniform(1.0, 3.0))
        return
    for v in victims:
        run.kill(v, signal.SIGKILL if how < 0.8 else signal.SIGTERM, down)


def kill_relays(run):
    """hit_relays at random moments: one relay, now and then both."""
    while run.sleep(run.rng.uniform(0.8, 2.2)):
        if len(run.relays) > 1 and run.rng.random() < 0.15:
            hit_relays(run, list(run.relays))
        else:
            hit_relays(run, [run.rng.choice(run.relays)])


def kill_consumer(run):
    """SIGKILL the consumer at random moments. The gaps are long enough for
    the relay to reconnect (up to ~2 s after the consumer is back) and
    stream a while, so most kills land on a batch being applied or
    answered."""
    while run.sleep(run.rng.uniform(2.0, 4.0)):
        run.kill(run.rng.choice(run.consumers), signal.SIGKILL,
                 run.rng.uniform(0.0, 1.0))


def pause_consumer(run):
    """SIGSTOP the consumer for longer than the relay's --ack_timeout, so
    the relay's stream stalls and is reset, then SIGCONT."""
    while run.sleep(run.rng.uniform(0.5, 1.5)):
        c = run.rng.choice(run.consumers)
        run.pause(c, ACK_TIMEOUT + run.rng.uniform(1.0, 2.5))


def restart_postgres(run):
    while run.sleep(run.rng.uniform(1.5, 3.0)):
        run.pg_restart()


def net_faults(proxies_of):
    def inject(run):
        proxies = proxies_of(run)
        while run.sleep(run.rng.uniform(0.5, 1.5)):
            action = run.rng.choice(["latency", "reset", "blackhole"])
            if len(proxies) > 1 and run.rng.random() < 0.4:
                targets = list(proxies)
            else:
                targets = [run.rng.choice(proxies)]
            if action == "latency":
                lo = run.rng.uniform(0.02, 0.05)
                hi = run.rng.uniform(0.1, 0.2)
                run.net_latency(targets, lo, hi, run.rng.uniform(1.0, 3.0))
            elif action == "reset":
                run.net_reset(targets, run.rng.choice([0.0, 0.0, 0.5, 1.0]))
            else:
                run.net_blackhole(targets, run.rng.uniform(2.0, 4.0))
    return inject


def kill_one_relay(run):
    """Relay A -> consumer A, relay B -> consumer B; one relay is killed at
    random moments and kept down a while, so its partitions move to the
    other relay, and with them to the other consumer."""
    victim = run.rng.choice(run.relays)
    run.log(f"victim: {victim.name}")
    while run.sleep(run.rng.uniform(1.0, 2.5)):
        run.kill(victim, signal.SIGKILL, run.rng.uniform(0.5, 2.5))


def poison(run):
    run.sleep(run.rng.uniform(1.0, 2.0))
    run.poison()
    while run.sleep(1.0):
        pass


def armed_points(run):
    """Crash point -> how often a binary logged that it crashed there."""
    fired = {e.split(":")[0]: 0 for e in CRASH_POINTS.split(",")}
    with run.sup.lock:
        for p in run.sup.procs:
            for point, n in p.crash_points.items():
                fired[point] = fired.get(point, 0) + n
    return fired


def escalated_spec(points):
    """OUTBOX_FAULT arming only `points`, each at CRASH_POINTS_ESCALATED."""
    return ",".join(f"{m}:{CRASH_POINTS_ESCALATED:g}" for m in points)


def crash_points(run):
    """The faults fire inside the binaries; the supervisor restarts them.
    After the window the points stay armed, while the load still runs, until
    every one has fired at least once (at most CRASH_POINTS_OVERRUN s more):
    a point that never fires proves nothing, and check_crash_points fails
    the run for it. A binary passes some points only a few dozen times in
    a short window on a loaded machine, so chance alone can leave one
    unfired: in the overrun each point not fired yet is armed alone on
    every binary of its kind (each restarted once for it), at
    CRASH_POINTS_ESCALATED a pass. All of them: a relay passes its points
    only while it holds partitions, and the restarted one is the relay
    least likely to hold any (its leases lapse, the others take them), so
    arming one relay at a time, each restart moving the partitions again,
    could leave the point unfired for the whole overrun. Once a point has
    fired, each binary's next incarnation crashes at the old rate again. A
    renamed or unreachable point still never fires."""
    while run.sleep(1.0):
        pass
    until = time.monotonic() + CRASH_POINTS_OVERRUN
    armed = set()   # points escalated on every binary of their kind
    escalated = {}  # proc -> (its points escalated, its arming before)
    missing = []
    while time.monotonic() < until:
        missing = [k for k, n in armed_points(run).items() if n == 0]
        for p, (mine, before) in list(escalated.items()):
            left = [m for m in mine if m in missing]
            if not left:
                # Fired: its next incarnation crashes at the old rate
                # again, not at every third pass of a point already seen.
                p.env["OUTBOX_FAULT"] = before
                del escalated[p]
            elif left != mine:
                # Some fired: the next incarnation arms only the others.
                # A point passed earlier in the same path (after_send
                # before after_mark) kept at 0.3 would crash the binary
                # first, most passes, and each crash leaves its partitions
                # unowned for a lease's length.
                escalated[p] = (left, before)
                p.env["OUTBOX_FAULT"] = escalated_spec(left)
        if not missing:
            return
        by_proc = {}  # proc -> the points newly escalated on it
        for k in missing:
            if k in armed:
                continue
            kind = k.split(".")[0]
            with run.sup.lock:
                procs = [p for p in run.sup.procs
                         if p.kind == kind and "OUTBOX_FAULT" in p.env]
            if not procs:
                continue
            armed.add(k)
            for p in procs:
                by_proc.setdefault(p, []).append(k)
        for p, points in by_proc.items():
            mine, before = escalated.get(p, ([], p.env["OUTBOX_FAULT"]))
            mine = [m for m in mine if m in missing] + [
                m for m in points if m not in mine]
            escalated[p] = (mine, before)
            p.env["OUTBOX_FAULT"] = escalated_spec(mine)
            run.log(f"{', '.join(points)} not fired yet: {p.name} restarted "
                    f"with only {', '.join(mine)} armed, at "
                    f"{CRASH_POINTS_ESCALATED:g} a pass")
            run.kill(p, signal.SIGKILL)
        time.sleep(0.25)
    run.log("crash points still not fired after the overrun: "
            + ", ".join(missing))


def check_crash_points(run, report):
    """Every armed crash point fired at least once (each binary logs
    "OUTBOX_FAULT: crashing at <point>" before it kills itself)."""
    fired = armed_points(run)
    run.log("crashes by point: " + ", ".join(
        f"{k} x{n}" for k, n in sorted(fired.items())))
    return [f"crash-points: {k} never fired in {run.seconds:g}s (+"
            f"{CRASH_POINTS_OVERRUN:g}s): renamed, unreachable, or its binary "
            "never passed it" for k, n in sorted(fired.items()) if n == 0]


def read_only_periods(which):
    """The `which` ("billing" or "orders") database turns read-only for
    seconds at a time and back. The first period is long (half the window,
    at most ~10 s), the others 1.5-4 s with 0.5-1.5 s between them. Each is
    either a failover to a read-only standby (that database's setting, its
    sessions terminated, so the services reconnect read-only) or in place
    (ALTER SYSTEM: the whole server, sessions kept), by the rng."""
    def inject(run):
        db = run.billing_db if which == "billing" else run.orders_db
        first = True
        while run.sleep(run.rng.uniform(1.0, 2.0) if first
                        else run.rng.uniform(0.5, 1.5)):
            how = run.rng.choice(["failover", "in-place"])
            if first:
                seconds = min(10.0, 0.5 * run.seconds) * run.rng.uniform(0.95,
                                                                          1.1)
            else:
                seconds = run.rng.uniform(1.5, 4.0)
            first = False
            # the last one may outlast the window by a second at most
            seconds = min(seconds, max(1.0, run.remaining() + 1.0))
            run.gray.read_only(db, which, how, seconds)
    return inject


def rogue_locks(run):
    """A rogue session holds ACCESS EXCLUSIVE for 5-7 s (longer than the
    services' --lock_timeout) on a table a loop needs, alternately billing's
    inbox or aggregate_cursors (stalls the consumers) and orders' outbox
    (stalls the relays' claim/mark loop and the producers' writes), 1-2 s
    apart; at least one of each, however short the window (so the last
    lock may end up to ROGUE_LOCK_OVERRUN s after the window, and the
    client load runs that much longer: the producers and consumers only
    have work, and can only stall, while it runs)."""
    if run.buf() is None:
        from .runner import HarnessError  # runner imports this module
        raise HarnessError("rogue-lock polls grpc.health.v1 with `buf curl`: "
                           "tests/deploy/node_modules/.bin/buf is missing "
                           "(npm ci in tests/deploy)")
    side = run.rng.choice(["billing", "orders"])
    done = set()
    extra = 0  # locks tried after the window (a lock not taken is retried)
    run.sleep(run.rng.uniform(0.5, 1.0))
    while True:
        # Well over --stall_timeout: a relay that reconnects may own no
        # partition for a moment, and a mark it flushes then is progress,
        # so its stall can start up to a few reconnects into the lock.
        seconds = run.rng.uniform(5.0, 7.0)
        if side == "billing":
            table = run.rng.choice(["inbox", "aggregate_cursors"])
            period = run.gray.rogue_lock(run.billing_db, "billing", table,
                                         seconds, run.consumers)
        else:
            period = run.gray.rogue_lock(run.orders_db, "orders", "outbox",
                                         seconds, run.relays + run.producers)
        if period is not None:
            done.add(side)
            side = "orders" if side == "billing" else "billing"
        if not run.sleep(run.rng.uniform(1.0, 2.0)):
            extra += 1
            if len(done) == 2 or extra > 3:
                break


def refuse_billing_connections(run):
    """The billing database refuses new connections for 2-4 s (its sessions
    terminated), then takes them again, 1-2 s apart."""
    while run.sleep(run.rng.uniform(1.0, 2.0)):
        seconds = min(run.rng.uniform(2.0, 4.0), max(1.0, run.remaining() + 1))
        run.gray.refuse_connections(run.billing_db, "billing", seconds)


def fan_out_faults(run):
    """Two subscriptions; only audit's consumer is hit. A quiet lead-in
    first (a quarter of the window, 1-5 s: billing's latency with nothing
    wrong), then the audit consumer is SIGKILLed (kept down 0.5-1.5 s) or
    SIGSTOPped (0.3-1.5 s longer than the relays' --ack_timeout), 0.3-1 s
    apart, by the rng; at least one of each however short the window (so
    the last may end up to FAN_OUT_OVERRUN s after it; the client load runs
    that much longer, so billing has work during every outage). Each outage
    lasts until the consumer serves again (SIGCONT, or the restarted one
    says SERVING)."""
    audit = run.audit
    lead = min(5.0, max(1.0, 0.25 * run.seconds))
    run.log(f"quiet lead-in of {lead:.1f}s (no fault: billing's latency "
            "with both subscriptions healthy)")
    run.sleep(lead)
    owed = run.rng.sample(["kill", "pause"], 2)  # one of each, at least
    while owed or run.remaining() > 0:
        how = owed.pop(0) if owed else run.rng.choice(["kill", "pause"])
        if how == "kill":
            audit.outage_kill(run.rng.uniform(0.5, 1.5))
        else:
            audit.outage_pause(ACK_TIMEOUT + run.rng.uniform(0.3, 1.5))
        gap = run.rng.uniform(0.3, 1.0)
        if not run.sleep(gap) and owed:
            time.sleep(gap)


def check_fan_out(run, report):
    """The audit subscription complete, exactly once and in order (by
    SQL); billing not held back while audit was down (see fanout.py)."""
    return run.audit.check(report)


def check_gray(run, report):
    """In a gray failure every process stays up (the harness kills none),
    and each says SERVING again by itself after the heal."""
    bad = [f"health: {name} still {status} {bound:g}s after the heal"
           for name, status, bound in run.gray.after_heal]
    with run.sup.lock:
        bad += [f"gray failure: a process exited: {u}"
                for p in run.sup.procs for u in p.unexpected
                if "restart limit" not in u]
    return bad


def check_rogue_lock(run, report):
    """Each binary a lock stalled said NOT_SERVING during at least one of
    its lock periods (and SERVING again after the heal)."""
    bad = check_gray(run, report)
    g = run.gray
    for side in ("billing", "orders"):
        if not any(p["db"] == side for p in g.lock_periods):
            bad.append(f"rogue-lock: no rogue lock on the {side} database "
                       "could be taken (see rogue-lock.log)")
    logged = run.health_log_counts()
    for name, n in sorted(g.stalls_expected.items()):
        if not g.stalls_seen.get(name):
            tables = sorted({f"{p['db']}.{p['table']}" for p in g.lock_periods
                             if name in p["health"]})
            bad.append(f"watchdog: {name} never said NOT_SERVING during its "
                       f"{n} lock period(s) on {', '.join(tables)} (--"
                       f"stall_timeout={ROGUE_LOCK_FLAGS['stall_timeout']}); "
                       f"its log has {logged.get(name, 0)} 'health "
                       "NOT_SERVING' line(s)")
    return bad


def kill_relays_and_consumer(run):
    """Mostly kill_relays' faults (a relay SIGKILLed, SIGTERMed or
    SIGSTOPped), and 1 in 4 a SIGKILLed consumer instead."""
    while run.sleep(run.rng.uniform(0.8, 2.2)):
        if run.rng.random() < 0.25:
            run.kill(run.rng.choice(run.consumers), signal.SIGKILL,
                     run.rng.uniform(0.0, 1.0))
            continue
        hit_relays(run, [run.rng.choice(run.relays)])


def check_retention(run, report):
    """Retention deleted applied events; that it deleted none it owed is
    the checker's (a deleted undelivered event leaves its order missing
    from the consumer's view). Retention deletes a prefix, so an event a
    killed relay's partitions still owe holds back everything above it:
    relay kills close together can keep it from deleting anything until
    the drain. Then the check waits for retention (at most 15 s) and runs
    the checker again over what it deleted."""
    def deleted_through():
        return int(run.sql_orders(
            "SELECT coalesce((SELECT deleted_through FROM "
            "outbox_retention_state WHERE id = 1), 0)").strip())

    bad = []
    if report["pruned_from_outbox"] == 0:
        deadline = time.monotonic() + 15
        while deleted_through() == 0 and time.monotonic() < deadline:
            time.sleep(0.25)
        if deleted_through() > 0:
            run.log("retention: nothing deleted while the faults ran (an "
                    "event owed by a killed relay's partitions held the "
                    "prefix back); deleted after the drain, checked again")
            report = run.run_checker(30, "verify-after-retention.json")
            bad += [f"after retention: {v}"
                    for v in run.checker_violations(report, 30)]
    left = run.sql_orders("SELECT count(*), coalesce(min(seq), 0) FROM "
                          "outbox").strip().split("|")
    run.log(f"retention: {report['pruned_from_outbox']} applied events "
            f"deleted from the outbox, {left[0]} rows left (from seq "
            f"{left[1]})")
    if report["pruned_from_outbox"] == 0:
        bad.append(f"retention: --retention={run.scn.relay_flags['retention']}"
                   " deleted no applied event, during the run nor within "
                   "15 s after the drain")
    return bad


def check_rotation(run, report):
    """check_retention on a partitioned outbox, and check_children."""
    return check_retention(run, report) + check_children(run, report)


def check_children(run, report):
    """On a partitioned outbox: what went, went as whole children (what is
    left starts at a child's bound), and the relays made children ahead of
    the sequence as it moved on."""
    bad = []
    row = run.sql_orders(
        "SELECT r.made_to, r.span, (SELECT count(*) FROM pg_inherits WHERE "
        "inhparent = 'outbox'::regclass), (SELECT deleted_through FROM "
        "outbox_retention_state WHERE id = 1), (SELECT last_value FROM "
        "outbox_seq_seq) FROM outbox_rotation r").strip()
    if not row:
        return bad + ["rotation: the outbox is not partitioned"]
    made_to, span, children, through, drawn = (int(x) for x in row.split("|"))
    run.log(f"rotation: {children} children of {span} seqs left, made up to "
            f"{made_to}, the sequence at {drawn}, deleted through {through}")
    if made_to - 1 <= drawn:
        bad.append(f"rotation: no child made ahead of the sequence ({drawn}) "
                   f"beyond {made_to - 1}")
    # Partitioned while empty: the children's bounds are 1 + k * span.
    if through % span != 0:
        bad.append(f"rotation: deleted through {through}, not a child's bound")
    return bad


def check_poison(run, report):
    """I6: exactly the poisoned row is dead, the events behind it on its
    aggregate stay pending and unapplied, every other event is applied."""
    bad = []
    p = run.poisoned
    if p is None:
        return ["I6: no committed OrderCreated row could be poisoned"]
    seq, agg = p
    dead = [ln.split("|") for ln in run.sql_orders(
        "SELECT seq, aggregate_id, attempts, coalesce(last_error, '') "
        "FROM outbox_delivery WHERE status = 'dead' ORDER BY seq"
    ).splitlines() if ln]
    if [int(d[0]) for d in dead] != [seq]:
        bad.append(f"I6: expected exactly row {seq} (aggregate {agg}) dead, "
                   f"dead rows are {[int(d[0]) for d in dead]}")
    elif "schema_version" not in dead[0][3]:
        bad.append(f"I6: dead row {seq} has last_error {dead[0][3]!r}, "
                   "expected it to name schema_version")
    behind = int(run.sql_orders(
        f"SELECT count(*) FROM outbox_deliveries WHERE subscription = "
        f"'billing' AND aggregate_id = '{agg}' AND seq > {seq} AND status "
        f"<> 'pending'").strip())
    if behind:
        bad.append(f"I6: {behind} events behind dead row {seq} of {agg} left "
                   "pending (delivered or dead)")
    applied_behind = int(run.sql_billing(
        f"SELECT count(*) FROM inbox WHERE aggregate_id = '{agg}' AND "
        f"seq >= {seq}").strip())
    if applied_behind:
        bad.append(f"I6: {applied_behind} events of {agg} at or after the "
                   f"dead row {seq} were applied")
    others = report["events"] - report["dead_letters"] - report["behind_dead"]
    applied = report["applied"] - report["phantoms"]  # committed ones (I4)
    if applied != others or report["pending"] or report["lost"]:
        bad.append(f"I6: of {others} events not behind the dead letter, "
                   f"{applied} were applied ({report['pending']} "
                   f"pending, {report['lost']} lost)")
    run.i6 = "ok" if not bad else "VIOLATED"
    run.log(f"I6: dead row {seq} of {agg}, {report['behind_dead']} behind it "
            f"pending, {applied} others applied: "
            f"{'ok' if not bad else 'VIOLATED'}")
    return bad


SCENARIOS = [
    Scenario("relay-kill",
             "SIGKILL relays at random moments (now and then SIGTERM, or "
             "SIGSTOP for 1-3 s); 2 relays share the partitions",
             kill_relays, relays=2),
    Scenario("consumer-kill",
             "SIGKILL the consumer at random moments; 2 producers",
             kill_consumer, producers=2),
    Scenario("consumer-pause",
             "SIGSTOP the consumer for longer than the relay's --ack_timeout "
             f"({ACK_TIMEOUT:g}s), then SIGCONT",
             pause_consumer),
    Scenario("pg-restart",
             "pg_ctl restart -m immediate under load; 2 producers, 2 relays",
             restart_postgres, producers=2, relays=2),
    Scenario("net-relay-consumer",
             "a proxy per relay between relay and consumer: latency, reset "
             "(RST), blackhole",
             net_faults(lambda run: run.rc_proxies), relays=2,
             proxy_relay_consumer=True),
    Scenario("net-db",
             "a proxy per service between it and PostgreSQL: latency, reset "
             "(RST), blackhole",
             net_faults(lambda run: run.db_proxies), relays=2, proxy_db=True),
    Scenario("two-relays-two-consumers",
             "relay A -> consumer A, relay B -> consumer B on one billing "
             "database; one relay killed and kept down a while",
             kill_one_relay, relays=2, consumers=2, pairs=True),
    Scenario("poison",
             "one committed OrderCreated gets schema_version 2; relay "
             "--max_attempts=3 --reject_backoff=50ms",
             poison, relays=2,
             relay_flags={"max_attempts": "3", "reject_backoff": "50ms"},
             expect_dead=1, check=check_poison),
    Scenario("retention",
             "--retention=300ms deletes delivered events as they age while "
             "relays are SIGKILLed, SIGTERMed, SIGSTOPped and now and then "
             "the consumer SIGKILLed; 2 relays",
             kill_relays_and_consumer, relays=2,
             # A killed relay's partitions wait for its leases to lapse, and
             # what they owe holds every delete back (retention deletes a
             # prefix): short leases let it delete between the kills.
             relay_flags={**RETENTION_FLAGS, "lease_ttl": "2s"},
             check=check_retention),
    Scenario("rotation",
             "the outbox partitioned in children of 1,000 seqs: "
             "--retention=300ms drops whole children as their events age "
             "while relays are SIGKILLed, SIGTERMed, SIGSTOPped and now and "
             "then the consumer SIGKILLed; 2 relays",
             kill_relays_and_consumer, relays=2,
             relay_flags={**RETENTION_FLAGS, "lease_ttl": "2s"},
             partition_span=1000, check=check_rotation),
    Scenario("crash-points",
             "OUTBOX_FAULT armed on every binary: each crashes (SIGKILL to "
             "itself) at its crash points; 3 relays, 2 consumers",
             crash_points, relays=3, consumers=2, pairs=True,
             # a crashed relay's partitions wait for its leases to lapse
             relay_flags={"lease_ttl": "2s"},
             fault_env=CRASH_POINTS, check=check_crash_points,
             load_extra=CRASH_POINTS_OVERRUN),
    Scenario("readonly-billing",
             "the billing database turns read-only for seconds at a time (a "
             "failover to a read-only standby, or in place for the whole "
             "server) and back; never a dead letter",
             read_only_periods("billing"), relays=2, health_after_heal=True,
             check=check_gray),
    Scenario("readonly-orders",
             "the orders database turns read-only for seconds at a time (a "
             "failover, or in place for the whole server) and back: the "
             "producer answers UNAVAILABLE, the relays' marks fail",
             read_only_periods("orders"), relays=2, health_after_heal=True,
             check=check_gray),
    Scenario("rogue-lock",
             "a rogue session holds ACCESS EXCLUSIVE on inbox, "
             "aggregate_cursors or outbox for 5-7 s; --lock_timeout=500ms "
             "--stall_timeout=2s: the stalled binaries say NOT_SERVING",
             rogue_locks, relays=2, service_flags=ROGUE_LOCK_FLAGS,
             health_after_heal=True, check=check_rogue_lock,
             load_extra=ROGUE_LOCK_OVERRUN),
    Scenario("billing-refuses-connections",
             "the billing database refuses connections for 2-4 s "
             "(ALLOW_CONNECTIONS false, its sessions terminated)",
             refuse_billing_connections, relays=2, health_after_heal=True,
             check=check_gray),
    Scenario("fan-out",
             "two subscriptions: billing (2 relays, its consumer) and audit "
             "(2 relays --subscription=audit, a consumer --handler=audit on "
             "its own database); the audit consumer is SIGKILLed and "
             "SIGSTOPped; billing's latency must not suffer",
             fan_out_faults, relays=2, audit_relays=2, check=check_fan_out,
             load_extra=FAN_OUT_OVERRUN),
]

BY_NAME = {s.name: s for s in SCENARIOS}

# The scenarios above run as the relays do by default: the subscription is
# delivered from the outbox log (positions, exceptions as rows). The same
# faults with a subscription delivered by rows, one per event
# (--log_delivery=false): group "rows".
def on_rows(s):
    """Scenario `s` as rows-<name>, its relays --log_delivery=false."""
    return replace(s, name=f"rows-{s.name}",
                   summary=f"{s.summary}; delivered by rows, one per event",
                   relay_flags={**s.relay_flags, "log_delivery": "false"})


def on_partitioned(s, how):
    """Scenario `s` as <name>-rotation: the outbox partitioned in children
    of 1,000 seqs before the services start, its relays with --retention
    (RETENTION_FLAGS unless it has its own), `how` what rotation meets
    there; besides its own checks, check_children (and check_retention if
    it ran without retention)."""
    extra = check_children if "retention" in s.relay_flags else check_rotation

    def check(run, report):
        return (s.check(run, report) if s.check else []) + extra(run, report)

    return replace(s, name=f"{s.name}-rotation",
                   summary=f"{s.summary}; on an outbox partitioned in "
                   f"children of 1,000 seqs: {how}",
                   relay_flags={**RETENTION_FLAGS, **s.relay_flags},
                   partition_span=1000, check=check)


ROWS_SCENARIOS = [on_rows(s) for s in SCENARIOS]
