#!/usr/bin/env bash
# The library from another project: installs this build (cmake --install),
# builds examples/parcels against the installed package with
# find_package(outbox CONFIG) alone, then runs it end to end: parcel-desk
# writes parcels and their events in its own transactions, an outbox-relay
# delivers them for the subscription "tracking" to parcel-tracker, whose
# handler keeps its table. Every event arrives once, each parcel's in order.
# usage: example_test.sh BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir example
build_dir="${1:?usage: example_test.sh BUILD_DIR}"

cmake --install "$build_dir" --prefix "$WORK/prefix" >"$WORK/install.log" ||
  fail "cmake --install: $(tail -5 "$WORK/install.log")"
[ -f "$WORK/prefix/lib/cmake/outbox/outboxConfig.cmake" ] || fail "no CMake package installed"
cmake -S "$OUTBOX_ROOT/examples/parcels" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$WORK/prefix" >"$WORK/configure.log" 2>&1 ||
  fail "configure against the package: $(tail -20 "$WORK/configure.log")"
cmake --build "$WORK/build" -j"${JOBS:-2}" >"$WORK/build.log" 2>&1 ||
  fail "build against the package: $(grep -m5 -E 'error|Error' "$WORK/build.log")"
pass "examples/parcels builds from the installed package"

desk_db=$(new_db parcels)
track_db=$(new_db tracking)
T=$(free_port) R=$(free_port)
parcels=40
"$WORK/build/parcel-desk" --db="$desk_db" --parcels=$parcels >"$WORK/desk.out" 2>&1 ||
  fail "parcel-desk: $(tail -5 "$WORK/desk.out")"
[ "$(psql "$desk_db" -qAtc "SELECT count(*) FROM outbox")" = $((2 * parcels)) ] ||
  fail "parcel-desk did not write its events"
BIN="$WORK/build" start tracker parcel-tracker --listen="127.0.0.1:$T" --db="$track_db"
start relay outbox-relay --listen="127.0.0.1:$R" --db="$desk_db" \
  --subscription=tracking --start_from=oldest --consumer="127.0.0.1:$T" \
  --poll_interval=200ms
wait_serving "$T"
wait_serving "$R"
deadline=$((SECONDS + 60))
until [ "$(psql "$track_db" -qAtc "SELECT count(*) FROM tracking WHERE status = 'delivered'")" = $parcels ]; do
  [ $SECONDS -lt $deadline ] || fail "not every parcel tracked: $(tail -5 "$WORK/tracker.log")"
  sleep 0.3
done
[ "$(psql "$track_db" -qAtc "SELECT count(*) FROM inbox")" = $((2 * parcels)) ] ||
  fail "inbox does not hold every event once"
out_of_order=$(psql "$track_db" -qAtc "SELECT count(*) FROM (SELECT seq, lag(seq) OVER
  (PARTITION BY aggregate_id ORDER BY apply_id) AS before FROM inbox) x WHERE before >= seq")
[ "$out_of_order" = 0 ] || fail "$out_of_order events applied out of chain order"
"$BIN/outboxctl" stats --relay="127.0.0.1:$R" --consumer="127.0.0.1:$T" \
  >"$WORK/stats.out" 2>&1 || true
grep -q "subscription tracking" "$WORK/stats.out" || fail "stats: $(cat "$WORK/stats.out")"
grep -q "pending 0," "$WORK/stats.out" || fail "stats: $(cat "$WORK/stats.out")"
pass "a relay for subscription tracking delivered all $((2 * parcels)) events, each parcel's in order"
