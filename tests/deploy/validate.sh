#!/usr/bin/env bash
# Offline checks of the Kubernetes manifests and the container build:
# renders every kustomize overlay (and the base) with `kubectl kustomize`,
# then tests/deploy/validate.mjs validates each rendered object against the
# upstream Kubernetes schemas (npm kubernetes-models), the cert-manager CRD
# schemas (npm @kubernetes-models/cert-manager) and the prometheus-operator
# ones (npm @kubernetes-models/prometheus-operator), strictly, and checks
# the deployment policy (probes, resources, security, grace periods,
# metrics and their PodMonitor, spread, budgets, mutual TLS and its
# certificates, flags, network policies, the subscriptions' relays and
# consumers, JetStream mode in overlays/prod-jetstream, Dockerfile). No
# cluster is needed.
#
# Usage: tests/deploy/validate.sh [BIN_DIR]   (from any directory; exit 0 or 1)
#   BIN_DIR  the built binaries (default: $OUTBOX_DEPLOY_BIN, else build/bin
#            of the repository). Each one's --helpfull decides which flags
#            and OUTBOX_* variables exist, and the form of their values; a
#            missing binary is an error.
# Needs: kubectl (for its built-in kustomize), node, and `npm ci` run in
# tests/deploy (kubernetes-models, @kubernetes-models/cert-manager,
# @kubernetes-models/prometheus-operator, yaml).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
k8s="$root/deploy/k8s"

fail() { echo "validate: $*" >&2; exit 1; }

# The flags come from the binaries themselves: no binaries, no check.
bin_dir=${1:-${OUTBOX_DEPLOY_BIN:-$root/build/bin}}
[[ -d "$bin_dir" ]] ||
  fail "BIN_DIR $bin_dir is not a directory: build the binaries or pass their directory (each one's --helpfull lists its flags)"
bin_dir=$(cd "$bin_dir" && pwd)
# outboxctl too: the CronJob outbox-reconcile runs it.
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  [[ -x "$bin_dir/$b" ]] ||
    fail "$bin_dir/$b is missing: build it or pass the directory of the built binaries (its --helpfull lists its flags)"
done

command -v kubectl >/dev/null || fail "kubectl not found (its built-in kustomize renders the overlays)"
command -v node >/dev/null || fail "node not found"
[[ -d "$here/node_modules/kubernetes-models" && -d "$here/node_modules/yaml" &&
  -d "$here/node_modules/@kubernetes-models/cert-manager" &&
  -d "$here/node_modules/@kubernetes-models/prometheus-operator" ]] ||
  fail "node_modules incomplete: run 'npm ci' in $here"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The base must render on its own as well.
kubectl kustomize "$k8s/base" >"$tmp/base.yaml" 2>"$tmp/err" ||
  fail "kubectl kustomize deploy/k8s/base failed: $(cat "$tmp/err")"

pairs=()
for dir in "$k8s"/overlays/*/; do
  name=$(basename "$dir")
  kubectl kustomize "$dir" >"$tmp/$name.yaml" 2>"$tmp/err" ||
    fail "kubectl kustomize deploy/k8s/overlays/$name failed: $(cat "$tmp/err")"
  echo "rendered overlays/$name: $(grep -c '^kind:' "$tmp/$name.yaml") objects"
  pairs+=("$name=$tmp/$name.yaml")
done
[[ ${#pairs[@]} -ge 3 ]] || fail "expected overlays dev, prod and prod-jetstream under $k8s/overlays"
# prod-jetstream: prod with components/jetstream (relays and consumers
# through NATS JetStream); validate.mjs expects JetStream mode there.
for want in dev prod prod-jetstream; do
  [[ -s "$tmp/$want.yaml" ]] || fail "overlay $want missing"
done

node "$root/tests/deploy/validate.mjs" "--root=$root" "--bin=$bin_dir" "--base=$tmp/base.yaml" "${pairs[@]}"
