"""Samples the run: each consumer's Prometheus counters every ~0.25 s (per
incarnation, since a restarted process starts from zero; the harness also
scrapes a consumer right before it kills it) and the number of events held
at the consumer every ~0.5 s."""

import re
import threading
import urllib.request

OUTCOME_RE = re.compile(
    r'^outbox_consumer_events_total\{outcome="(\w+)"\}\s+([0-9.eE+]+)\s*$',
    re.M)
OUTCOMES = ("applied", "duplicate", "held", "rejected")


def parse_outcomes(text):
    out = {k: 0 for k in OUTCOMES}
    for name, value in OUTCOME_RE.findall(text):
        out[name] = int(float(value))
    return out


def scrape(port, timeout=0.4):
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode(errors="replace")


class Sampler:
    def __init__(self, run, consumers, pg, billing_db, interval=0.25,
                 held_every=2):
        self.run = run
        self.consumers = consumers
        self.pg = pg
        self.billing_db = billing_db
        self.interval = interval  # counters; held_events every held_every
        self.held_every = held_every
        self.lock = threading.Lock()
        self.last = {}  # (name, pid) -> counters of that incarnation
        self.held_peak = 0
        self.held_samples = 0
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler",
                                        daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)

    def scrape_consumer(self, c):
        pid = c.pid
        if pid is None or c.paused or c.metrics_port is None:
            return
        try:
            counters = parse_outcomes(scrape(c.metrics_port))
        except Exception:
            return
        with self.lock:
            if c.pid == pid:  # still the incarnation we asked
                self.last[(c.name, pid)] = counters
                self.scrapes += 1

    def _loop(self):
        n = 0
        while not self._stop.wait(self.interval):
            n += 1
            for c in self.consumers:
                self.scrape_consumer(c)
            if n % self.held_every == 0:
                self.sample_held()

    def sample_once(self):
        for c in self.consumers:
            self.scrape_consumer(c)
        self.sample_held()

    def sample_held(self):
        try:
            held = int(self.pg.psql(self.billing_db,
                                    "SELECT count(*) FROM held_events",
                                    timeout=2).strip() or 0)
        except Exception:
            return
        self.held_samples += 1
        self.held_peak = max(self.held_peak, held)

    def totals(self):
        """Each outcome summed over the last value seen of every
        incarnation of every consumer."""
        out = {k: 0 for k in OUTCOMES}
        with self.lock:
            values = list(self.last.values())
        for counters in values:
            for k in OUTCOMES:
                out[k] += counters[k]
        out["deliveries"] = sum(out[k] for k in OUTCOMES)
        out["incarnations"] = len(self.last)
        return out
