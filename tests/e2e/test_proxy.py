#!/usr/bin/env python3
"""Self-test of the fault-injecting proxy against a local echo server:
python3 tests/e2e/test_proxy.py (standard library only, 127.0.0.1 only)."""

import os
import socket
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chaoslib.proxy import FaultProxy, ProxyLoop  # noqa: E402


class EchoServer:
    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.conns = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(c)
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    def _echo(self, c):
        c.settimeout(10)
        try:
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


def roundtrip(port, payload, timeout=5.0):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def wait_for(cond, timeout=30.0):
    """Polls `cond` until it holds (True) or `timeout` s pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def try_roundtrip(port):
    try:
        return roundtrip(port, b"ping", timeout=2) == b"ping"
    except OSError:
        return False


class ProxyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.loop = ProxyLoop()
        cls.echo = EchoServer()

    @classmethod
    def tearDownClass(cls):
        cls.echo.close()
        cls.loop.close()

    def setUp(self):
        self.proxy = FaultProxy(self.loop, "test", self.echo.port, seed=1)

    def tearDown(self):
        self.proxy.close()

    def test_pass_forwards_everything_in_order(self):
        payload = bytes(range(256)) * 4096  # 1 MiB
        self.assertEqual(roundtrip(self.proxy.port, payload), payload)

    def test_latency_delays_but_keeps_order(self):
        self.proxy.set_latency(0.1, 0.15)
        payload = b"".join(b"%06d" % i for i in range(20000))
        self.assertEqual(roundtrip(self.proxy.port, payload), payload)
        # Every chunk, both ways, was held back before it was forwarded.
        self.assertGreaterEqual(self.proxy.delayed, 2)

    def test_blackhole_holds_then_releases(self):
        with socket.create_connection(("127.0.0.1", self.proxy.port), 5) as s:
            s.sendall(b"warm")
            self.assertEqual(s.recv(16), b"warm")
            self.proxy.set_blackhole()
            received, forwarded = self.proxy.received, self.proxy.bytes
            s.sendall(b"held")
            # The proxy has the bytes: from then on, whatever it forwards
            # would be counted.
            self.assertTrue(wait_for(
                lambda: self.proxy.received >= received + 4))
            self.assertEqual(self.proxy.bytes, forwarded)
            s.setblocking(False)
            with self.assertRaises(BlockingIOError):
                s.recv(16)
            self.proxy.set_pass()
            s.setblocking(True)
            s.settimeout(5)
            self.assertEqual(s.recv(16), b"held")

    def test_reset_sends_rst_and_flap_refuses(self):
        s = socket.create_connection(("127.0.0.1", self.proxy.port), 5)
        s.sendall(b"x")
        self.assertEqual(s.recv(16), b"x")
        # A flap far longer than the test: a new connection is refused
        # however slow the machine, until the mode is set again.
        self.assertEqual(self.proxy.reset(flap=600), 1)
        s.settimeout(5)
        with self.assertRaises(ConnectionResetError):
            s.recv(16)
            s.recv(16)
        s.close()
        with self.assertRaises((ConnectionResetError, BrokenPipeError)):
            with socket.create_connection(("127.0.0.1", self.proxy.port),
                                          5) as s2:
                s2.settimeout(5)
                s2.sendall(b"y")
                s2.recv(16)
                s2.sendall(b"y")
        self.proxy.set_pass()
        self.assertEqual(roundtrip(self.proxy.port, b"again"), b"again")

    def test_a_short_flap_ends_by_itself(self):
        self.proxy.reset(flap=0.3)
        self.assertTrue(wait_for(lambda: try_roundtrip(self.proxy.port)))


if __name__ == "__main__":
    unittest.main()
