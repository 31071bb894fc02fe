#!/usr/bin/env python3
"""End-to-end failure-injection suite of the outbox (standard library only).

Starts its own PostgreSQL and the real binaries as separate processes,
drives a retrying client load through them, injects one kind of fault per
scenario (process kills and pauses, a database crash, network faults
through its own TCP proxy, a poison event, crash points inside the
binaries, gray database faults: read-only, refused connections, rogue
locks; a NATS JetStream cluster's nodes and links), then heals everything
and lets `outboxctl verify` decide whether every invariant held. See
tests/e2e/README.md; run it as ./scripts/chaos.
"""

import argparse
import atexit
import glob
import json
import os
import random
import shutil
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chaoslib import procs as P  # noqa: E402
from chaoslib.jetstream_scenarios import SCENARIOS as JETSTREAM  # noqa
from chaoslib.pg import Postgres  # noqa: E402
from chaoslib.proxy import ProxyLoop  # noqa: E402
from chaoslib.runner import Run  # noqa: E402
from chaoslib.scenarios import ROWS_SCENARIOS as ROWS  # noqa: E402
from chaoslib.scenarios import SCENARIOS as CORE  # noqa: E402
from chaoslib.topology_scenarios import ROWS_SCENARIOS as TOPOLOGY_ROWS  # noqa
from chaoslib.topology_scenarios import SCENARIOS as TOPOLOGY  # noqa: E402

# Each scenario's group: "core" (one PostgreSQL for everything),
# "topology" (standbys, restores, PgBouncer, a hung server: their own
# servers, chaoslib/topology_scenarios.py), "jetstream" (the relays publish
# to a 3-node NATS JetStream cluster of the scenario's own, the consumers
# read it: chaoslib/jetstream_scenarios.py), all with the subscription on
# the outbox log as the relays' default; or "rows" (core faults and five
# topologies with the subscription delivered by rows, one per event).
ROWS = ROWS + TOPOLOGY_ROWS
SCENARIOS = CORE + TOPOLOGY + ROWS + JETSTREAM
BY_NAME = {s.name: s for s in SCENARIOS}
GROUPS = {"core": CORE, "topology": TOPOLOGY, "rows": ROWS,
          "jetstream": JETSTREAM}

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CI_SECONDS = 7


class Suite:
    def __init__(self, args):
        self.root = ROOT
        self.bin = os.path.abspath(args.bin)
        self.verbose = args.verbose
        self.keep = args.keep
        self.keep_dbs = False
        self.verify_wait = args.wait
        self.sabotage = args.sabotage
        self.tls = not args.plaintext  # mutual TLS on every link
        self.print_lock = threading.Lock()
        from chaoslib.runner import PortPool
        self.ports = PortPool()
        self.pg = None
        self.ploop = None
        self.bin_stamp = self.stamp()

    def stamp(self):
        """The binaries' identity, to notice a rebuild during a scenario."""
        out = {}
        for b in ("outbox-producer", "outbox-relay", "outbox-consumer",
                  "outboxctl"):
            try:
                st = os.stat(os.path.join(self.bin, b))
                out[b] = (st.st_mtime_ns, st.st_size)
            except OSError:
                out[b] = None
        return out


def preflight(args):
    missing = [b for b in ("outbox-producer", "outbox-relay",
                           "outbox-consumer", "outboxctl")
               if not os.access(os.path.join(args.bin, b), os.X_OK)]
    if missing:
        sys.exit(f"chaos: {', '.join(missing)} missing in {args.bin}; build "
                 "first (./scripts/test or ./scripts/up build them)")
    for tool in ("psql", "bash") + (() if args.plaintext else ("openssl",)):
        if shutil.which(tool) is None:
            sys.exit(f"chaos: {tool} is not installed" + (
                " (postgresql-client-15)" if tool == "psql" else
                "; or run with --plaintext" if tool == "openssl" else ""))
    # buf curl polls every process's grpc.health.v1: without it there is no
    # readiness (a TCP connect is not SERVING) and no after-heal check.
    nm = os.path.join(ROOT, "tests", "deploy", "node_modules")
    if not (glob.glob(os.path.join(nm, "@bufbuild", "buf-*", "bin", "buf"))
            or os.path.exists(os.path.join(nm, ".bin", "buf"))):
        sys.exit(f"chaos: buf is missing in {nm} (its health checks need it: "
                 "npm ci in tests/deploy; ./scripts/test installs it)")
    pg_ctl = os.path.join(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"),
                          "pg_ctl")
    if not os.access(pg_ctl, os.X_OK):
        sys.exit(f"chaos: {pg_ctl} missing (Debian package postgresql-15)")


def fmt(v, width, digits=None):
    if v is None:
        s = "-"
    elif isinstance(v, float):
        s = f"{v:.{digits if digits is not None else 1}f}"
    else:
        s = str(v)
    return s.rjust(width)


COLUMNS = [
    # header, key, width
    ("scenario", "scenario", 27),
    ("result", "result", 6),
    ("seed", "seed", 10),
    ("events", "events", 7),
    ("deliv", "deliveries", 7),
    ("dups", "duplicates", 5),
    ("held^", "held_peak", 5),
    ("I1lost", "lost", 6),
    ("I2dup", "duplicate_effects", 5),
    ("I3ord", "order_violations", 5),
    ("I4ph", "phantoms", 4),
    ("I5drain", "drain_seconds", 7),
    ("I6", "i6", 4),
    ("indet", "indeterminate", 5),
    ("gaveup", "gave_up", 6),
    ("faults", "faults", 6),
]


def cell(r, key):
    v = r.get(key)
    if key == "drain_seconds" and v is not None:
        return f"{v:.1f}s" if r.get("drained") else f"NO>{v:.0f}s"
    if key == "lost" and v is not None and r.get("missing_effects"):
        return f"{v}+{r['missing_effects']}"
    return v


def table(results):
    head = " ".join(h.ljust(w) if i == 0 else h.rjust(w)
                    for i, (h, _, w) in enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(" ".join(
            str(cell(r, k)).ljust(w) if i == 0 else fmt(cell(r, k), w)
            for i, (_, k, w) in enumerate(COLUMNS)))
    return "\n".join(lines)


def markdown(results):
    heads = ["scenario", "result", "seed", "events committed",
             "deliveries (dups absorbed)", "held peak", "I1 lost",
             "I2 dup effects", "I3 order", "I4 phantoms", "I5 drain",
             "I6", "indeterminate / given up", "faults"]
    out = ["| " + " | ".join(heads) + " |",
           "|" + "|".join("---" for _ in heads) + "|"]
    for r in results:
        drain = cell(r, "drain_seconds")
        out.append("| " + " | ".join(str(x) for x in [
            f"`{r['scenario']}`", r["result"], r["seed"], r["events"],
            f"{r['deliveries']} ({r['duplicates']})", r["held_peak"],
            cell(r, "lost"), r["duplicate_effects"], r["order_violations"],
            r["phantoms"], drain, r["i6"],
            f"{r['indeterminate']} / {r['gave_up']}", r["faults"]]) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(
        prog="scripts/chaos",
        description="End-to-end failure injection: no loss, no duplicate "
                    "effect, per-aggregate order, under faults.")
    ap.add_argument("--seconds", type=float, default=None,
                    help="load+faults per scenario (default 20; --ci: 7)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of every random choice (default: random, "
                         "printed)")
    ap.add_argument("--scenario", action="append", default=[],
                    help="run only this scenario (repeat, or comma list); "
                         "--list shows them")
    ap.add_argument("--group", action="append", default=[],
                    choices=sorted(GROUPS),
                    help="run the scenarios of this group (repeat): core "
                         "(one PostgreSQL), topology (standbys, restores, "
                         "PgBouncer, a hung server), rows (core faults and "
                         "five topologies, the subscription delivered by "
                         "rows, one per event), "
                         "jetstream (a 3-node NATS JetStream cluster between "
                         "relays and consumers: node kills, restarts, "
                         "pauses, cut links)")
    ap.add_argument("--ci", action="store_true",
                    help=f"short: {CI_SECONDS}s of faults per scenario")
    ap.add_argument("--wait", type=int, default=None,
                    help="seconds the checker waits for the drain (default: "
                         "120 plus 1 per 1000 events pending when the faults "
                         "stop)")
    ap.add_argument("--list", action="store_true", help="list the scenarios")
    ap.add_argument("--keep", action="store_true",
                    help="keep every scenario's logs, not only failed ones")
    ap.add_argument("--verbose", action="store_true",
                    help="also print every restart and minor event")
    ap.add_argument("--json", metavar="PATH",
                    help="write the results as JSON to PATH")
    ap.add_argument("--markdown", metavar="PATH",
                    help="write the scenario table as markdown to PATH")
    ap.add_argument("--sabotage", action="store_true",
                    help="self-check of the harness: corrupt the billing "
                         "database after the load; every scenario must FAIL")
    ap.add_argument("--plaintext", action="store_true",
                    help="no TLS on any link (the default is mutual TLS on "
                         "every link, a throwaway CA per scenario)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.list:
        for s in SCENARIOS:
            group = ("rows" if s in ROWS else getattr(s, "group", "core"))
            print(f"{s.name:28} "
                  + (f"[{group}] " if group != "core" else "") + s.summary)
        return 0
    names = [n for arg in args.scenario for n in arg.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown scenario {', '.join(unknown)}; one of: "
                 + ", ".join(BY_NAME))
    scenarios = [BY_NAME[n] for n in names]
    for g in args.group:
        scenarios += [s for s in GROUPS[g] if s not in scenarios]
    if not scenarios:
        scenarios = list(SCENARIOS)
    seconds = args.seconds if args.seconds is not None else (
        CI_SECONDS if args.ci else 20.0)
    if seconds <= 0:
        ap.error("--seconds must be positive")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    preflight(args)

    suite = Suite(args)

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    atexit.register(P.kill_everything)

    t0 = time.monotonic()
    print(f"chaos: seed {seed}, {seconds:g}s of load and faults per scenario, "
          f"scenarios: {', '.join(s.name for s in scenarios)}", flush=True)
    mode = ("plaintext (--plaintext): no TLS on any link" if args.plaintext
            else "mutual TLS on every link (a throwaway CA and certificates "
                 "per scenario; --plaintext for none)")
    print(f"chaos: {mode}", flush=True)
    print(f"chaos: replay with ./scripts/chaos --seconds {seconds:g} --seed "
          f"{seed}" + (f" --scenario {','.join(names)}" if names else "")
          + "".join(f" --group {g}" for g in args.group)
          + (" --plaintext" if args.plaintext else ""),
          flush=True)
    results = []
    try:
        suite.pg = Postgres(ROOT).start()
        atexit.register(suite.pg.stop)
        print(f"chaos: PostgreSQL on 127.0.0.1:{suite.pg.port} "
              f"({suite.pg.dir})", flush=True)
        suite.ploop = ProxyLoop()
        for i, scn in enumerate(scenarios, 1):
            run = getattr(scn, "run_class", Run)(suite, scn, seconds, seed, i)
            r = run.execute()
            results.append(r)
            print(f"[{scn.name}] {r['result']} in {r['wall_seconds']:.0f}s "
                  f"(replay: {r['replay']})"
                  + (f"; {r['figures']}" if r.get("figures") else ""),
                  flush=True)
    except KeyboardInterrupt:
        print("chaos: interrupted", flush=True)
        return 130
    finally:
        P.kill_everything()
        if suite.ploop is not None:
            suite.ploop.close()
        if suite.pg is not None:
            suite.pg.stop()

    wall = time.monotonic() - t0
    print()
    print(table(results))
    print()
    for r in results:
        for n in r["notes"]:
            print(f"  {r['scenario']}: {n}")
    failed = [r for r in results if r["result"] != "PASS"]
    for r in failed:
        print(f"\n{r['scenario']} {r['result']} (seed {r['seed']}; logs in "
              f"{r['workdir']}); replay: {r['replay']}")
        for v in r["violations"]:
            print(f"  violation: {v}")
        for e in r["errors"]:
            print(f"  error: {e}")
        for ex in r["examples"]:
            print(f"  ! {ex}")
    summary = {"seed": seed, "seconds": seconds,
               "tls": not args.plaintext,
               "wall_seconds": round(wall, 1), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results) + "\n")
    gave_up = sum(r["gave_up"] or 0 for r in results)
    if gave_up:
        print(f"\nclient operations given up: {gave_up} (not a violation: the "
              "checker reads the databases as the truth)")
    print(f"\nchaos: seed {seed}, wall time {wall:.0f}s")
    print(f"chaos: {len(results) - len(failed)} passed, {len(failed)} failed")
    if any(r["violations"] for r in failed):
        return 1
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
