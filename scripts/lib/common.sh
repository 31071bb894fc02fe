# Shared by scripts/setup, scripts/up and scripts/test: package installation,
# the build, and a throwaway PostgreSQL. Source it; it defines functions only.

OUTBOX_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PG_BIN="${PG_BIN:-/usr/lib/postgresql/15/bin}"

# Debian 12 packages: build tools, gRPC/protobuf, libpqxx, abseil, spdlog,
# GoogleTest, the PostgreSQL 15 server, and what the tests use (Node.js for
# `buf curl` and the manifest checks, python3 for the failure-injection
# suite and pgbouncer for its pooler scenarios, prometheus for promtool and
# a loopback Prometheus in the monitoring tests, Python's gRPC, protobuf and
# psycopg2 for examples/python-consumer; kubectl, which renders the
# manifests, is not a Debian package and must be on the machine).
OUTBOX_PACKAGES=(
  build-essential cmake pkg-config git ca-certificates ccache lld
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libpqxx-dev libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev
  prometheus-cpp-dev
  postgresql-15 postgresql-client-15 pgbouncer
  nodejs curl iproute2 procps python3 openssl prometheus
  python3-grpcio python3-protobuf python3-psycopg2
  nats-server libnats-dev
)

# What scripts/test --sanitize needs besides: clang with its sanitizer and
# libFuzzer runtimes.
OUTBOX_SANITIZE_PACKAGES=(clang libclang-rt-14-dev libfuzzer-14-dev)

# shellcheck source=scripts/lib/ports.sh
source "$OUTBOX_ROOT/scripts/lib/ports.sh"

log() { printf '\033[1m==>\033[0m %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# ensure_packages [PACKAGES...]: installs those missing (default: the
# project's); silent when all are present.
ensure_packages() {
  local missing=() p wanted=("${OUTBOX_PACKAGES[@]}")
  [ $# -gt 0 ] && wanted=("$@")
  for p in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" ||
      missing+=("$p")
  done
  # nodejs may come from elsewhere with npm bundled.
  if [ $# -gt 0 ]; then
    :
  elif command -v node >/dev/null && command -v npm >/dev/null; then
    local kept=()
    for p in "${missing[@]}"; do [ "$p" = nodejs ] || kept+=("$p"); done
    missing=("${kept[@]}")
  elif ! dpkg-query -W -f='${Status}' npm 2>/dev/null | grep -q "ok installed"; then
    missing+=(npm)
  fi
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  # Packages with a service (prometheus, postgresql, pgbouncer) must not
  # start it: the tests start what they need, on free loopback ports.
  # policy-rc.d is how Debian says so; one already there is left alone.
  local policy=/usr/sbin/policy-rc.d added=false rc=0
  if [ ! -e "$policy" ]; then
    as_root sh -c "printf '#!/bin/sh\nexit 101\n' >$policy && chmod 755 $policy"
    added=true
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
  if $added; then as_root rm -f "$policy"; fi
  return $rc
}

# Test-only Node.js tools (buf curl, kubernetes-models), pinned by
# tests/deploy/package-lock.json, into tests/deploy/node_modules/.
ensure_node_tools() {
  local dir="$OUTBOX_ROOT/tests/deploy"
  local stamp="$dir/node_modules/.outbox-installed"
  if [ ! -f "$stamp" ] || [ "$dir/package-lock.json" -nt "$stamp" ]; then
    log "installing test tools from npm into tests/deploy (buf, kubernetes-models)"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null) ||
      die "npm ci failed in tests/deploy"
    touch "$stamp"
  fi
}

# Configures and builds into build/ (Release unless BUILD_TYPE says):
# every target, or OUTBOX_BUILD_TARGET (e.g. binaries: no test binary).
# The Release build's compiler cache (ccache, in .local/): the image's
# builder stage compiles the same sources with the same compiler and flags,
# and reads it (scripts/lib/image.sh mounts it read-only), so that a CI run
# compiles the project once, not twice. Paths are taken relative to the
# checkout (CCACHE_BASEDIR), which is /src in the image.
OUTBOX_CCACHE_DIR="${OUTBOX_CCACHE_DIR:-$OUTBOX_ROOT/.local/ccache}"
# ccache also hashes the locale (it changes the compiler's messages): the
# image's builder has LANG=C.UTF-8 and no LC_ variable, and so does the
# build here. tests/deploy/check_image_libs.sh fails when the settings here
# and the Dockerfile's ENV differ.
export_ccache_env() {
  export CCACHE_DIR="$OUTBOX_CCACHE_DIR" CCACHE_BASEDIR="$OUTBOX_ROOT" \
    CCACHE_COMPILERCHECK=content CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE=2G \
    LANG=C.UTF-8
  unset LC_ALL LC_CTYPE LC_MESSAGES
}

build() {
  local target="${OUTBOX_BUILD_TARGET:-all}"
  if command -v ccache >/dev/null; then
    # In a subshell: the locale and ccache's settings are the build's only.
    (
      export_ccache_env
      mkdir -p "$CCACHE_DIR"
      build_in build "${BUILD_TYPE:-Release}" "$target" \
        -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache
    ) || exit
  else
    build_in build "${BUILD_TYPE:-Release}" "$target"
  fi
  for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
    [ -x "$OUTBOX_ROOT/build/bin/$b" ] || die "build/bin/$b is missing"
  done
  [ "$target" != all ] || check_test_binaries build gtest
}

# build_in DIR TYPE TARGET [CMAKE_ARGS...]: configures DIR and builds
# TARGET there.
build_in() {
  local name="$1" type="$2" target="$3"
  local dir="$OUTBOX_ROOT/$name"
  shift 3
  # Configured every time, not only the first: a flag these scripts pass
  # (-O0 for the sanitized build, say) must reach a folder made before it
  # changed. Nothing changed, nothing is rebuilt.
  [ -f "$dir/CMakeCache.txt" ] || log "configuring $name ($type${*:+ $*})"
  cmake -S "$OUTBOX_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE="$type" "$@" >/dev/null
  log "building $name (this takes a few minutes the first time)"
  # The build's own exit status decides, not the filter's: the output goes
  # to a log first (a pipe's status would be grep's, or `true`'s), then the
  # lines worth seeing are shown.
  local rc=0 out="$dir/build.log"
  cmake --build "$dir" -j"${JOBS:-2}" --target "$target" >"$out" 2>&1 || rc=$?
  grep -E 'error|warning: unused|Error|FAILED|runtime error' "$out" >&2 || :
  [ "$rc" -eq 0 ] || die "build of $name failed (exit $rc; full log: $out)"
}

# check_test_binaries DIR LABEL: every test ctest would run in DIR with
# LABEL has its executable in DIR/bin (gtests and fuzz targets are named
# after their binaries, a shard NAME/K after NAME), so that a target the
# build did not make fails here, naming it, instead of a ctest line that is
# easy to miss.
check_test_binaries() {
  local dir="$OUTBOX_ROOT/$1" label="$2" names n=0 t
  names=$(ctest --test-dir "$dir" -N -L "$label" | sed -n 's/^ *Test *#[0-9]*: //p' |
    sed 's|/[0-9]*$||' | sort -u)
  [ -n "$names" ] || die "$1: ctest lists no test labelled $label"
  for t in $names; do
    [ -x "$dir/bin/$t" ] || die "$1/bin/$t is missing: the build did not make it"
    n=$((n + 1))
  done
  log "$1: all $n test binaries labelled $label are built"
}

# A port on 127.0.0.1 that nothing listens on now, leased to this script
# until it ends (scripts/lib/ports.sh).
free_port() {
  port_lease "$$" || die "no free port found"
}

# pg_start DIR: a throwaway PostgreSQL 15 in DIR (created if needed; reused
# if it already holds a cluster), on a free port, loopback only, with the
# databases outbox_orders and outbox_billing. Sets PG_PORT and PG_URL (no
# database name). initdb refuses root, so as root it runs as `postgres`.
# PG_OPTIONS: more server options (-c name=value ...), after the defaults.
pg_start() {
  local dir run=()
  mkdir -p "$1"
  dir=$(cd "$1" && pwd)
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql postgres
    chown -R postgres "$dir"
    chmod 700 "$dir"
    run=(runuser -u postgres --)
  fi
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    "${run[@]}" "$PG_BIN/initdb" -D "$dir/data" -U postgres -A trust \
      --no-sync -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 ||
      { cat "$dir/initdb.log" >&2; die "initdb failed"; }
  fi
  local try
  for try in 1 2 3; do
    PG_PORT=$(free_port)
    if "${run[@]}" "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 \
      -o "-p $PG_PORT -c listen_addresses=127.0.0.1 -k $dir \
          -c shared_buffers=64MB -c max_connections=300 -c fsync=on \
          -c max_wal_size=256MB -c log_min_messages=warning ${PG_OPTIONS:-}" \
      start >/dev/null; then
      break
    fi
    [ "$try" = 3 ] && { tail -20 "$dir/postgres.log" >&2; die "PostgreSQL did not start"; }
  done
  echo "$PG_PORT" >"$dir/port"
  PG_URL="postgresql://postgres@127.0.0.1:$PG_PORT"
  local db
  for db in outbox_orders outbox_billing; do
    psql "$PG_URL/postgres" -qAtc "SELECT 1 FROM pg_database WHERE datname = '$db'" |
      grep -q 1 || psql "$PG_URL/postgres" -qc "CREATE DATABASE $db" >/dev/null
  done
}

# pg_stop DIR: stops the server started by pg_start (by its pid file).
pg_stop() {
  local dir run=()
  dir=$(cd "$1" 2>/dev/null && pwd) || return 0
  [ -f "$dir/data/postmaster.pid" ] || return 0
  [ "$(id -u)" -eq 0 ] && run=(runuser -u postgres --)
  "${run[@]}" "$PG_BIN/pg_ctl" -D "$dir/data" -m fast -w -t 30 stop >/dev/null 2>&1 ||
    kill -9 "$(head -1 "$dir/data/postmaster.pid")" 2>/dev/null || true
}

# fuzz_all BINDIR SECONDS: runs every fuzz target in BINDIR for SECONDS each,
# starting from its checked-in corpus (new inputs go to a scratch folder;
# the repository is not changed), two at a time (a fuzzer keeps one core
# busy). A crash fails, naming the input to check in as a regression
# (tests/fuzz/corpus/<target>/).
fuzz_all() {
  local bin="$1" seconds="$2" t work rc=0
  local targets=(order_request_fuzz consumer_plan_fuzz traceparent_fuzz outbox_payload_fuzz)
  work=$(mktemp -d /tmp/outbox-fuzz.XXXXXX)
  for t in "${targets[@]}"; do
    [ -x "$bin/$t" ] || die "$bin/$t is missing"
  done
  local i pids=()
  for ((i = 0; i < ${#targets[@]}; i += 2)); do
    pids=()
    for t in "${targets[@]:i:2}"; do
      mkdir -p "$work/$t"
      log "fuzzing $t for ${seconds}s"
      "$bin/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$work/$t/" "$work/$t" \
        "$OUTBOX_ROOT/tests/fuzz/corpus/$t" >"$work/$t.log" 2>&1 &
      pids+=($!)
    done
    local k=0
    for t in "${targets[@]:i:2}"; do
      if ! wait "${pids[k]}"; then
        tail -40 "$work/$t.log" >&2
        printf 'error: %s found a failing input: %s (check it in under tests/fuzz/corpus/%s/)\n' \
          "$t" "$(ls "$work/$t"/crash-* "$work/$t"/leak-* "$work/$t"/timeout-* 2>/dev/null | head -1)" "$t" >&2
        rc=1
      else
        printf '%s: %s\n' "$t" \
          "$(grep -E '^stat::number_of_executed_units' "$work/$t.log" | tail -1)" >&2
      fi
      k=$((k + 1))
    done
  done
  [ $rc -eq 0 ] && rm -rf "$work"
  return $rc
}

# failure_digest LASTTEST_LOG: for each test that failed in ctest's log
# (Testing/Temporary/LastTest.log), the lines of its output that say why
# (failures, errors, violations; at most 30) and its last 8 lines.
failure_digest() {
  local logf="$1"
  [ -f "$logf" ] || return 0
  printf '\n==> why the failed tests failed (from %s)\n' "$logf" >&2
  awk '
    /^[0-9]+\/[0-9]+ Test: / { name = $3; n = 0; next }
    /^Output:$/ { inout = 1; getline; next }
    /^<end of output>$/ { inout = 0; next }
    inout { out[n++] = $0; next }
    /^Test [A-Z]/ && !/^Test time/ && !/^Test Passed/ { failed = 1 }
    /^"[^"]+" end time:/ {
      if (failed) {
        print "--- " name
        k = 0
        for (i = 0; i < n && k < 30; i++)
          if (out[i] ~ /FAIL|ERROR|[Ee]rror[: ]|[Vv]iolat|Failure|not healed|not listed|not drained|\[  FAILED  \]|Assertion|Sanitizer/ && out[i] !~ /^\[[^]]*\]   \| /) {
            print "  " out[i]; k++
          }
        print "  (last lines)"
        for (i = (n > 8 ? n - 8 : 0); i < n; i++) print "  " out[i]
      }
      failed = 0; n = 0
    }' "$logf" >&2
}
