#!/usr/bin/env python3
"""Self-test of the topology machinery (chaoslib/topology.py) and of the
checks the topology scenarios rely on: python3 tests/e2e/test_topology.py
(standard library only, 127.0.0.1 only). The tests that need PostgreSQL 15
or PgBouncer start their own and are skipped when those are missing."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chaoslib.pg import PG_BIN  # noqa: E402
from chaoslib.proxy import ProxyLoop  # noqa: E402
from chaoslib.runner import PortPool  # noqa: E402
from chaoslib.topology import (  # noqa: E402
    Cluster, MovableProxy, PgBouncer, StandbyPair, replace_from_dump, dump,
    stop_everything)
from chaoslib.topology_scenarios import failover_lines  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HAVE_PG = os.access(os.path.join(PG_BIN, "pg_basebackup"), os.X_OK)
HAVE_BOUNCER = os.access("/usr/sbin/pgbouncer", os.X_OK)


class NameServer:
    """Answers every connection with its name, then echoes."""

    def __init__(self, name):
        self.name = name.encode()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        c.settimeout(10)
        try:
            c.sendall(self.name)
            while True:
                data = c.recv(65536)
                if not data:
                    break
                c.sendall(data)
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self.stop.set()
        self.thread.join(timeout=2)
        self.sock.close()


class FakeProc:
    def __init__(self, path):
        self.log_path = path


class FailoverLinesTest(unittest.TestCase):
    def lines(self, text):
        with tempfile.NamedTemporaryFile("w", suffix=".log",
                                         delete=False) as f:
            f.write(text)
        try:
            return failover_lines(FakeProc(f.name), 1, 2)
        finally:
            os.unlink(f.name)

    def test_an_error_naming_both_timelines_counts(self):
        good, _ = self.lines(
            "2026-12-01T21:06:36.738Z error database failover: timeline 1 "
            "-> timeline 2 (system 7312345678901234567)\n")
        self.assertEqual(len(good), 1)

    def test_json_format(self):
        good, _ = self.lines(
            '{"ts":"2026-12-01T21:06:36.738123Z","level":"error","pid":12,'
            '"msg":"Failover of the orders database: was timeline 1, now '
            'timeline 2"}\n')
        self.assertEqual(len(good), 1)

    def test_a_warning_or_no_timelines_does_not(self):
        good, seen = self.lines(
            "2026-12-01T21:06:36.738Z warning failover: timeline 1 -> 2\n"
            "2026-12-01T21:06:36.738Z error failover noticed\n"
            "2026-12-01T21:06:36.738Z error failover: timeline 2 only\n")
        self.assertEqual(good, [])
        self.assertEqual(len(seen), 3)

    def test_a_timestamp_is_no_timeline(self):
        # 21:01:02 and 2026-12-01 hold 1 and 2 only inside other tokens
        good, _ = self.lines(
            "2026-12-01T21:01:02.001Z error failover of timeline 7\n")
        self.assertEqual(good, [])


class MovableProxyTest(unittest.TestCase):
    def setUp(self):
        self.ploop = ProxyLoop()
        self.a, self.b = NameServer("A"), NameServer("B")

    def tearDown(self):
        self.a.close()
        self.b.close()
        self.ploop.close()

    def test_retarget_resets_old_connections_and_sends_new_ones_on(self):
        p = MovableProxy(self.ploop, "t", self.a.port)
        old = socket.create_connection(("127.0.0.1", p.port), timeout=5)
        self.assertEqual(old.recv(1), b"A")
        self.assertEqual(p.retarget(self.b.port), 1)
        with self.assertRaises(OSError):
            old.sendall(b"x")
            if not old.recv(1):
                raise ConnectionResetError("closed")
        old.close()
        with socket.create_connection(("127.0.0.1", p.port), timeout=5) as s:
            self.assertEqual(s.recv(1), b"B")
        p.close()


@unittest.skipUnless(HAVE_PG, "PostgreSQL 15 server binaries missing")
class StandbyPairTest(unittest.TestCase):
    def test_cut_crash_promote_move(self):
        ploop, ports = ProxyLoop(), PortPool()
        pair = StandbyPair(ROOT, ploop, ports, "selftest")
        try:
            pair.start()
            pair.primary.create_db("t")
            pair.primary.psql("t", "CREATE TABLE r (i int PRIMARY KEY)")
            pair.start_standby()
            pair.primary.psql("t", "INSERT INTO r SELECT generate_series(1, "
                              "100)")
            deadline = time.monotonic() + 30
            while pair.standby.psql("t", "SELECT count(*) FROM r").strip() \
                    != "100" and time.monotonic() < deadline:
                time.sleep(0.1)
            pair.cut_replication()
            pair.primary.psql("t", "INSERT INTO r SELECT generate_series("
                              "101, 150)")
            time.sleep(0.5)
            self.assertGreater(pair.lag_bytes(), 0)
            pair.crash_primary()
            self.assertEqual(pair.promote(), (1, 2))
            pair.move_address()
            via = f"postgresql://postgres@127.0.0.1:{pair.address.port}/t"
            out = pair.current.psql("postgres", "SELECT 1")  # direct works
            self.assertEqual(out.strip(), "1")
            got = subprocess.run(
                ["psql", via, "-XAtc", "SELECT count(*) FROM r"],
                capture_output=True, text=True, timeout=30).stdout.strip()
            self.assertEqual(got, "100")  # the standby lacked the last 50
            old = pair.read_old_primary(
                {"n": ("t", "SELECT count(*) FROM r")}, ports)
            self.assertEqual(old["n"].strip(), "150")
        finally:
            pair.stop()
            ploop.close()


@unittest.skipUnless(HAVE_PG and HAVE_BOUNCER, "PostgreSQL or PgBouncer "
                     "missing")
class PgBouncerTest(unittest.TestCase):
    def test_transaction_mode_shares_session_state(self):
        # the premise of the leak sampler: a SET outlives its transaction
        # on a backend the next client gets
        ports = PortPool()
        c = Cluster(ROOT, "selftest-bouncer", ports).initdb().start()
        b = None
        try:
            c.create_db("t")
            b = PgBouncer("selftest-pgbouncer", c.port, ports, "transaction",
                          pool_size=1).start()
            b.psql("t", "SET statement_timeout = 1234")
            self.assertEqual(b.psql("t", "SHOW statement_timeout").strip(),
                             "1234ms")
        finally:
            if b is not None:
                b.remove()
            c.remove()


@unittest.skipUnless(HAVE_PG, "PostgreSQL 15 server binaries missing")
class RestoreTest(unittest.TestCase):
    def test_replace_from_dump_snapshots_what_it_drops(self):
        ports = PortPool()
        c = Cluster(ROOT, "selftest-restore", ports).initdb().start()
        work = tempfile.mkdtemp()
        try:
            c.create_db("t")
            c.psql("t", "CREATE TABLE r (i int)")
            c.psql("t", "INSERT INTO r VALUES (1), (2)")
            path = os.path.join(work, "t.dump")
            dump(c, "t", path)
            c.psql("t", "INSERT INTO r VALUES (3)")
            took, rows = replace_from_dump(c, "t", path,
                                           snapshot=("r", "SELECT i FROM r"))
            self.assertEqual(sorted(rows), ["1", "2", "3"])
            self.assertEqual(c.psql("t", "SELECT count(*) FROM r").strip(),
                             "2")
        finally:
            c.remove()
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        unittest.main(verbosity=2)
    finally:
        stop_everything()
