#!/usr/bin/env python3
"""Helper of scripts/bench (Python 3 standard library only).

  bench.py run --out F [--timeout S] -- CMD...   run CMD; write its exit code,
                                                 wall time, CPU time and peak
                                                 RSS (getrusage) to F as JSON
  bench.py pgbench-scripts --tpl DIR --out DIR --producer BINARY
                                                 the pgbench baselines: the
                                                 statements the producer
                                                 binary prints
  bench.py cpu-snap --pgdata D [--pid N=PID].. --out F
  bench.py cpu-diff A B [--client N=RUSAGE_JSON].. --out F
  bench.py sample ...                            P3's sampler (see --help)
  bench.py latency --outbox F --inbox F --out F  P4: created -> applied
  bench.py report --work DIR [--json F]          the final tables (+ JSON, SVG)
  bench.py goals [--markdown | --check README]   the goals (bench_goals.json);
                                                 --check: is README's table
                                                 of them the same?
"""

import argparse
import base64
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import time

# ---------------------------------------------------------------------------
# The producer's SQL, as the producer binary being measured prints it
# (outbox-producer --print_statements: producer/order_store.cc's kCreateSql,
# kReadOrdersSql and kChangeOrdersSql, each with the outbox writer's CTEs),
# so the baselines run the very statements the service runs.
# ---------------------------------------------------------------------------
def producer_statements(binary):
    out = subprocess.run([binary, "--print_statements"], check=True,
                         capture_output=True, text=True).stdout
    st = json.loads(out)
    missing = {"create_orders", "read_orders", "change_orders"} - set(st)
    if missing:
        raise SystemExit("%s --print_statements: no %s" % (binary, ", ".join(sorted(missing))))
    return st


# Values like the load's (tools/load.cc): two items, a 16-hex fingerprint,
# a W3C traceparent. Spaces after the colons: pgbench would read ":5" as a
# variable. The event payloads (serialized outbox.v1.Event holding the
# order message in a google.protobuf.Any) come from --tpl: events the
# producer wrote, so they have its sizes.
ITEMS_JSON = ('[{"sku": "sku-26", "quantity": 5, "unitPriceCents": 561}, '
              '{"sku": "sku-3", "quantity": 4, "unitPriceCents": 5111}]')
FINGERPRINT = "f10337f368679e10"
TRACE = "00-70f8cecd10d4e2943352a59aa3ab30d6-3c6131150fe4e1ae-01"


def substitute(sql, params):
    """Replaces each $N of `sql` with params[N] (parenthesized)."""
    def one(m):
        n = int(m.group(1))
        if n not in params:
            raise SystemExit(f"no substitute for ${n}")
        return "(" + params[n] + ")"
    return re.sub(r"\$(\d+)", one, sql)


def q(s):
    return "'" + s.replace("'", "''") + "'"


def cmd_pgbench_scripts(a):
    st = producer_statements(a.producer)
    create_sql, read_sql, change_sql = (
        st["create_orders"], st["read_orders"], st["change_orders"])
    tpl = {}
    for kind in ("created", "paid", "cancelled"):
        with open(os.path.join(a.tpl, kind + ".hex")) as f:
            tpl[kind] = f.read().strip()
    os.makedirs(a.out, exist_ok=True)
    # The scripts are meant for pgbench -M prepared (the producer prepares
    # its statements too): variables become parameters, so they stand
    # outside quotes, each with a cast. Needs -D i=0 -D run=N.
    #
    # CreateOrder: the producer's statement itself, one order per
    # statement (arrays of one element), in autocommit as the producer runs
    # it, without its NOTIFY: PostgreSQL serializes notifying commits, which
    # costs the producer's few group writers little but 16 pgbench clients
    # two thirds of their rate (1,729-1,985/s with it, 5,413-5,501/s
    # without, in one run), and the baseline is the best form of the work. The idempotency key is unique per run, client and transaction;
    # the order id is its md5 (the event names its order, so both need the
    # same id); event ids come from gen_random_uuid().
    key = "'pgb' || (:run)::text || '-' || (:client_id)::text || '-' || (:i)::text"
    order_id = "md5(" + key + ")::uuid"
    create = substitute(create_sql, {
        1: "ARRAY[" + order_id + "]",
        2: "ARRAY['customer-7']",
        3: "ARRAY[" + q(ITEMS_JSON) + "]",
        4: "ARRAY['EUR']",
        5: "ARRAY[(:total)::bigint]",
        6: "ARRAY[" + key + "]",
        7: "ARRAY[" + q(FINGERPRINT) + "]",
        8: "ARRAY['order']",
        9: "ARRAY[" + order_id + "::text]",
        10: "ARRAY[gen_random_uuid()]",
        11: "ARRAY['OrderCreated']",
        12: "ARRAY[1]",
        13: "ARRAY[" + q(tpl["created"]) + "]",
        14: "ARRAY[" + q(TRACE) + "]",
        15: "ARRAY[(:p)::int]",
        16: "''",  # no NOTIFY: see below
    })
    head = ("-- generated by scripts/lib/bench.py from outbox-producer "
            "--print_statements:\n-- %s\n")
    setup = "\\set p random(0, 31)\n\\set total random(100, 50000)\n\\set i :i + 1\n"
    with open(os.path.join(a.out, "create_unnest.sql"), "w") as f:
        f.write(head % "producer/order_store.cc's kCreateSql")
        f.write(setup + create + ";\n")
    # The same, each event's id checked before its insert as a partitioned
    # outbox would need for an id its caller gives (the retention phase;
    # outbox_event_id_free is scripts/lib/partitioned_outbox.sql's).
    tail = "FROM input i JOIN h USING (aggregate_type, aggregate_id))"
    if create.count(tail) != 1:
        raise SystemExit("the writer's insert no longer ends in: " + tail)
    checked = create.replace(tail, tail[:-1] + " WHERE outbox_event_id_free(i.event_id))")
    with open(os.path.join(a.out, "create_checked.sql"), "w") as f:
        f.write(head % "producer/order_store.cc's kCreateSql, each event_id checked")
        f.write(setup + checked + ";\n")
    # One order row of scalars, a CTE o returning its id; each form below
    # adds its own tail.
    order_row = (
        "WITH o AS (INSERT INTO orders (order_id, customer_id, items, "
        "currency, total_cents, status, version, idempotency_key, "
        "request_hash) VALUES (" + order_id + ", 'customer-7', " +
        q(ITEMS_JSON) + "::jsonb, 'EUR', (:total)::bigint, 'CREATED', 1, " +
        key + ", " + q(FINGERPRINT) + ") "
        "ON CONFLICT (idempotency_key) DO NOTHING "
        "RETURNING order_id::text AS order_id")
    # The same work without the arrays: one statement of scalars (the form
    # a hand-written single-order statement would take).
    scalar = (
        order_row + ", "
        "(extract(epoch from created_at) * 1000000)::bigint AS created_us), "
        "h AS (INSERT INTO outbox_heads AS h (aggregate_type, "
        "aggregate_id, last_seq) SELECT 'order', order_id, "
        "nextval('outbox_seq_seq') FROM o "
        "ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET "
        "prev_seq = h.last_seq, last_seq = nextval('outbox_seq_seq') "
        "RETURNING h.aggregate_id, h.last_seq, h.prev_seq), "
        "e AS (INSERT INTO outbox (seq, event_id, aggregate_type, "
        "aggregate_id, prev_seq, event_type, schema_version, payload, "
        "trace_parent, partition) SELECT h.last_seq, gen_random_uuid(), "
        "'order', h.aggregate_id, h.prev_seq, 'OrderCreated', 1, decode(" +
        q(tpl["created"]) + ", 'hex'), " + q(TRACE) + ", (:p)::int FROM h) "
        "SELECT order_id, created_us FROM o")
    with open(os.path.join(a.out, "create_scalar.sql"), "w") as f:
        f.write("-- generated by scripts/lib/bench.py: CreateOrder's work in "
                "the form of a hand-written\n-- single-order statement (its "
                "writer CTEs as the producer's)\n")
        f.write(setup + scalar + ";\n")
    # The peer's form of CreateOrder (scripts/lib/pgq_peer.py): the same
    # order row and, in the same statement, its event appended to PgQ's
    # queue "orders" (the payload base64 in ev_data, the event and order
    # ids in ev_extra1 and ev_extra2, as pgq_peer.py's consumer reads them).
    pgq = (
        order_row + ") "
        "SELECT pgq.insert_event('orders', 'OrderCreated', " +
        q(base64.b64encode(bytes.fromhex(tpl["created"])).decode()) +
        ", gen_random_uuid()::text, order_id, NULL, NULL) FROM o")
    with open(os.path.join(a.out, "pgq_create.sql"), "w") as f:
        f.write("-- generated by scripts/lib/bench.py: CreateOrder's order "
                "row, its event enqueued in PgQ\n")
        f.write(setup + pgq + ";\n")
    # PayOrder / CancelOrder: read the order, then move it and append the
    # event in one statement, both in autocommit, as OrderStore::WriteRound
    # does for a group of one. Client c's i-th transaction takes order
    # number c * per_client + i (needs -D per_client=N), made beforehand by
    # orders_setup.sql, so each order is changed once, from CREATED like
    # the load's; a client past its share fails loudly (\gset of no row)
    # instead of measuring no-ops.
    read = substitute(read_sql, {
        1: "ARRAY[md5('pgb-order-' || (:n)::text)::uuid]"})
    for name, status, etype, kind in (
            ("pay", "PAID", "OrderPaid", "paid"),
            ("cancel", "CANCELLED", "OrderCancelled", "cancelled")):
        change = substitute(change_sql, {
            1: "ARRAY[(:order_id)::uuid]",
            2: "ARRAY[" + q(status) + "]",
            3: "ARRAY[2::bigint]",
            4: "ARRAY['order']",
            5: "ARRAY[(:order_id)::text]",
            6: "ARRAY[gen_random_uuid()]",
            7: "ARRAY[" + q(etype) + "]",
            8: "ARRAY[1]",
            9: "ARRAY[" + q(tpl[kind]) + "]",
            10: "ARRAY[" + q(TRACE) + "]",
            11: "ARRAY[(:p)::int]",
            12: "''",  # no NOTIFY
        })
        with open(os.path.join(a.out, name + ".sql"), "w") as f:
            f.write(head % "producer/order_store.cc's kReadOrdersSql and "
                    "kChangeOrdersSql")
            f.write("\\set i :i + 1\n\\set n :client_id * :per_client + :i\n"
                    "\\set p random(0, 31)\n")
            f.write(read + " \\gset\n" + change + ";\n")
    # The orders pay.sql and cancel.sql change, numbered 1 to psql variable
    # :orders, as CreateOrder leaves them: the order, its chain head and
    # its OrderCreated event (owed to the subscriptions by the outbox's
    # trigger, like the producer's).
    with open(os.path.join(a.out, "orders_setup.sql"), "w") as f:
        f.write(
            "-- generated by scripts/lib/bench.py: the orders of pay.sql "
            "and cancel.sql\n"
            "WITH n AS (SELECT g, md5('pgb-order-' || g)::uuid AS order_id, "
            "nextval('outbox_seq_seq') AS seq "
            "FROM generate_series(1, :orders) g), "
            "o AS (INSERT INTO orders (order_id, customer_id, items, "
            "currency, total_cents, status, version, idempotency_key, "
            "request_hash) SELECT order_id, 'customer-7', " + q(ITEMS_JSON) +
            "::jsonb, 'EUR', 100 + g % 50000, 'CREATED', 1, "
            "'pgb-setup-' || g, " + q(FINGERPRINT) + " FROM n), "
            "h AS (INSERT INTO outbox_heads (aggregate_type, aggregate_id, "
            "last_seq) SELECT 'order', order_id::text, seq FROM n) "
            "INSERT INTO outbox (seq, event_id, aggregate_type, aggregate_id, "
            "prev_seq, event_type, schema_version, payload, trace_parent, "
            "partition) SELECT seq, gen_random_uuid(), 'order', "
            "order_id::text, 0, 'OrderCreated', 1, decode(" +
            q(tpl["created"]) + ", 'hex'), " + q(TRACE) + ", g % 32 "
            "FROM n;\n")


# ---------------------------------------------------------------------------
# run: a command with its resource usage
# ---------------------------------------------------------------------------
def cmd_run(a):
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    start = time.time()
    child = subprocess.Popen(cmd)
    stopping = {"why": None}

    def forward(sig, _frame):
        stopping["why"] = "signal %d" % sig
        try:
            child.terminate()
        except ProcessLookupError:
            pass
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = None
    while rc is None:
        try:
            rc = child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if a.timeout and time.time() - start > a.timeout and not stopping["why"]:
                stopping["why"] = "timeout after %.0f s" % a.timeout
                child.terminate()
            elif stopping["why"] and time.time() - start > (a.timeout or 0) + 10:
                child.kill()
    end = time.time()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {"rc": rc, "start": start, "end": end, "wall_s": end - start,
           "cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_kb": ru.ru_maxrss,
           "stopped": stopping["why"]}
    with open(a.out, "w") as f:
        json.dump(out, f)
    sys.exit(rc if rc >= 0 else 128 - rc)


# ---------------------------------------------------------------------------
# CPU accounting from /proc
# ---------------------------------------------------------------------------
TICK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid):
    """(ppid, own cpu s, reaped children's cpu s) of a process, or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            s = f.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    # fields after "(comm)": state ppid ... utime(14) stime(15) cutime cstime
    ppid = int(rest[1])
    ut, st, cut, cst = (int(x) for x in rest[11:15])
    return ppid, (ut + st) / TICK, (cut + cst) / TICK


def machine_busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / TICK


def cmd_cpu_snap(a):
    snap = {"t": time.time(), "busy": machine_busy(), "procs": {}}
    if a.pgdata:
        try:
            with open(os.path.join(a.pgdata, "data", "postmaster.pid")) as f:
                pm = int(f.readline())
            st = proc_stat(pm)
            total = st[1] + st[2] if st else 0
            for d in os.listdir("/proc"):
                if d.isdigit():
                    c = proc_stat(int(d))
                    if c and c[0] == pm:
                        total += c[1]
            snap["procs"]["postgres"] = total
        except OSError:
            pass
    for spec in a.pid or []:
        name, pid = spec.split("=", 1)
        st = proc_stat(int(pid)) if pid.isdigit() else None
        if st:
            snap["procs"][name] = st[1]
    with open(a.out, "w") as f:
        json.dump(snap, f)


def cmd_cpu_diff(a):
    with open(a.a) as f:
        x = json.load(f)
    with open(a.b) as f:
        y = json.load(f)
    wall = y["t"] - x["t"]
    out = {"wall_s": round(wall, 3), "cores_busy": None, "cpu_s": {}}
    for name, v in y["procs"].items():
        out["cpu_s"][name] = round(v - x["procs"].get(name, 0.0), 2)
    for spec in a.client or []:
        name, path = spec.split("=", 1)
        try:
            with open(path) as f:
                out["cpu_s"][name] = round(json.load(f)["cpu_s"], 2)
        except (OSError, ValueError, KeyError):
            pass
    busy = y["busy"] - x["busy"]
    out["machine_busy_s"] = round(busy, 2)
    out["cpu_s"]["other"] = round(max(0.0, busy - sum(out["cpu_s"].values())), 2)
    if wall > 0:
        out["cores_busy"] = round(busy / wall, 2)
    with open(a.out, "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------------------
# P3's sampler
# ---------------------------------------------------------------------------
class Psql:
    """One psql session kept open: a sample costs a query, not a connection."""

    def __init__(self, url):
        self.p = subprocess.Popen(
            ["psql", "-X", "-qAt", "-v", "ON_ERROR_STOP=0", url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, bufsize=1)

    def query(self, sql):
        self.p.stdin.write(sql + ";\n\\echo __END__\n")
        self.p.stdin.flush()
        lines = []
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError("psql ended")
            line = line.rstrip("\n")
            if line == "__END__":
                return lines
            lines.append(line)

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(timeout=5)
        except Exception:  # noqa: BLE001
            self.p.kill()


def seq_value(name):
    return "(SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM %s)" % name


def slope(points):
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        return 0.0
    return sum((p[0] - mx) * (p[1] - my) for p in points) / sxx


def cmd_sample(a):
    orders = Psql(a.orders)
    billing = Psql(a.billing)
    inbox_seq = billing.query("SELECT pg_get_serial_sequence('inbox', 'apply_id')")[0]
    # Pending as the bench counts it (its pending_sql): delivery rows on
    # rows, what the positions have not passed on the log.
    q_orders = "SELECT %s, %s" % (seq_value("outbox_seq_seq"), a.pending_sql)
    q_billing = "SELECT " + seq_value(inbox_seq)
    base_c = int(orders.query(q_orders)[0].split("|")[0])
    base_a = int(billing.query(q_billing)[0])
    samples = []  # [t, committed, pending, applied]
    t0 = time.time()
    load_end = drained_at = None
    deadline = t0 + a.max_seconds
    next_t = t0
    try:
        while time.time() < deadline:
            c, p = (int(x) for x in orders.query(q_orders)[0].split("|"))
            ap = int(billing.query(q_billing)[0])
            now = time.time()
            samples.append([round(now - t0, 3), c - base_c, p, ap - base_a])
            if load_end is None and os.path.exists(a.done_file):
                with open(a.done_file) as f:
                    txt = f.read().strip()
                load_end = float(txt) if txt else now
            if load_end is not None and p == 0:
                drained_at = now
                break
            step = a.interval if load_end is None else a.fast_interval
            next_t += step
            if load_end is not None:
                next_t = max(next_t, time.time())
            time.sleep(max(0.0, next_t - time.time()))
    finally:
        orders.close()
        billing.close()
    out = {"interval_s": a.interval, "t0": t0, "samples": samples,
           "columns": ["t_s", "committed", "pending", "applied"]}
    if load_end is not None:
        out["load_end_s"] = round(load_end - t0, 3)
    if drained_at is not None and load_end is not None:
        out["drain_after_stop_s"] = round(max(0.0, drained_at - load_end), 3)
    # The load window: from the first sample to the load's end.
    end = (load_end - t0) if load_end is not None else samples[-1][0]
    window = [s for s in samples if s[0] <= end]
    if window:
        out["max_pending"] = max(s[2] for s in window)
        half = [s for s in window if s[0] >= end / 2]
        out["mean_pending_last_half"] = round(sum(s[2] for s in half) / max(1, len(half)), 1)
        out["pending_slope_last_half_per_s"] = round(slope([(s[0], s[2]) for s in half]), 2)
        last = window[-1]
        out["committed_in_load"] = last[1]
        out["commit_rate_per_s"] = round(last[1] / max(1e-3, last[0]), 1)
        out["applied_rate_per_s"] = round(last[3] / max(1e-3, last[0]), 1)
        if half:
            dt = max(1e-3, half[-1][0] - half[0][0])
            rate_half = (half[-1][1] - half[0][1]) / dt
            out["commit_rate_last_half_per_s"] = round(rate_half, 1)
            # Bounded: the backlog grows, over the last half, by less than 2%
            # of what was committed meanwhile (a relay that keeps up shows a
            # slope near 0; one that falls behind, the rate difference).
            out["bounded"] = out["pending_slope_last_half_per_s"] <= 0.02 * max(1.0, rate_half)
    with open(a.out, "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------------------
# P4: created -> applied
# ---------------------------------------------------------------------------
def percentile(sorted_vals, p):
    if not sorted_vals:
        return None
    k = max(0, min(len(sorted_vals) - 1, int(math.ceil(p * len(sorted_vals))) - 1))
    return sorted_vals[k]


def read_pairs(path):
    out = {}
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 2:
                out[parts[0]] = int(parts[1])
    return out


def cmd_latency(a):
    created = read_pairs(a.outbox)
    applied = read_pairs(a.inbox)
    lat = sorted((applied[e] - c) / 1000.0 for e, c in created.items() if e in applied)
    out = {"events": len(created), "joined": len(lat),
           "not_applied": len(created) - len(lat)}
    if lat:
        out.update({
            "p50_ms": round(percentile(lat, 0.50), 3),
            "p90_ms": round(percentile(lat, 0.90), 3),
            "p99_ms": round(percentile(lat, 0.99), 3),
            "p999_ms": round(percentile(lat, 0.999), 3),
            "max_ms": round(lat[-1], 3), "min_ms": round(lat[0], 3),
            "mean_ms": round(sum(lat) / len(lat), 3),
        })
        # Histogram: 10 log-spaced bins per decade from 0.1 ms.
        bins = {}
        for v in lat:
            b = int(math.floor(10 * math.log10(max(v, 0.1) / 0.1)))
            bins[b] = bins.get(b, 0) + 1
        out["histogram"] = [
            {"lo_ms": round(0.1 * 10 ** (b / 10), 4),
             "hi_ms": round(0.1 * 10 ** ((b + 1) / 10), 4), "count": n}
            for b, n in sorted(bins.items())]
        # CDF, at most 400 points.
        step = max(1, len(lat) // 400)
        pts = [[round(lat[i], 3), round((i + 1) / len(lat), 5)]
               for i in range(0, len(lat), step)]
        if pts[-1][1] != 1.0:
            pts.append([round(lat[-1], 3), 1.0])
        out["cdf"] = pts
    with open(a.out, "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------
def load_results(work):
    """results.tsv: KEY<TAB>VALUE lines; VALUE @FILE loads a JSON file; rss.*
    keys keep their maximum; error.* keys their first message."""
    res = {}
    path = os.path.join(work, "results.tsv")
    if not os.path.exists(path):
        return res
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if "\t" not in line:
                continue
            k, v = line.split("\t", 1)
            if v.startswith("@"):
                try:
                    with open(v[1:]) as jf:
                        v = json.load(jf)
                except (OSError, ValueError):
                    v = None
            else:
                try:
                    v = int(v)
                except ValueError:
                    try:
                        v = float(v)
                    except ValueError:
                        pass
            if k.startswith("rss.") and k in res:
                res[k] = max(res[k], v)
            elif k.startswith("error.") and k in res:
                pass
            else:
                res[k] = v
    return res


def nest(flat):
    root = {}
    for k, v in flat.items():
        node = root
        parts = k.split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = {} if nxt is None else {"_": nxt}
                node[p] = nxt
            node = nxt
        if isinstance(node.get(parts[-1]), dict):
            node[parts[-1]]["_"] = v
        else:
            node[parts[-1]] = v
    return root


def fmt_num(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if abs(v) >= 100:
        s = "{:,.0f}".format(v)
    elif abs(v) >= 10:
        s = "%.1f" % v
    else:
        s = "%.2f" % v
    return s + unit


# ---------------------------------------------------------------------------
# goals: scripts/lib/bench_goals.json, the one place they live
# ---------------------------------------------------------------------------
GOALS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_goals.json")
README_BEGIN = "<!-- bench goals: scripts/lib/bench.py goals --markdown -->"
README_END = "<!-- end of bench goals -->"


def load_goals():
    with open(GOALS_FILE) as f:
        return {x["id"]: x for x in json.load(f)["goals"]}


def goal_text(x):
    cmp = {">=": "≥", "<=": "≤", "<": "<"}[x["cmp"]]
    v = x["value"]
    v = ("%g" % v)
    if x["kind"] == "ratio":
        return "%s %s×" % (cmp, v)
    return "%s %s %s" % (cmp, v, {"seconds": "s", "ms": "ms", "MB": "MB"}[x["kind"]])


def goal_met(x, value):
    v = x["value"]
    return {">=": value >= v, "<=": value <= v, "<": value < v}[x["cmp"]]


def goals_markdown():
    lines = ["| goal | figure | against (same run) | target |", "|---|---|---|---|"]
    with open(GOALS_FILE) as f:
        for x in json.load(f)["goals"]:
            lines.append("| %s | %s | %s | %s |" % (x["id"], x["figure"], x["against"],
                                                    goal_text(x)))
    return "\n".join(lines)


def cmd_goals(a):
    table = goals_markdown()
    if a.check:
        with open(a.check) as f:
            text = f.read()
        if README_BEGIN not in text or README_END not in text:
            sys.exit("%s: no table of the bench's goals (between %r and %r)" %
                     (a.check, README_BEGIN, README_END))
        shown = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
        if shown != table:
            sys.exit("%s shows other goals than %s; put there:\n%s" % (a.check, GOALS_FILE, table))
        print("ok")
    elif a.markdown:
        print(table)
    else:
        for x in load_goals().values():
            print("%-13s %-10s %s (against: %s)" % (x["id"], goal_text(x), x["figure"], x["against"]))


def cmd_report(a):
    r = load_results(a.work)
    g = r.get
    goals = load_goals()

    def err(*units):
        for u in units:
            if ("error." + u) in r:
                return "error"
        return None

    def not_run(*units):
        return all(("ran." + u) not in r for u in units)

    rows = []  # figure, value, baseline, ratio, goal, met

    def ratio_row(name, units, value, vunit, base, bunit, base_label, goal_id):
        # goal_id None: a figure set beside a peer's, without a goal.
        x = goals[goal_id] if goal_id else None
        gt = goal_text(x) if x else "-"
        if not_run(*units):
            return rows.append([name, "not run", "", "", gt, ""])
        e = err(*units)
        if value is None or base is None or not base:
            return rows.append([name, e or fmt_num(value, vunit),
                                (base_label + " " + fmt_num(base, bunit)) if base else (e or "-"),
                                "-", gt, e or ("?" if x else "-")])
        ratio = value / base
        rows.append([name, fmt_num(value, vunit), base_label + " " + fmt_num(base, bunit),
                     "%.2f" % ratio, gt,
                     ("yes" if goal_met(x, ratio) else "NO") if x else "-"])

    def bound_row(name, unit, value, base, goal_id, e):
        x = goals[goal_id]
        rows.append([name, fmt_num(value, " " + unit) if value is not None else (e or "-"),
                     base, "-", goal_text(x),
                     ("yes" if goal_met(x, value) else "NO") if value is not None else (e or "?")])

    # P1
    for op, label in (("create", "CreateOrder"), ("pay", "PayOrder"), ("cancel", "CancelOrder")):
        u = "p1-" + op
        base = g("p1.%s.pgbench_tps" % op)
        blabel = "pgbench"
        if op == "create" and base is not None:
            blabel = "pgbench, %s form" % g("p1.create.pgbench_best_form", "?")
        ratio_row("P1 %s over gRPC, %s clients (calls/s)" % (label, g("p1.clients", "?")), [u],
                  g("p1.%s.grpc_rate" % op), "/s", base, "/s", blabel, "p1")
    ratio_row("P1 CreateOrder over gRPC vs PgQ (calls/s)", ["p1-create", "pgq"],
              g("p1.create.grpc_rate"), "/s", g("pgq.enqueue_tps"), "/s",
              "pgbench, order row + pgq.insert_event", None)
    # P2
    drain = "P2 drain of a %s-event backlog (events/s)" % fmt_num(g("p2.events"))
    ratio_row(drain, ["p2"], g("p2.drain_rate"), "/s", g("p2.baseline_rows_per_s"), " rows/s",
              "pgbench 128-row inserts", "p2_inserts")
    ratio_row(drain, ["p2", "pgq"], g("p2.drain_rate"), "/s", g("pgq.drain_same.rate"), "/s",
              "PgQ, consumer in its database", "p2_pgq_same")
    ratio_row(drain, ["p2", "pgq"], g("p2.drain_rate"), "/s", g("pgq.drain_other.rate"), "/s",
              "PgQ, consumer to another database", "p2_pgq_other")
    ratio_row("Fan-out: outbox server CPU per event, 4 subscriptions", ["fanout"],
              g("fanout.4.cpu_us_per_event"), " µs", g("fanout.1.cpu_us_per_event"), " µs",
              "1 subscription", "fanout")
    # P3
    u = "p3"
    if not_run(u):
        rows.append(["P3 sustained load: backlog bounded", "not run", "", "", "bounded", ""])
        rows.append(["P3 backlog 0 after the load stops", "not run", "", "", "≤ 2 s", ""])
    else:
        s = g("p3.series") or {}
        e = err(u)
        if s.get("max_pending") is not None:
            rows.append([
                "P3 sustained load: backlog bounded",
                "max %s, last-half slope %+.0f/s" % (fmt_num(s.get("max_pending")),
                                                    s.get("pending_slope_last_half_per_s", 0)),
                "commits %s/s (load %s of target %s calls/s)" % (
                    fmt_num(s.get("commit_rate_per_s")), fmt_num(g("p3.load_rate")),
                    fmt_num(g("p3.target_rate"))),
                "-", "bounded", "yes" if s.get("bounded") else "NO"])
        else:
            rows.append(["P3 sustained load: backlog bounded", e or "-", "-", "-", "bounded", e or "?"])
        d = s.get("drain_after_stop_s")
        rows.append(["P3 backlog 0 after the load stops",
                     (fmt_num(d, " s") if d is not None else (e or "not drained")),
                     "-", "-", goal_text(goals["p3"]),
                     ("yes" if goal_met(goals["p3"], d) else "NO") if d is not None else (e or "NO")])
    # P4
    for key, label in (("fresh", "fresh databases"), ("history", "behind %s rows of history" % fmt_num(g("p4.history.rows")))):
        u = "p4-" + key
        lat = g("p4.%s.latency" % key) or {}
        rate = g("p4.%s.load_rate" % key)
        target = g("p4.%s.target_rate" % key)
        rule = "fixed" if g("p4.%s.target_fixed" % key) == 1 else "= ½ max"
        base = ("at %s calls/s (target %s %s)" % (fmt_num(rate), fmt_num(target), rule)
                if rate is not None else "-")
        for pct in ("p50", "p99"):
            name = "P4 latency %s, %s (created→applied)" % (pct, label)
            if not_run(u):
                rows.append([name, "not run", "", "", goal_text(goals["p4_" + pct]), ""])
                continue
            bound_row(name, "ms", lat.get(pct + "_ms"), base, "p4_" + pct, err(u))
    # The peer's latency, PgQ ticking every 10 ms, at the same rate.
    if not not_run("pgq"):
        lat = g("pgq.latency") or {}
        e = err("pgq")
        for pct in ("p50", "p99"):
            v = lat.get(pct + "_ms")
            rows.append(["PgQ latency %s, 10 ms ticks (created→applied)" % pct,
                         fmt_num(v, " ms") if v is not None else (e or "-"),
                         "at %s/s (target %s)" % (fmt_num(g("pgq.latency.load_rate")),
                                                 fmt_num(g("pgq.latency.target_rate"))),
                         "-", "-", "-"])
    # P4's diagnostic (not a goal): relay and consumer at nice -10, ahead
    # of the load client, the producer and PostgreSQL for the CPU.
    if not not_run("p4-priority"):
        lat = g("p4.priority.latency") or {}
        rate = g("p4.priority.load_rate")
        e = err("p4-priority")
        for pct in ("p50", "p99"):
            v = lat.get(pct + "_ms")
            rows.append(["P4 %s, fresh, relay and consumer at nice -10 (diagnostic)" % pct,
                         fmt_num(v, " ms") if v is not None else (e or "-"),
                         "at %s calls/s" % fmt_num(rate) if rate is not None else "-",
                         "-", "-", "-"])
    # P5
    ratio_row("P5 drain with %s delivered rows of history (events/s)" % fmt_num(g("p5.history_rows")),
              ["p5"], g("p5.drain_rate"), "/s", g("p5.drain_empty_rate"), "/s",
              "empty outbox, rounds alternating", "p5")
    ratio_row("P5 CreateOrder with %s orders (calls/s)" % fmt_num(g("p5.history_rows")),
              ["p5"], g("p5.create_rate"), "/s", g("p5.create_empty_rate"), "/s",
              "empty, rounds alternating", "p5")
    # P6
    rss = {k[4:]: v for k, v in r.items() if k.startswith("rss.")}
    services = ("outbox-producer", "outbox-relay", "outbox-consumer")
    peak = {b: max([v for k, v in rss.items() if k.endswith("." + b)] or [None],
                   key=lambda x: -1 if x is None else x) for b in services}
    for b in services:
        v = peak[b]
        rows.append(["P6 peak RSS %s (VmHWM, all phases)" % b,
                     fmt_num(v / 1024.0, " MB") if v else "-", "-", "-", goal_text(goals["p6"]),
                     ("yes" if goal_met(goals["p6"], v / 1024.0) else "NO") if v else "-"])
    # P7
    n7 = fmt_num(g("p7.chain_events"))
    ratio_row("P7 drain of a %s-event chain on one aggregate (events/s)" % n7, ["p7"],
              g("p7.chain_rate"), "/s", g("p7.many_rate"), "/s", "%s aggregates" % n7, "p7")

    # Through JetStream, beside the direct gRPC path in the same phase (no
    # goal: what the broker's replication costs).
    n_js = fmt_num(g("js.backlog"))
    ratio_row("JetStream drain of a %s-event backlog, replicas=3 (events/s)" % n_js, ["js"],
              g("js.jetstream.drain_rate"), "/s", g("js.grpc.drain_rate"), "/s",
              "direct gRPC, same phase", None)
    if not not_run("js"):
        for path, label in (("jetstream", "through JetStream"), ("grpc", "direct gRPC")):
            lat = g("p4.js_%s.latency" % path) or {}
            for pct in ("p50", "p99"):
                v = lat.get(pct + "_ms")
                rows.append(["Latency %s %s (created→applied)" % (pct, label),
                             fmt_num(v, " ms") if v is not None else (err("js") or "-"),
                             "at %s calls/s (target %s)" % (
                                 fmt_num(g("p4.js_%s.load_rate" % path)), fmt_num(g("js.rate"))),
                             "-", "-", "-"])

    # Retention (no goal): what removing delivered events costs the outbox
    # database, the relay's deletes plus the VACUUM of what they left,
    # against TRUNCATE of seq-range partitions holding the same rows.
    def total(*keys):
        vals = [g(k) for k in keys]
        return None if any(v is None for v in vals) else sum(vals)
    n_ret = fmt_num(g("retention.events"))
    for what, key, unit in (("database CPU", "cpu_us", " µs"), ("WAL", "wal_b", " B")):
        name = "Retention of %s events: %s per event (delete + vacuum)" % (n_ret, what)
        cost = total("retention.prune_" + key, "retention.vacuum_" + key)
        ratio_row(name, ["retention"], cost, unit, g("retention.truncate_" + key), unit,
                  "TRUNCATE of partitions", None)
        ratio_row(name, ["retention"], cost, unit, g("retention.write_" + key), unit,
                  "the producer writing them", None)
    # Rotation as the relay does it (outboxctl partition-outbox, then
    # --retention dropping whole children), against the row deletes above,
    # and the drain on that outbox against the plain one's.
    for what, key, unit in (("database CPU", "cpu_us", " µs"), ("WAL", "wal_b", " B")):
        ratio_row("Rotation by the relay: %s per event dropped" % what, ["retention"],
                  g("retention.rotate_" + key), unit, total("retention.prune_" + key,
                                                            "retention.vacuum_" + key),
                  unit, "the relay's deletes + VACUUM", None)
    ratio_row("Rotation: the relay's drop rate (events/s)", ["retention"],
              g("retention.rotate_rate"), "/s", g("retention.prune_rate"), "/s",
              "the relay's delete rate", None)
    ratio_row("Drain of the retention phase's backlog on a partitioned outbox (events/s)",
              ["retention"], g("retention.drain_rotated"), "/s", g("retention.drain_plain"), "/s",
              "the same on a plain outbox", None)
    # What rotation's partitions would cost every write, against what it
    # saves: CreateOrder's server CPU per call (pgbench) on a partitioned
    # outbox, then with a caller-given event_id's check, against a plain one.
    plain = g("retention.create_plain.cpu_us")
    for form, label in (("parted", "seq-partitioned outbox"),
                        ("checked", "seq-partitioned outbox, event_id checked")):
        ratio_row("Retention by partitions: CreateOrder server CPU per call, %s" % label,
                  ["retention"], g("retention.create_%s.cpu_us" % form), " µs", plain, " µs",
                  "plain outbox", None)
    ratio_row("Retention: the relay's delete rate (events/s)", ["retention", "p1-create"],
              g("retention.prune_rate"), "/s", g("p1.create.grpc_rate"), "/s",
              "P1 CreateOrder's rate", None)

    widths = [max(len(str(row[i])) for row in rows + [HEAD]) for i in range(6)]
    lines = []
    lines.append("  ".join(str(h).ljust(widths[i]) for i, h in enumerate(HEAD)))
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(widths[i]) for i, c in enumerate(row)))
    print("\n".join(lines))

    # RSS table: phase x binary
    phases = []
    for k in rss:
        ph = k.rsplit(".", 1)[0]
        if ph not in phases:
            phases.append(ph)
    bins = list(services) + ["outboxctl"]
    print("\nPeak RSS (VmHWM; outboxctl: getrusage maxrss) in MB at the end of each phase; goal %s"
          % goal_text(goals["p6"]))
    hdr = ["phase"] + bins
    table = [hdr]
    for ph in phases:
        table.append([ph] + [fmt_num(rss.get(ph + "." + b) / 1024.0) if rss.get(ph + "." + b) else "-"
                             for b in bins])
    table.append(["max"] + [fmt_num(max([v for k, v in rss.items() if k.endswith("." + b)]) / 1024.0)
                            if any(k.endswith("." + b) for k in rss) else "-" for b in bins])
    w = [max(len(row[i]) for row in table) for i in range(len(hdr))]
    for row in table:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(row)))

    # CPU split of the measured windows
    cpus = {k[4:]: v for k, v in r.items() if k.startswith("cpu.") and isinstance(v, dict)}
    if cpus:
        print("\nCPU seconds by process during each measured window (2 cores = 2 s per s of wall)")
        names = ["postgres", "producer", "relay", "consumer", "client", "other"]
        table = [["window", "wall s", "busy cores"] + names]
        for k, v in cpus.items():
            c = v.get("cpu_s", {})
            table.append([k, fmt_num(v.get("wall_s")), fmt_num(v.get("cores_busy"))] +
                         [fmt_num(c.get(n)) if n in c else "-" for n in names])
        w = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            print("  ".join(c.ljust(w[i]) for i, c in enumerate(row)))

    errors = {k[6:]: v for k, v in r.items() if k.startswith("error.")}
    if errors:
        print("\nErrors:")
        for k, v in errors.items():
            print("  %s: %s" % (k, v))
    warnings = [v for k, v in r.items() if k.startswith("warning.")]
    for wtxt in warnings:
        print("warning: %s" % wtxt)

    if a.json:
        doc = {"figures": [dict(zip(["figure", "value", "baseline", "ratio", "goal", "met"], row))
                           for row in rows],
               "raw": nest(r)}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        svg = os.path.splitext(a.json)[0] + ".svg"
        with open(svg, "w") as f:
            f.write(make_svg(r))
        print("\nraw numbers: %s\ncharts: %s" % (a.json, svg))


HEAD = ["figure", "value", "baseline", "ratio", "goal", "met?"]


# ---------------------------------------------------------------------------
# SVG
# ---------------------------------------------------------------------------
def nice_ticks(lo, hi, n=5):
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    t = math.ceil(lo / step) * step
    out = []
    while t <= hi + 1e-9:
        out.append(t)
        t += step
    return out


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Panel:
    def __init__(self, x, y, w, h, title, xlabel, ylabel, xr, yr, logx=False):
        self.x, self.y, self.w, self.h = x, y, w, h
        self.xr, self.yr, self.logx = xr, yr, logx
        self.parts = []
        self.parts.append('<rect x="%d" y="%d" width="%d" height="%d" fill="#fff" stroke="#999"/>' % (x, y, w, h))
        self.parts.append('<text x="%d" y="%d" font-size="14" font-weight="bold">%s</text>' % (x, y - 8, esc(title)))
        self.parts.append('<text x="%d" y="%d" font-size="11" text-anchor="middle">%s</text>' % (x + w / 2, y + h + 32, esc(xlabel)))
        self.parts.append('<text x="%d" y="%d" font-size="11" text-anchor="middle" transform="rotate(-90 %d %d)">%s</text>'
                          % (x - 52, y + h / 2, x - 52, y + h / 2, esc(ylabel)))
        if logx:
            lo, hi = xr
            d = math.floor(math.log10(lo))
            while 10 ** d <= hi * 1.0001:
                v = 10 ** d
                if v >= lo:
                    px = self.px(v)
                    self.parts.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#eee"/>' % (px, y, px, y + h))
                    self.parts.append('<text x="%.1f" y="%d" font-size="10" text-anchor="middle">%s</text>' % (px, y + h + 14, ("%g" % v)))
                d += 1
        else:
            for t in nice_ticks(*xr):
                px = self.px(t)
                self.parts.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#eee"/>' % (px, y, px, y + h))
                self.parts.append('<text x="%.1f" y="%d" font-size="10" text-anchor="middle">%g</text>' % (px, y + h + 14, t))
        for t in nice_ticks(*yr):
            py = self.py(t)
            self.parts.append('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#eee"/>' % (x, py, x + w, py))
            self.parts.append('<text x="%d" y="%.1f" font-size="10" text-anchor="end">%s</text>' % (x - 4, py + 3, fmt_tick(t)))

    def px(self, v):
        lo, hi = self.xr
        if self.logx:
            v = max(v, lo)
            return self.x + self.w * (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        return self.x + self.w * (v - lo) / ((hi - lo) or 1)

    def py(self, v):
        lo, hi = self.yr
        return self.y + self.h - self.h * (v - lo) / ((hi - lo) or 1)

    def line(self, pts, color, width=1.5, dash=None):
        if not pts:
            return
        d = " ".join("%.1f,%.1f" % (self.px(a), self.py(b)) for a, b in pts)
        self.parts.append('<polyline fill="none" stroke="%s" stroke-width="%s"%s points="%s"/>'
                          % (color, width, ' stroke-dasharray="%s"' % dash if dash else "", d))

    def vline(self, xv, color, label=None):
        px = self.px(xv)
        self.parts.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="%s" stroke-dasharray="4,3"/>'
                          % (px, self.y, px, self.y + self.h, color))
        if label:
            self.parts.append('<text x="%.1f" y="%d" font-size="10" fill="%s">%s</text>' % (px + 3, self.y + 12, color, esc(label)))

    def legend(self, items):
        yy = self.y + 14
        for color, label in items:
            self.parts.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"/>'
                              % (self.x + self.w - 190, yy - 4, self.x + self.w - 170, yy - 4, color))
            self.parts.append('<text x="%d" y="%d" font-size="10">%s</text>' % (self.x + self.w - 165, yy, esc(label)))
            yy += 14

    def svg(self):
        return "\n".join(self.parts)


def fmt_tick(t):
    if abs(t) >= 1000:
        return "%gk" % (t / 1000)
    return "%g" % t


def make_svg(r):
    width, left = 960, 80
    panels = []
    y = 40
    s = r.get("p3.series") or {}
    samples = s.get("samples") or []
    if len(samples) >= 2:
        end = s.get("load_end_s")
        tmax = samples[-1][0]
        # Rates between samples, averaged over ~1 s.
        rates = []
        for i in range(1, len(samples)):
            j = i
            while j > 0 and samples[i][0] - samples[j - 1][0] < 1.0:
                j -= 1
            j = max(0, j - 1) if samples[i][0] - samples[j][0] < 0.2 else j
            dt = samples[i][0] - samples[j][0]
            if dt <= 0:
                continue
            rates.append((samples[i][0], (samples[i][1] - samples[j][1]) / dt,
                          (samples[i][3] - samples[j][3]) / dt))
        ymax = max([max(a, b) for _, a, b in rates] + [1]) * 1.1
        p = Panel(left, y, width - left - 30, 200,
                  "P3 sustained load: events committed and applied per second",
                  "seconds since the load started", "events/s", (0, tmax), (0, ymax))
        p.line([(t, a) for t, a, _ in rates], "#1f77b4")
        p.line([(t, b) for t, _, b in rates], "#d62728", dash="5,3")
        if end is not None:
            p.vline(end, "#555", "load stops")
        p.legend([("#1f77b4", "committed (outbox)"), ("#d62728", "applied (inbox)")])
        panels.append(p)
        y += 270
        pmax = max([smp[2] for smp in samples] + [1]) * 1.1
        p = Panel(left, y, width - left - 30, 180,
                  "P3 pending backlog (events not yet delivered)",
                  "seconds since the load started", "events pending", (0, tmax), (0, pmax))
        p.line([(smp[0], smp[2]) for smp in samples], "#2ca02c")
        if end is not None:
            p.vline(end, "#555", "load stops")
            if s.get("drain_after_stop_s") is not None:
                p.vline(end + s["drain_after_stop_s"], "#2ca02c",
                        "0 after %.2f s" % s["drain_after_stop_s"])
        panels.append(p)
        y += 250
    lats = [(k, r.get("p4.%s.latency" % k)) for k in ("fresh", "history")]
    lats = [(k, v) for k, v in lats if isinstance(v, dict) and v.get("cdf")]
    if lats:
        lo = max(0.1, min(v["cdf"][0][0] for _, v in lats))
        hi = max(v["cdf"][-1][0] for _, v in lats)
        lo = 10 ** math.floor(math.log10(lo))
        hi = 10 ** math.ceil(math.log10(max(hi, 30)))
        colors = {"fresh": "#1f77b4", "history": "#ff7f0e"}
        p = Panel(left, y, width - left - 30, 220,
                  "P4 created→applied latency, cumulative distribution",
                  "milliseconds (log scale)", "fraction of events", (lo, hi), (0, 1), logx=True)
        for k, v in lats:
            p.line([(a, b) for a, b in v["cdf"]], colors[k])
        p.vline(5, "#888", "5 ms")
        p.vline(25, "#888", "25 ms")
        p.legend([(colors[k], "%s: p50 %.1f ms, p99 %.1f ms" % (k, v["p50_ms"], v["p99_ms"]))
                  for k, v in lats])
        panels.append(p)
        y += 290
        hmax = max(max(b["count"] / v["joined"] for b in v["histogram"]) for _, v in lats) * 1.1
        p = Panel(left, y, width - left - 30, 180,
                  "P4 latency histogram (10 bins per decade)",
                  "milliseconds (log scale)", "share of events", (lo, hi), (0, hmax), logx=True)
        for k, v in lats:
            pts = []
            for b in v["histogram"]:
                share = b["count"] / v["joined"]
                pts += [(b["lo_ms"], 0), (b["lo_ms"], share), (b["hi_ms"], share), (b["hi_ms"], 0)]
            p.line(pts, colors[k], width=1.2)
        p.legend([(colors[k], k) for k, _ in lats])
        panels.append(p)
        y += 250
    if not panels:
        y = 120
    body = "\n".join(p.svg() for p in panels) or \
        '<text x="20" y="60" font-size="14">no P3/P4 data in this run</text>'
    return ('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
            'font-family="sans-serif">\n<rect width="100%%" height="100%%" fill="#fafafa"/>\n'
            '%s\n</svg>\n' % (width, y, body))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=0)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("pgbench-scripts")
    p.add_argument("--tpl", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--producer", required=True, help="the outbox-producer binary")
    p.set_defaults(fn=cmd_pgbench_scripts)
    p = sub.add_parser("cpu-snap")
    p.add_argument("--pgdata")
    p.add_argument("--pid", action="append")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_cpu_snap)
    p = sub.add_parser("cpu-diff")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--client", action="append")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_cpu_diff)
    p = sub.add_parser("sample", help="samples committed/pending/applied every "
                       "--interval until --done-file appears, then every "
                       "--fast-interval until nothing is pending")
    p.add_argument("--orders", required=True)
    p.add_argument("--billing", required=True)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--fast-interval", type=float, default=0.02)
    p.add_argument("--pending-sql", required=True,
                   help="an SQL expression: the events pending, on either model")
    p.add_argument("--done-file", required=True)
    p.add_argument("--max-seconds", type=float, required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_sample)
    p = sub.add_parser("latency")
    p.add_argument("--outbox", required=True)
    p.add_argument("--inbox", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_latency)
    p = sub.add_parser("goals")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--check", metavar="README")
    p.set_defaults(fn=cmd_goals)
    p = sub.add_parser("report")
    p.add_argument("--work", required=True)
    p.add_argument("--json")
    p.set_defaults(fn=cmd_report)
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
