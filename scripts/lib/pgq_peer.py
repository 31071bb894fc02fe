#!/usr/bin/env python3
"""The peer of scripts/bench: PgQ 3.5 (Skytools' queue, Debian's
postgresql-15-pgq3 and pgqd) doing the work this project does, on the
same PostgreSQL in the same run.

  pgq_peer.py setup --db URL [--queue Q] [--max-count N] [--max-lag S]
      the pgq extension, queue Q (default "orders") and its consumer
      "bench"; a tick is due after N events (PgQ's default: 500) or S
      seconds (default: 3)
  pgq_peer.py reset --db URL [--target URL]
      the consumer "bench" registered anew, after a tick (it starts from
      there: nothing written before is its), and bench_inbox emptied in
      both databases
  pgq_peer.py fill --db URL --events N --payload-hex FILE [--per-tick N]
      N events like the producer's OrderCreated (its payload, base64 in
      ev_data; ev_extra1 the event id, ev_extra2 the order id) in
      transactions of --per-tick events, a tick after each: the backlog a
      loaded queue holds with PgQ's default ticker settings
  pgq_peer.py consume --db URL [--target URL] --out F
      [--events N | --done-file F] [--poll S] [--max-seconds S]
      PgQ's consumer loop (next_batch, get_batch_events, finish_batch)
      writing each batch into bench_inbox, a copy of the consumer's inbox:
      in the queue's database in the same transaction as finish_batch, or,
      with --target, into that database in a transaction of its own,
      committed before the batch is finished (at least once, as a consumer
      in another database must be). Until N events were consumed, or the
      done file exists and no batch is left. Writes events, batches, the
      time from the first batch to the last, and the rate, as JSON.

A batch of PgQ is the events between two ticks, each a snapshot of the
queue's database; consumers keep their position as the last tick they
finished, so one event row serves every consumer of a queue, and old
events go by rotating tables (TRUNCATE), not row by row.
"""

import argparse
import base64
import json
import os
import sys
import time

import psycopg2

CONSUMER = "bench"

# The consumer's inbox as scripts/bench's P2 baseline copies it (LIKE
# inbox INCLUDING ALL), made here when the database has no inbox to copy.
INBOX_SQL = """
CREATE TABLE IF NOT EXISTS bench_inbox (
  event_id     uuid PRIMARY KEY,
  aggregate_id text COLLATE "C" NOT NULL,
  seq          bigint NOT NULL,
  event_type   text NOT NULL,
  apply_id     bigint GENERATED ALWAYS AS IDENTITY,
  occurred_at  timestamptz,
  applied_at   timestamptz NOT NULL DEFAULT now(),
  UNIQUE (aggregate_id, seq)
)"""

# A batch's events into bench_inbox: (event id, aggregate, position,
# type, when it was written).
APPLY_SQL = ("INSERT INTO bench_inbox (event_id, aggregate_id, seq, event_type, "
             "occurred_at) SELECT ev_extra1::uuid, ev_extra2, ev_id, ev_type, "
             "ev_time FROM pgq.get_batch_events(%s) ON CONFLICT DO NOTHING")
APPLY_ROWS_SQL = ("INSERT INTO bench_inbox (event_id, aggregate_id, seq, "
                  "event_type, occurred_at) SELECT * FROM unnest(%s::uuid[], "
                  "%s::text[], %s::bigint[], %s::text[], %s::timestamptz[]) "
                  "ON CONFLICT DO NOTHING")


def connect(url, autocommit=False):
    conn = psycopg2.connect(url)
    conn.autocommit = autocommit
    return conn


def cmd_setup(a):
    conn = connect(a.db, autocommit=True)
    cur = conn.cursor()
    cur.execute("CREATE EXTENSION IF NOT EXISTS pgq")
    cur.execute("SELECT pgq.create_queue(%s)", (a.queue,))
    cur.execute("SELECT pgq.register_consumer(%s, %s)", (a.queue, CONSUMER))
    cur.execute("SELECT pgq.set_queue_config(%s, 'ticker_max_count', %s)",
                (a.queue, str(a.max_count)))
    cur.execute("SELECT pgq.set_queue_config(%s, 'ticker_max_lag', %s)",
                (a.queue, "%g seconds" % a.max_lag))
    cur.execute(INBOX_SQL)
    conn.close()


def cmd_reset(a):
    conn = connect(a.db, autocommit=True)
    cur = conn.cursor()
    cur.execute("SELECT pgq.force_tick(%s)", (a.queue,))
    cur.execute("SELECT pgq.ticker(%s)", (a.queue,))
    cur.execute("SELECT pgq.unregister_consumer(%s, %s)", (a.queue, CONSUMER))
    cur.execute("SELECT pgq.register_consumer(%s, %s)", (a.queue, CONSUMER))
    cur.execute("TRUNCATE bench_inbox")
    conn.close()
    if a.target:
        conn = connect(a.target, autocommit=True)
        conn.cursor().execute(INBOX_SQL + "; TRUNCATE bench_inbox")
        conn.close()


def cmd_fill(a):
    with open(a.payload_hex) as f:
        payload = base64.b64encode(bytes.fromhex(f.read().strip())).decode()
    conn = connect(a.db)
    cur = conn.cursor()
    left = a.events
    while left > 0:
        n = min(a.per_tick, left)
        cur.execute(
            "SELECT count(pgq.insert_event(%s, 'OrderCreated', %s, "
            "gen_random_uuid()::text, gen_random_uuid()::text, NULL, NULL)) "
            "FROM generate_series(1, %s)", (a.queue, payload, n))
        conn.commit()
        cur.execute("SELECT pgq.force_tick(%s)", (a.queue,))
        cur.execute("SELECT pgq.ticker(%s)", (a.queue,))
        conn.commit()
        left -= n
    conn.close()


def cmd_consume(a):
    src = connect(a.db)
    dst = connect(a.target) if a.target else None
    if dst is not None:
        with dst.cursor() as c:
            c.execute(INBOX_SQL)
        dst.commit()
    cur = src.cursor()
    events = batches = 0
    first = last = None
    deadline = time.time() + a.max_seconds
    stop_tick = None  # once the load is done: the tick that ends it
    while True:
        if a.events is not None and events >= a.events:
            break
        if time.time() > deadline:
            sys.exit("consume: gave up after %s s with %d events" % (a.max_seconds, events))
        if stop_tick is None and a.done_file and os.path.exists(a.done_file):
            # The load stopped: a tick now follows its last event, and the
            # batch that ends there (or later) is the last one.
            cur.execute("SELECT pgq.force_tick(%s)", (a.queue,))
            cur.execute("SELECT pgq.ticker(%s)", (a.queue,))
            src.commit()
            cur.execute("SELECT max(tick_id) FROM pgq.tick t JOIN pgq.queue q "
                        "ON q.queue_id = t.tick_queue WHERE q.queue_name = %s",
                        (a.queue,))
            stop_tick = cur.fetchone()[0]
        cur.execute("SELECT batch_id, cur_tick_id FROM pgq.next_batch_info(%s, %s)",
                    (a.queue, CONSUMER))
        batch, tick = cur.fetchone()
        if batch is None:
            src.commit()
            time.sleep(a.poll)
            continue
        if first is None:
            first = time.time()
        if dst is None:
            cur.execute(APPLY_SQL, (batch,))
            n = cur.rowcount
        else:
            cur.execute("SELECT ev_extra1, ev_extra2, ev_id, ev_type, ev_time "
                        "FROM pgq.get_batch_events(%s)", (batch,))
            rows = cur.fetchall()
            with dst.cursor() as c:
                c.execute(APPLY_ROWS_SQL, [list(col) for col in zip(*rows)]
                          if rows else ([], [], [], [], []))
            dst.commit()
            n = len(rows)
        cur.execute("SELECT pgq.finish_batch(%s)", (batch,))
        src.commit()
        last = time.time()
        events += n
        batches += 1
        if stop_tick is not None and tick >= stop_tick:
            break
    span = (last - first) if first is not None else 0.0
    doc = {"events": events, "batches": batches, "seconds": round(span, 3),
           "rate": round(events / span, 1) if span > 0 else None}
    with open(a.out, "w") as f:
        json.dump(doc, f)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup")
    s.add_argument("--db", required=True)
    s.add_argument("--queue", default="orders")
    s.add_argument("--max-count", type=int, default=500)
    s.add_argument("--max-lag", type=float, default=3.0)
    s.set_defaults(fn=cmd_setup)
    s = sub.add_parser("reset")
    s.add_argument("--db", required=True)
    s.add_argument("--target")
    s.add_argument("--queue", default="orders")
    s.set_defaults(fn=cmd_reset)
    s = sub.add_parser("fill")
    s.add_argument("--db", required=True)
    s.add_argument("--queue", default="orders")
    s.add_argument("--events", type=int, required=True)
    s.add_argument("--per-tick", type=int, default=500)
    s.add_argument("--payload-hex", required=True)
    s.set_defaults(fn=cmd_fill)
    s = sub.add_parser("consume")
    s.add_argument("--db", required=True)
    s.add_argument("--target")
    s.add_argument("--queue", default="orders")
    s.add_argument("--events", type=int)
    s.add_argument("--done-file")
    s.add_argument("--poll", type=float, default=0.002)
    s.add_argument("--max-seconds", type=float, default=600)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_consume)
    a = p.parse_args()
    if a.cmd == "consume" and (a.events is None) == (a.done_file is None):
        p.error("consume: give one of --events and --done-file")
    a.fn(a)


if __name__ == "__main__":
    main()
