#!/usr/bin/env bash
# Offline checks of deploy/monitoring: the PrometheusRule validates against
# the prometheus-operator CRD schema, every alert has its severity,
# annotations and runbook section, the dashboard is well formed and shows
# what it must (monitoring.mjs static); then `promtool check rules` on the
# rule groups (the PrometheusRule's spec, extracted: one source) and
# `promtool test rules` on rules_test.yaml, which makes each alert fire and
# not fire. No process is started.
#
# Usage: tests/monitoring/rules_test.sh   (exit 0 or 1)
# Needs: node, `npm ci` run in tests/deploy, promtool (Debian package
# prometheus).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
fail() { echo "FAIL: $*" >&2; exit 1; }

command -v promtool >/dev/null || fail "promtool not found (Debian package prometheus; scripts/lib/common.sh installs it)"
command -v node >/dev/null || fail "node not found"
[[ -d "$root/tests/deploy/node_modules/@kubernetes-models/prometheus-operator" ]] ||
  fail "node_modules incomplete: run 'npm ci' in $root/tests/deploy"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

node "$here/monitoring.mjs" static "--root=$root" "--out=$tmp"

# promtool resolves rule_files relative to the test file: both side by side.
cp "$here/rules_test.yaml" "$tmp/rules_test.yaml"
echo "== promtool check rules"
promtool check rules "$tmp/rules.yaml"
echo "== promtool test rules"
(cd "$tmp" && promtool test rules rules_test.yaml)
echo "ok: rules checked and unit-tested"
