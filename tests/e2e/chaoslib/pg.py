"""The suite's own throwaway PostgreSQL, through scripts/lib/common.sh
(pg_start / pg_stop), and psql for every query (standard library only)."""

import os
import shutil
import subprocess
import tempfile

PG_BIN = os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin")


# The harness's own sessions: they must be able to write while a scenario
# makes the server (or a database) read-only; ALTER DATABASE is a catalog
# write.
HARNESS_OPTIONS = "-c default_transaction_read_only=off"


class SqlError(Exception):
    pass


class Postgres:
    def __init__(self, root):
        self.root = root  # the repository
        self.dir = None
        self.port = None
        self.url = None  # no database name

    def _common(self, call):
        lib = os.path.join(self.root, "scripts", "lib", "common.sh")
        return subprocess.run(
            ["bash", "-c", f'source "$1"; {call} "$2"', "chaos", lib, self.dir],
            stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=180)

    def start(self):
        # Its own folder straight under /tmp: as root the server runs as the
        # postgres user, which must be able to reach it.
        self.dir = tempfile.mkdtemp(prefix="outbox-chaos-pg.")
        r = self._common("pg_start")
        port_file = os.path.join(self.dir, "port")
        if r.returncode != 0 or not os.path.exists(port_file):
            raise RuntimeError(f"pg_start failed:\n{r.stdout}{r.stderr}")
        with open(port_file) as f:
            self.port = int(f.read().strip())
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}"
        return self

    def stop(self):
        if self.dir is None:
            return
        try:
            self._common("pg_stop")
        except Exception:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def db_url(self, db):
        return f"{self.url}/{db}"

    def psql(self, db, sql, timeout=15, check=True, options=HARNESS_OPTIONS,
             app="chaos-harness", input=None):
        """Runs `sql` (a statement, or a list of them: each its own `-c`,
        for statements that cannot share a transaction, such as ALTER
        SYSTEM) and returns its unaligned, tuples-only output. `options`
        become the session's PGOPTIONS (by default writable even while the
        scenario makes the server read-only). `input` is psql's standard
        input (the data of a `COPY ... FROM STDIN`)."""
        stmts = [sql] if isinstance(sql, str) else list(sql)
        argv = ["psql", self.db_url(db), "-XAtq", "-v", "ON_ERROR_STOP=1"]
        for s in stmts:
            argv += ["-c", s]
        try:
            r = subprocess.run(
                argv, input=input,
                stdin=subprocess.DEVNULL if input is None else None,
                capture_output=True, text=True, timeout=timeout,
                env=dict(os.environ, PGCONNECT_TIMEOUT="3", PGOPTIONS=options,
                         PGAPPNAME=app))
        except subprocess.TimeoutExpired as e:
            raise SqlError(f"psql timed out after {timeout}s: "
                           f"{'; '.join(stmts)[:80]}") from e
        if check and r.returncode != 0:
            raise SqlError(r.stderr.strip() or f"psql exited {r.returncode}")
        return r.stdout

    def copy(self, src_db, select, dst_db, table, timeout=120):
        """Copies the rows of `select` in `src_db` into `table` of `dst_db`
        (COPY out, COPY in); returns the number of rows."""
        data = self.psql(src_db, f"COPY ({select}) TO STDOUT", timeout=timeout)
        self.psql(dst_db, f"COPY {table} FROM STDIN", timeout=timeout,
                  input=data)
        return data.count("\n")

    def create_db(self, name):
        self.psql("postgres", f"CREATE DATABASE {name}")

    def drop_db(self, name):
        self.psql("postgres", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)",
                  timeout=60, check=False)

    def restart_immediate(self):
        """pg_ctl restart -m immediate: a crash of the server, then crash
        recovery. Returns (ok, output)."""
        cmd = [os.path.join(PG_BIN, "pg_ctl"), "-D",
               os.path.join(self.dir, "data"), "-l",
               os.path.join(self.dir, "postgres.log"), "-m", "immediate",
               "-w", "-t", "60", "restart"]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--"] + cmd
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=90)
        return r.returncode == 0, (r.stdout + r.stderr).strip()
