#!/usr/bin/python3
"""An outbox consumer in Python: the EventSink a relay delivers to.

It keeps the delivery protocol (proto/outbox/v1/sink.proto) with its own
inbox in PostgreSQL, each batch in one transaction with its side effect:

  * an event whose event_id the inbox holds is a DUPLICATE: nothing is done;
  * an event is applied only when its prev_seq is its chain's cursor (a
    chain is source, aggregate_type, aggregate_id); then the events held
    behind it apply too, in chain order;
  * an event whose predecessor has not arrived is HELD, durably, until the
    gap closes; a second event for a held link or seq is a fork: REJECTED;
  * a different event at a position already passed is DIVERGED (REJECTED
    for a relay that does not announce "outbox-protocol: 2");
  * a malformed event is REJECTED with the reason;
  * a database that fails answers nothing: the stream ends UNAVAILABLE and
    the relay resends later.

The side effect here is a row in `effects`; put yours in apply_effect().

Stubs: generate them from proto/ first (see README.md beside this file).
Debian 12: apt-get install python3-grpcio python3-protobuf python3-psycopg2
"""

import argparse
import concurrent.futures
import os
import re
import signal
import threading

import grpc
import psycopg2
import psycopg2.pool

import health_pb2
import health_pb2_grpc
from outbox.v1 import event_pb2, sink_pb2, sink_pb2_grpc

SCHEMA = """
CREATE TABLE IF NOT EXISTS inbox (
  apply_id bigint GENERATED ALWAYS AS IDENTITY,  -- in the order applied
  event_id uuid PRIMARY KEY,
  source text NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
  seq bigint NOT NULL,
  applied_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS cursors (
  source text, aggregate_type text, aggregate_id text,
  last_seq bigint NOT NULL,
  PRIMARY KEY (source, aggregate_type, aggregate_id));
CREATE TABLE IF NOT EXISTS held (
  event_id uuid PRIMARY KEY,
  source text NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
  seq bigint NOT NULL, prev_seq bigint NOT NULL,
  event bytea NOT NULL,
  UNIQUE (source, aggregate_type, aggregate_id, prev_seq),
  UNIQUE (source, aggregate_type, aggregate_id, seq));
CREATE TABLE IF NOT EXISTS effects (
  event_id uuid PRIMARY KEY,
  aggregate_id text NOT NULL, seq bigint NOT NULL, event_type text NOT NULL,
  payload_type text NOT NULL, payload bytea NOT NULL);
"""

UUID = re.compile(r"^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
SOURCE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

# For the conformance test's proof that it can fail, never for use:
# "dedup" forgets duplicates, "order" applies events whatever their prev_seq.
SABOTAGE = os.environ.get("OUTBOX_EXAMPLE_SABOTAGE", "")


def invalid(e):
    """Why the envelope of event e can never be applied, or None."""
    if not UUID.match(e.event_id):
        return "event_id: must be a UUID"
    if not 1 <= len(e.aggregate_type.encode()) <= 64:
        return "aggregate_type: must be 1-64 bytes"
    if not 1 <= len(e.aggregate_id.encode()) <= 128:
        return "aggregate_id: must be 1-128 bytes"
    if e.source and not SOURCE.match(e.source):
        return "source: must be 1-64 letters, digits, '.', '_' or '-'"
    if e.seq <= 0:
        return f"seq: must be positive, got {e.seq}"
    if not 0 <= e.prev_seq < e.seq:
        return f"prev_seq: must be in [0, seq), got {e.prev_seq} with seq {e.seq}"
    if not 1 <= len(e.event_type.encode()) <= 128:
        return "event_type: must be 1-128 bytes"
    if "\0" in e.aggregate_type + e.aggregate_id + e.event_type:
        return "a text field holds a NUL character"
    return None


def apply_effect(cur, e):
    """The consumer's side effect; it commits with the inbox row or not at all."""
    cur.execute(
        "INSERT INTO effects VALUES (%s, %s, %s, %s, %s, %s)",
        (e.event_id, e.aggregate_id, e.seq, e.event_type, e.payload.type_url,
         e.payload.value))


class Batch:
    """One batch's decisions, made in the transaction of cursor `cur`."""

    def __init__(self, cur, max_held):
        self.cur = cur
        self.max_held = max_held
        self.cursor = {}  # chain -> seq of its last applied event
        self.results = []
        self.held_here = {}  # event_id -> index of its HELD answer
        self.applied_here = set()  # event ids applied in this batch

    def lock(self, chain):
        """Locks the chain's cursor row until commit (replicas and streams
        take turns per chain) and reads it."""
        self.cur.execute(
            "INSERT INTO cursors VALUES (%s, %s, %s, 0) ON CONFLICT DO NOTHING",
            chain)
        self.cur.execute(
            "SELECT last_seq FROM cursors WHERE (source, aggregate_type, "
            "aggregate_id) = (%s, %s, %s) FOR UPDATE", chain)
        self.cursor[chain] = self.cur.fetchone()[0]

    def one(self, sql, args):
        self.cur.execute(sql, args)
        return self.cur.fetchone()

    def record(self, chain, e):
        """Event e's inbox row and effect, and its chain's new cursor."""
        self.cur.execute(
            "INSERT INTO inbox (event_id, source, aggregate_type, aggregate_id, "
            "seq) VALUES (%s, %s, %s, %s, %s)", (e.event_id, *chain, e.seq))
        apply_effect(self.cur, e)
        self.applied_here.add(e.event_id)
        self.cursor[chain] = e.seq

    def apply(self, chain, e):
        """Applies e, then the events held behind it, in chain order."""
        while e is not None:
            self.record(chain, e)
            row = self.one(
                "DELETE FROM held WHERE (source, aggregate_type, aggregate_id, "
                "prev_seq) = (%s, %s, %s, %s) RETURNING event", (*chain, e.seq))
            e = event_pb2.Event.FromString(bytes(row[0])) if row else None
            if e is not None and e.event_id in self.held_here:
                # Answered HELD earlier in this batch: applied now.
                self.results[self.held_here.pop(e.event_id)].outcome = sink_pb2.APPLIED

    def decide(self, e):
        """The outcome of one valid event and what it does (see the module doc)."""
        chain = (e.source, e.aggregate_type, e.aggregate_id)
        at = self.cursor[chain]
        inbox = self.one("SELECT source, aggregate_type, aggregate_id, seq "
                         "FROM inbox WHERE event_id = %s", (e.event_id,))
        if SABOTAGE == "dedup":
            inbox = None
        if inbox is not None:
            if (tuple(inbox[:3]), inbox[3]) == (chain, e.seq):
                return sink_pb2.DUPLICATE, ""
            return sink_pb2.REJECTED, (
                f"event_id {e.event_id} was applied before at seq {inbox[3]} "
                f"of aggregate {inbox[2]}; seq {e.seq} reuses it")
        if SABOTAGE == "order":
            self.apply(chain, e)
            return sink_pb2.APPLIED, ""
        if e.seq <= at:
            return sink_pb2.DIVERGED, (
                f"position reused: seq {e.seq} is at or below the applied "
                f"position {at}, but event {e.event_id} was never applied here")
        held = self.one("SELECT seq, prev_seq FROM held WHERE event_id = %s",
                        (e.event_id,))
        if held is not None:
            if tuple(held) == (e.seq, e.prev_seq):
                return sink_pb2.HELD, ""  # a copy of a held event
            return sink_pb2.REJECTED, (
                f"fork: event_id {e.event_id} is held already as seq {held[0]}")
        if e.prev_seq < at:
            return sink_pb2.DIVERGED, (
                f"chain broken: prev_seq {e.prev_seq} is behind the applied "
                f"position {at} while seq {e.seq} is ahead of it")
        other = self.one(
            "SELECT event_id, seq, prev_seq FROM held WHERE (source, "
            "aggregate_type, aggregate_id) = (%s, %s, %s) AND (prev_seq = %s "
            "OR seq = %s)", (*chain, e.prev_seq, e.seq))
        if other is not None:
            return sink_pb2.REJECTED, (
                f"fork: held event {other[0]} (seq {other[1]}, prev_seq "
                f"{other[2]}) takes this link or seq already")
        if e.prev_seq == at:
            self.apply(chain, e)
            return sink_pb2.APPLIED, ""
        (count,) = self.one(
            "SELECT count(*) FROM held WHERE (source, aggregate_type, "
            "aggregate_id) = (%s, %s, %s)", chain)
        if count >= self.max_held:
            return sink_pb2.REJECTED, f"the aggregate holds {count} events already"
        self.cur.execute("INSERT INTO held VALUES (%s, %s, %s, %s, %s, %s, %s)",
                         (e.event_id, *chain, e.seq, e.prev_seq,
                          e.SerializeToString()))
        self.held_here[e.event_id] = len(self.results)
        return sink_pb2.HELD, ""

    def run(self, events):
        why = [invalid(e) for e in events]
        for chain in sorted({(e.source, e.aggregate_type, e.aggregate_id)
                             for e, w in zip(events, why) if w is None}):
            self.lock(chain)  # in sorted order: no deadlock between batches
        for e, w in zip(events, why):
            r = sink_pb2.EventResult(event_id=e.event_id, seq=e.seq)
            if w is None:
                r.outcome, r.reason = self.decide(e)
            else:
                r.outcome, r.reason = sink_pb2.REJECTED, w
            self.results.append(r)
        for chain, seq in self.cursor.items():
            self.cur.execute(
                "UPDATE cursors SET last_seq = %s WHERE (source, aggregate_type, "
                "aggregate_id) = (%s, %s, %s) AND last_seq <> %s", (seq, *chain, seq))
        for e, r in zip(events, self.results):
            if r.outcome == sink_pb2.HELD and e.event_id in self.applied_here:
                r.outcome = sink_pb2.APPLIED  # a copy, drained later in the batch
            if r.outcome in (sink_pb2.HELD, sink_pb2.DIVERGED):
                r.applied_seq = self.cursor[(e.source, e.aggregate_type, e.aggregate_id)]
        return self.results


class Sink(sink_pb2_grpc.EventSinkServicer):
    def __init__(self, pool, args):
        self.pool = pool
        self.max_batch = args.max_batch_events
        self.max_held = args.max_held_per_aggregate
        self.delivery_clients = set(filter(None, args.delivery_clients.split(",")))
        self.tls = bool(args.tls_cert)

    def refusal(self, context):
        """Why the caller may not deliver (status code, message), or None.
        Only the relay may: anyone else could forge effects."""
        if not self.tls:
            return None  # plaintext: loopback development only
        auth = context.auth_context()  # no peer_* without --tls_client_ca
        ids = [i.decode() for i in auth.get("peer_uri") or auth.get("peer_dns") or []]
        if not ids:
            return grpc.StatusCode.UNAUTHENTICATED, "Deliver needs a client certificate"
        if self.delivery_clients and not self.delivery_clients.intersection(ids):
            return grpc.StatusCode.PERMISSION_DENIED, f"{ids[0]} may not deliver"
        return None

    def apply(self, events):
        conn = self.pool.getconn()
        try:
            with conn, conn.cursor() as cur:  # one transaction: commit or roll back
                return Batch(cur, self.max_held).run(events)
        except psycopg2.Error:
            self.pool.putconn(conn, close=True)  # may be broken; a fresh one next time
            conn = None
            raise
        finally:
            if conn is not None:
                self.pool.putconn(conn)

    def Deliver(self, request_iterator, context):
        refused = self.refusal(context)
        if refused:
            context.abort(*refused)
        protocol = dict(context.invocation_metadata()).get("outbox-protocol", "1")
        for req in request_iterator:
            if len(req.events) > self.max_batch:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"events: a batch holds at most {self.max_batch} "
                              f"events, got {len(req.events)}")
            try:
                results = self.apply(req.events)
            except psycopg2.Error as err:
                # The world's fault, not the events': answer nothing.
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"database: {str(err).strip()[:200]}")
            for r in results:
                if r.outcome == sink_pb2.DIVERGED and protocol != "2":
                    r.outcome = sink_pb2.REJECTED
            yield sink_pb2.DeliverResponse(batch_id=req.batch_id, results=results)


class Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: an idle relay asks it, and takes a sink that does not
    answer SERVING for outbox.v1.EventSink for down."""

    def __init__(self):
        self.serving = True

    def Check(self, request, context):
        if request.service not in ("", "outbox.v1.EventSink"):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r}")
        Status = health_pb2.HealthCheckResponse
        return Status(status=Status.SERVING if self.serving else Status.NOT_SERVING)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:50060")
    p.add_argument("--db", default=os.environ.get("OUTBOX_DB", "postgresql:///outbox_python"))
    p.add_argument("--max_batch_events", type=int, default=1000)
    p.add_argument("--max_held_per_aggregate", type=int, default=1000)
    p.add_argument("--tls_cert", default="")
    p.add_argument("--tls_key", default="")
    p.add_argument("--tls_client_ca", default="", help="require client certificates it signed")
    p.add_argument("--delivery_clients", default="",
                   help="identities (URI SAN, else DNS SAN) that may deliver; empty: any the CA signed")
    args = p.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        p.error("--tls_cert and --tls_key go together, and --tls_client_ca needs them")
    if args.delivery_clients and not args.tls_client_ca:
        p.error("--delivery_clients: identities come from client certificates; needs --tls_client_ca")

    pool = psycopg2.pool.ThreadedConnectionPool(1, 8, args.db)
    conn = pool.getconn()
    with conn, conn.cursor() as cur:  # replicas starting together take turns
        cur.execute("SELECT pg_advisory_xact_lock(7355608)")
        cur.execute(SCHEMA)
    pool.putconn(conn)

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", 4 << 20)])
    sink_pb2_grpc.add_EventSinkServicer_to_server(Sink(pool, args), server)
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if args.tls_cert:
        def read(path):
            with open(path, "rb") as f:
                return f.read()
        creds = grpc.ssl_server_credentials(
            [(read(args.tls_key), read(args.tls_cert))],
            root_certificates=read(args.tls_client_ca) if args.tls_client_ca else None,
            require_client_auth=bool(args.tls_client_ca))
        server.add_secure_port(args.listen, creds)
    else:
        server.add_insecure_port(args.listen)
    server.start()
    print(f"python consumer: EventSink on {args.listen}", flush=True)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    stop.wait()
    health.serving = False
    server.stop(grace=5).wait()
    pool.closeall()


if __name__ == "__main__":
    main()
