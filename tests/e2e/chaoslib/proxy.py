"""A fault-injecting TCP proxy, for the links relay -> consumer and
service -> PostgreSQL.

Modes, switched at any time from any thread:

- pass: bytes flow unchanged.
- latency(lo, hi): every chunk is delayed by a uniform random lo..hi
  seconds; the order of bytes is kept (a chunk never overtakes the one
  before it), as on a slow link.
- blackhole: connections stay open and new ones are accepted, but nothing
  is forwarded in either direction; what was sent waits (as TCP would keep
  retransmitting it) and flows again when the mode changes. A peer that
  gives up in the meantime closes its side, and the close is forwarded.
- reset(flap): every open connection is closed abruptly with a TCP RST
  (SO_LINGER 0) on both sides; for `flap` seconds afterwards new
  connections are reset as soon as they are accepted.

All proxies share one asyncio event loop on a daemon thread (ProxyLoop).
Only 127.0.0.1 is ever listened on or connected to.
"""

import asyncio
import random
import socket
import struct
import threading

HOST = "127.0.0.1"
_LINGER_RST = struct.pack("ii", 1, 0)
_CHUNK = 65536
_QUEUE_CHUNKS = 16  # per direction; then reading stops (TCP backpressure)


def _rst(writer):
    """Closes a stream with a RST instead of a FIN."""
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    except OSError:
        pass
    try:
        writer.transport.abort()
    except Exception:  # already closed
        pass


class ProxyLoop:
    """One event loop thread for every proxy of a run."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run, name="proxy-loop", daemon=True)
        self._thread.start()

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro, timeout=10.0):
        """Runs `coro` on the loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        if self.loop.is_closed():
            return

        async def _cancel_all():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(_cancel_all(), timeout=5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class _Conn:
    def __init__(self, cwriter, uwriter):
        self.cwriter = cwriter
        self.uwriter = uwriter
        self.tasks = []
        self.closed = False

    def reset(self):
        if self.closed:
            return
        self.closed = True
        _rst(self.cwriter)
        _rst(self.uwriter)
        for t in self.tasks:
            t.cancel()

    def close(self):
        if self.closed:
            return
        self.closed = True
        for w in (self.cwriter, self.uwriter):
            try:
                w.close()
            except Exception:
                pass


class FaultProxy:
    """Listens on 127.0.0.1:listen_port (0: any free port) and forwards to
    127.0.0.1:upstream_port."""

    def __init__(self, ploop, name, upstream_port, listen_port=0, seed=0):
        self.ploop = ploop
        self.name = name
        self.upstream_port = upstream_port
        self.mode = "pass"
        self._latency = (0.0, 0.0)
        self._rng = random.Random(seed)  # latency draws only
        self._refuse_until = 0.0
        self._conns = set()
        self.accepted = 0
        self.resets = 0  # connections reset
        self.bytes = 0  # forwarded
        self.received = 0  # read from either side (forwarded or not yet)
        self.delayed = 0  # chunks held back by latency before forwarding
        self._server = None
        self._flowing = None
        self.port = ploop.call(self._start(listen_port))

    async def _start(self, listen_port):
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(
            self._handle, HOST, listen_port, reuse_address=True)
        return self._server.sockets[0].getsockname()[1]

    # -- control, from any thread ------------------------------------------

    def set_pass(self):
        self.ploop.call(self._set("pass"))

    def set_latency(self, lo, hi):
        self._latency = (lo, hi)
        self.ploop.call(self._set("latency"))

    def set_blackhole(self):
        self.ploop.call(self._set("blackhole"))

    def reset(self, flap=0.0):
        """Resets every open connection; returns how many."""
        return self.ploop.call(self._reset(flap))

    def connections(self):
        return len(self._conns)

    def close(self):
        try:
            self.ploop.call(self._close(), timeout=5)
        except Exception:
            pass

    # -- on the loop -------------------------------------------------------

    async def _set(self, mode):
        self.mode = mode
        if mode == "blackhole":
            self._flowing.clear()
        else:
            self._flowing.set()
        self._refuse_until = 0.0

    async def _reset(self, flap):
        self.mode = "pass"
        self._flowing.set()
        loop = asyncio.get_running_loop()
        self._refuse_until = loop.time() + flap
        conns = list(self._conns)
        for c in conns:
            c.reset()
        self._conns.clear()
        self.resets += len(conns)
        return len(conns)

    async def _close(self):
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.reset()
        self._conns.clear()
        self._flowing.set()

    def _delay(self):
        if self.mode != "latency":
            return 0.0
        lo, hi = self._latency
        return self._rng.uniform(lo, hi)

    async def _handle(self, creader, cwriter):
        loop = asyncio.get_running_loop()
        self.accepted += 1
        if loop.time() < self._refuse_until:
            self.resets += 1
            _rst(cwriter)
            return
        try:
            ureader, uwriter = await asyncio.wait_for(
                asyncio.open_connection(HOST, self.upstream_port), 5)
        except (OSError, asyncio.TimeoutError):
            _rst(cwriter)  # upstream down: the client sees a reset
            return
        for w in (cwriter, uwriter):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(cwriter, uwriter)
        self._conns.add(conn)
        up = asyncio.ensure_future(self._direction(conn, creader, uwriter))
        down = asyncio.ensure_future(self._direction(conn, ureader, cwriter))
        conn.tasks = [up, down]
        try:
            await asyncio.gather(up, down, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            conn.close()

    async def _direction(self, conn, reader, writer):
        """Copies reader -> writer through a queue, so that latency delays
        chunks without limiting throughput, and blackhole holds them."""
        loop = asyncio.get_running_loop()
        q = asyncio.Queue(maxsize=_QUEUE_CHUNKS)
        failed = False

        async def read():
            nonlocal failed
            try:
                while True:
                    data = await reader.read(_CHUNK)
                    if not data:
                        break
                    self.received += len(data)
                    await q.put((loop.time() + self._delay(), data))
            except (ConnectionError, OSError):
                failed = True
            await q.put(None)  # (not on cancellation: nobody reads then)

        rtask = asyncio.ensure_future(read())
        try:
            while True:
                item = await q.get()
                if item is None:
                    break
                at, data = item
                wait = at - loop.time()
                if wait > 0:
                    self.delayed += 1
                    await asyncio.sleep(wait)
                await self._flowing.wait()
                if conn.closed:
                    return
                writer.write(data)
                self.bytes += len(data)
                await writer.drain()
            await self._flowing.wait()
            if failed:
                conn.reset()  # the peer reset: pass the reset on
            elif not conn.closed and writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            conn.reset()
        finally:
            rtask.cancel()
