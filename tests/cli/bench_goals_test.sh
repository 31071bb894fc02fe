#!/usr/bin/env bash
# The bench's goals live in scripts/lib/bench_goals.json alone: README.md
# shows exactly them, and the report judges figures by them (a ratio
# below a goal is NO, above it yes; a figure no phase measures says so).
# No database: the report reads a results file written here.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
root="$(cd "$(dirname "$0")/../.." && pwd)"
bench_py="$root/scripts/lib/bench.py"

out=$(python3 "$bench_py" goals --check "$root/README.md" 2>&1) ||
  fail "README.md's table of the bench's goals is not bench_goals.json's: $out"
pass "README.md shows the goals of scripts/lib/bench_goals.json"

# A README whose table differs (a goal changed by hand) is caught.
work=$(mktemp -d /tmp/outbox-bench-goals.XXXXXX)
trap 'rm -rf "$work"' EXIT
sed 's/| ≥ 1.5× |/| ≥ 1.2× |/' "$root/README.md" >"$work/README.md"
cmp -s "$root/README.md" "$work/README.md" && fail "no ≥ 1.5× goal in README.md to alter"
if python3 "$bench_py" goals --check "$work/README.md" >/dev/null 2>&1; then
  fail "a README with an altered goal passed the check"
fi
pass "a README whose goals differ from bench_goals.json fails the check"

# The report: P2's drain at 0.9x PgQ's same-database consumer misses its
# goal (>= 1), at 2x the other-database one meets it (>= 1.5); the
# outbox's CPU per event 1.5x with 4 subscriptions misses its goal (<= 1.3),
# and P7, not run, is not claimed as met.
printf '%s\t%s\n' ran.p2 1 ran.pgq 1 p2.events 100000 p2.drain_rate 9000 \
  p2.baseline_rows_per_s 100000 pgq.drain_same.rate 10000 pgq.drain_other.rate 4500 \
  ran.fanout 1 fanout.1.cpu_us_per_event 100 fanout.4.cpu_us_per_event 150 \
  >"$work/results.tsv"
report=$(python3 "$bench_py" report --work "$work")
row() { grep -F "$1" <<<"$report" | grep -F "$2" || fail "no report row with '$1' and '$2': $report"; }
row "PgQ, consumer in its database" "0.90" | grep -q " NO" ||
  fail "0.9x of PgQ's same-database drain not judged NO: $report"
row "PgQ, consumer to another database" "2.00" | grep -q " yes" ||
  fail "2x of PgQ's other-database drain not judged yes: $report"
row "pgbench 128-row inserts" "0.09" | grep -q " NO" ||
  fail "0.09x of the insert baseline not judged NO (goal >= 0.15): $report"
row "Fan-out" "1.50" | grep -q " NO" ||
  fail "1.5x the outbox's CPU per event with 4 subscriptions not judged NO: $report"
row "P7" "not run" | grep -qv " yes" || fail "P7, not run, claimed as met: $report"
pass "the report judges figures by bench_goals.json's goals"
