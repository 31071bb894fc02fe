"""The real binaries as separate processes, and a supervisor that restarts
whatever dies after a short delay, as Kubernetes restarts a container.

Every process ever started is remembered in LIVE, and `kill_everything`
(registered with atexit and called from the signal handlers) stops each one
by its pid, so nothing outlives the harness.
"""

import os
import random
import re
import signal
import subprocess
import threading
import time

LIVE = {}  # pid -> Popen, every child process still running
_LIVE_LOCK = threading.Lock()

FAULT_RE = re.compile(r"OUTBOX_FAULT: crashing at (\S+)")
READY_RE = re.compile(r"serving gRPC on ")


def track(p):
    with _LIVE_LOCK:
        LIVE[p.pid] = p


def untrack(p):
    with _LIVE_LOCK:
        LIVE.pop(p.pid, None)


def reap(p, timeout):
    """Waits up to `timeout` for p; True once it exited (and is untracked)."""
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    untrack(p)
    return True


def kill_everything():
    """SIGCONT then SIGKILL every child still running, by pid."""
    with _LIVE_LOCK:
        procs = list(LIVE.values())
    for p in procs:
        if p.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except Exception:
            pass
        untrack(p)


def clean_env(extra):
    """The harness's environment without any OUTBOX_* setting (so a shell's
    OUTBOX_FAULT or OUTBOX_DB cannot leak in), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(extra)
    return env


def signame(code):
    if code is None:
        return "running"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


class Proc:
    """One service (a name, its command line and its fixed ports) across
    all its incarnations."""

    def __init__(self, run, name, kind, argv, listen_port, metrics_port=None,
                 env=None):
        self.run = run
        self.name = name
        self.kind = kind
        self.argv = argv
        self.env = dict(env or {})
        self.listen_port = listen_port
        self.metrics_port = metrics_port
        self.log_path = os.path.join(run.workdir, f"{name}.log")
        self.popen = None
        self.incarnation = 0
        self.started_at = 0.0
        self.log_offset = 0
        self.paused = False
        self.expect_exit = False  # we signalled it: no "crashed" line
        self.hold_until = 0.0     # not restarted before this (monotonic)
        self.restart_at = None
        self.fast_failures = 0
        self.spawn_failures = 0
        self.exits = []           # (t, how, crash point or None)
        self.crash_points = {}    # point -> count
        self.unexpected = []      # exits that were neither ours nor a point

    @property
    def pid(self):
        """The pid of the running incarnation, or None."""
        p = self.popen
        return p.pid if p is not None and p.poll() is None else None

    def alive(self):
        return self.pid is not None

    def spawn_env(self):
        """The environment of the next incarnation. With crash points armed,
        OUTBOX_FAULT_SEED makes their draws repeatable: it is derived from
        the run's seed, the process and its incarnation."""
        env = dict(self.env)
        if "OUTBOX_FAULT" in env:
            key = f"{self.run.seed}/{self.run.name}/{self.name}/{self.incarnation}"
            env["OUTBOX_FAULT_SEED"] = str(random.Random(key).getrandbits(63))
        return env

    def spawn(self):
        self.incarnation += 1
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            log.write(
                f"==== chaos: {self.name} incarnation {self.incarnation} at "
                f"t={self.run.t():.1f}s ====\n".encode())
            self.log_offset = log.tell()
            try:
                self.popen = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, env=clean_env(self.spawn_env()),
                    start_new_session=True)
            except OSError as e:
                log.write(f"==== chaos: cannot start: {e} ====\n".encode())
                self.incarnation -= 1
                raise
        track(self.popen)
        self.started_at = time.monotonic()
        self.paused = False
        self.expect_exit = False
        self.restart_at = None
        return self.popen.pid

    def log_since_start(self):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def signal(self, sig):
        pid = self.pid
        if pid is None:
            return None
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return None
        return pid


class Supervisor:
    """Restarts every process that exits, `delay` seconds later (doubling
    while it keeps dying within a second of starting, capped at 4 s), unless
    it is held down or the run is stopping."""

    def __init__(self, run, delay=0.5, max_restarts=2000):
        self.run = run
        self.delay = delay
        self.max_restarts = max_restarts
        self.procs = []
        self.lock = threading.RLock()
        self.stopping = False
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="supervisor",
                                        daemon=True)

    def add(self, proc):
        with self.lock:
            self.procs.append(proc)

    def start(self):
        with self.lock:
            for p in self.procs:
                if p.popen is None:
                    p.spawn()
        self._thread.start()

    # -- faults -------------------------------------------------------------

    def kill(self, proc, sig=signal.SIGKILL, down=0.0):
        """Sends `sig` (SIGKILL or SIGTERM); the process is restarted by the
        supervisor no sooner than `down` seconds from now. Returns the pid."""
        with self.lock:
            if proc.paused and sig != signal.SIGKILL:
                proc.signal(signal.SIGCONT)
                proc.paused = False
            proc.expect_exit = True
            proc.hold_until = time.monotonic() + down
            pid = proc.signal(sig)
            if sig == signal.SIGKILL:
                proc.paused = False
            return pid

    def pause(self, proc):
        with self.lock:
            pid = proc.signal(signal.SIGSTOP)
            if pid is not None:
                proc.paused = True
            return pid

    def resume(self, proc):
        with self.lock:
            pid = proc.signal(signal.SIGCONT)
            proc.paused = False
            return pid

    def heal(self):
        """SIGCONT what is paused; what is down restarts now."""
        with self.lock:
            for p in self.procs:
                if p.paused:
                    self.resume(p)
                p.hold_until = 0.0
                if p.restart_at is not None:
                    p.restart_at = min(p.restart_at, time.monotonic())

    # -- the loop -----------------------------------------------------------

    def _loop(self):
        while not self._stop.wait(0.05):
            with self.lock:
                if self.stopping:
                    continue
                for p in self.procs:
                    try:
                        self._check(p)
                    except Exception as e:  # never let supervision die
                        self.run.log(f"supervisor: {p.name}: "
                                     f"{type(e).__name__}: {e}")
                        p.restart_at = time.monotonic() + 1.0

    def _check(self, p):
        now = time.monotonic()
        if p.popen is not None and p.restart_at is None:
            code = p.popen.poll()
            if code is None:
                return
            untrack(p.popen)
            text = p.log_since_start()
            m = FAULT_RE.findall(text)
            point = m[-1] if m else None
            how = signame(code)
            p.exits.append((self.run.t(), how, point))
            # A crash loop (dying on its own within a second of starting)
            # backs off; a kill of ours does not count as one.
            lived = now - p.started_at
            if p.expect_exit and point is None:
                p.fast_failures = 0
            elif lived < 1.0:
                p.fast_failures += 1
            else:
                p.fast_failures = 0
            delay = min(4.0, self.delay * (2 ** min(p.fast_failures, 3)))
            if point is not None:
                p.crash_points[point] = p.crash_points.get(point, 0) + 1
                self.run.log(f"{p.name} crashed at {point} (pid "
                             f"{p.popen.pid}); restarting in {delay:.1f}s")
            elif not p.expect_exit:
                tail = " | ".join(text.strip().splitlines()[-2:])[-300:]
                p.unexpected.append(f"{p.name} {how} at t={self.run.t():.1f}s: "
                                    f"{tail}")
                self.run.log(f"{p.name} exited unexpectedly ({how}, pid "
                             f"{p.popen.pid}): {tail}")
            p.restart_at = max(now + delay, p.hold_until)
            return
        if p.restart_at is not None and now >= max(p.restart_at, p.hold_until):
            if self.restarts >= self.max_restarts:
                if not p.unexpected or "restart limit" not in p.unexpected[-1]:
                    p.unexpected.append(f"{p.name}: restart limit "
                                        f"({self.max_restarts}) reached; "
                                        "left down")
                    self.run.log(p.unexpected[-1])
                return
            self.restarts += 1
            try:
                pid = p.spawn()
            except OSError as e:  # e.g. the binary is being rebuilt
                p.popen = None
                p.restart_at = now + 1.0
                p.spawn_failures += 1
                self.run.log(f"cannot start {p.name}: {e}; retrying in 1s")
                return
            p.spawn_failures = 0
            self.run.log(f"restarted {p.name} (pid {pid}, incarnation "
                         f"{p.incarnation})", quiet=True)

    # -- the end ------------------------------------------------------------

    def stop_all(self, grace):
        """Stops supervising, then SIGTERM (after SIGCONT) every process and
        SIGKILL what is still up after `grace` seconds. Returns the names of
        processes that needed SIGKILL."""
        with self.lock:
            self.stopping = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        live = []
        for p in self.procs:
            if p.popen is not None and p.popen.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    try:
                        os.kill(p.popen.pid, sig)
                    except ProcessLookupError:
                        pass
                live.append(p)
            elif p.popen is not None:
                untrack(p.popen)
        deadline = time.monotonic() + grace
        hung = []
        for p in live:
            if not reap(p.popen, max(0.1, deadline - time.monotonic())):
                hung.append(p.name)
                try:
                    os.kill(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                reap(p.popen, 5)
        return hung
