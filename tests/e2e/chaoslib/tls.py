"""Mutual TLS on every link of a scenario: a throwaway CA and certificates
(scripts/lib/certs.sh, openssl) in the scenario's folder, and the flags
that give each process, client and health poll its certificate and the
identities it admits.

Identities (the certificates' URI SAN; each certificate also names
localhost and 127.0.0.1, for server and client use):

  spiffe://outbox/producer   the producers' server certificate
  spiffe://outbox/relay      the relays' admin server, and their client
                             certificate towards the consumer
  spiffe://outbox/consumer   the consumers' server certificate
  spiffe://outbox/outboxctl  the harness: health polls, outboxctl stats
  spiffe://outbox/load       the client load (outboxctl load)

Who admits whom:

  producer  --allowed_clients=load
  relay     --allowed_clients=outboxctl --admin_clients=outboxctl
  consumer  --allowed_clients=relay,outboxctl --delivery_clients=relay

grpc.health.v1 answers any client that completes the handshake (a client
certificate the CA signed), so the harness polls every server's health with
its own identity even where it is not admitted (the producer).

Every server dials and is dialled as 127.0.0.1:PORT (the IP SAN), through
the relay->consumer fault proxy too: the proxy is TCP-level, so the TLS
session passes through it and the relay checks the consumer's certificate
against the host it dials, 127.0.0.1.
"""

import os
import subprocess

# The certificates made for every scenario (kinds and client identities).
NAMES = ("producer", "relay", "consumer", "outboxctl", "load")
HARNESS = "outboxctl"  # the identity of the harness's own calls
LOAD = "load"          # the identity of `outboxctl load`


def spiffe(name):
    return f"spiffe://outbox/{name}"


# kind -> {server flag: the identities it names}
POLICY = {
    "producer": {"allowed_clients": [LOAD]},
    "relay": {"allowed_clients": [HARNESS], "admin_clients": [HARNESS]},
    "consumer": {"allowed_clients": ["relay", HARNESS],
                 "delivery_clients": ["relay"]},
}


class TlsError(Exception):
    pass


class Certs:
    """A CA and one certificate per name of NAMES in `dir`."""

    def __init__(self, root, dir):
        self.root = root
        self.dir = dir

    def make(self):
        lib = os.path.join(self.root, "scripts", "lib", "certs.sh")
        try:
            r = subprocess.run(
                ["bash", "-c", 'source "$1"; shift; make_certs "$@"', "chaos",
                 lib, self.dir] + list(NAMES),
                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise TlsError(f"cannot make certificates in {self.dir}: {e}")
        missing = [f for n in NAMES for f in (self.crt(n), self.key(n))
                   if not os.path.exists(f)]
        if r.returncode != 0 or missing or not os.path.exists(self.ca):
            raise TlsError(f"cannot make certificates in {self.dir} (rc "
                           f"{r.returncode}): {(r.stderr or r.stdout).strip()}"
                           + (f"; missing {', '.join(missing)}" if missing
                              else ""))
        return self

    @property
    def ca(self):
        return os.path.join(self.dir, "ca.crt")

    def crt(self, name):
        return os.path.join(self.dir, f"{name}.crt")

    def key(self, name):
        return os.path.join(self.dir, f"{name}.key")

    # -- flags ----------------------------------------------------------------

    def server_flags(self, kind):
        """A server of `kind` (producer, relay, consumer): mutual TLS on
        --listen with its certificate, and whom it admits."""
        flags = [f"--tls_cert={self.crt(kind)}", f"--tls_key={self.key(kind)}",
                 f"--tls_client_ca={self.ca}"]
        for flag, names in POLICY[kind].items():
            flags.append(f"--{flag}=" + ",".join(spiffe(n) for n in names))
        return flags

    def relay_client_flags(self):
        """The relay dials the consumer with TLS and presents its own
        certificate."""
        return [f"--consumer_ca={self.ca}", f"--client_cert={self.crt('relay')}",
                f"--client_key={self.key('relay')}"]

    def ctl_flags(self, identity=HARNESS):
        """outboxctl (load, stats, ...) as `identity`."""
        return [f"--ca={self.ca}", f"--cert={self.crt(identity)}",
                f"--key={self.key(identity)}"]

    def buf_flags(self, identity=HARNESS):
        """`buf curl` as `identity` (with an https:// URL)."""
        return ["--cacert", self.ca, "--cert", self.crt(identity),
                "--key", self.key(identity)]

    def describe(self):
        parts = []
        for kind, pol in POLICY.items():
            extra = [f"{flag.split('_')[0]}: {', '.join(pol[flag])}"
                     for flag in pol if flag != "allowed_clients"]
            parts.append(f"{kind} admits {', '.join(pol['allowed_clients'])}"
                         + (f" ({'; '.join(extra)})" if extra else ""))
        return (f"mutual TLS on every link, identities spiffe://outbox/NAME "
                f"(CA and certificates in {self.dir}): " + "; ".join(parts)
                + f"; the relays dial the consumer as relay, the harness "
                f"calls as {HARNESS}, the load as {LOAD}")
