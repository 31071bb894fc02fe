#!/usr/bin/env bash
# The container image run as the dev overlay's pods run it: the real-image
# counterpart of run_rendered.sh. Every outbox container of the rendered
# overlay (deploy/k8s/overlays/dev) becomes a `podman run` of IMAGE with the
# pod's own restrictions mapped by lib/podman.mjs (numeric non-root user and
# fsGroup, read-only root without tmpfs, all capabilities dropped, no new
# privileges, seccomp, memory and CPU limits), the manifests' command, args
# and environment, no shell in the container, and the host's loopback only
# (--network=host, for the test PostgreSQL). run_rendered.sh then does all
# its checks through these containers: health, metrics, mutual TLS, an
# order and an outboxctl load through producer, relay and consumer,
# `outboxctl verify` (itself in a container) and the reconcile CronJob's
# command, certificate renewal, and exit 0 within the grace period after
# SIGTERM of each container.
#
# Usage: OUTBOX_TEST_PG_URL=postgresql://postgres@127.0.0.1:5432 \
#          tests/deploy/run_image.sh [IMAGE]      (default localhost/outbox:dev)
# Needs root and podman; the image is built by scripts/image. Containers of
# this run are labelled org.outbox.test=RUN and removed at the end.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=../../scripts/lib/common.sh
source "$root/scripts/lib/common.sh"
# shellcheck source=../../scripts/lib/image.sh
source "$root/scripts/lib/image.sh"
image=${1:-$OUTBOX_IMAGE}

fail() { echo "run_image: $*" >&2; exit 1; }
image_test_setup "$0" "$image" "$@"

run_id="ri$$"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/run_image.XXXXXX")
cleanup() {
  local rc=$? ids
  ids=$(podman ps -aq --filter "label=org.outbox.test=$run_id" 2>/dev/null || true)
  if [[ -n "$ids" ]]; then
    echo "run_image: removing containers left by this run: $(echo $ids)"
    # shellcheck disable=SC2086
    podman rm -f -t 0 $ids >/dev/null 2>&1 || true
  fi
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

kubectl kustomize "$root/deploy/k8s/overlays/dev" >"$tmp/rendered.yaml" ||
  fail "kubectl kustomize deploy/k8s/overlays/dev failed"
node "$here/image_args.mjs" "--rendered=$tmp/rendered.yaml" "--out=$tmp/bin/args" ||
  fail "the pods' restrictions cannot all be given to podman (above)"
printf 'IMAGE=%q\nCONTAINERS_CONF=%q\nRUN_ID=%q\n' "$image" "$CONTAINERS_CONF" "$run_id" >"$tmp/bin/config"
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  ln -s "$here/lib/in_container.sh" "$tmp/bin/$b"
done
echo "image $image ($(podman image inspect --format '{{.Id}}' "$image" | cut -c1-12)), run $run_id"

# What each pod's options give a process in the image, read by the kernel
# (/proc/self/status of /usr/bin/cat run with them): the numeric user and
# group, no capability at all, no_new_privs, a seccomp filter; a write to
# the root refused; no shell to run.
bad=0
say() { if [[ $1 == 0 ]]; then echo "ok   $2"; else echo "FAIL $2"; bad=1; fi; }
for f in "$tmp/bin/args"/outbox-*.args; do
  pod=$(basename "$f" .args)
  mapfile -t opts <"$f"
  want_uid=$(sed -n 's/^--user=\([0-9]*\).*/\1/p' "$f")
  st=$(podman run --rm --network=none --pull=never "${opts[@]}" --entrypoint /usr/bin/cat "$image" /proc/self/status 2>&1) || st="error: $st"
  field() { awk -v k="$1:" '$1 == k { print $2 }' <<<"$st"; }
  say "$([[ -n "$want_uid" && "$(field Uid)" == "$want_uid" && "$(field CapEff)" == 0000000000000000 && "$(field CapBnd)" == 0000000000000000 && "$(field NoNewPrivs)" == 1 && "$(field Seccomp)" == 2 ]] && echo 0 || echo 1)" \
    "$pod: in the container uid $(field Uid | head -1), gid $(field Gid | head -1), groups $(field Groups), CapEff $(field CapEff), CapBnd $(field CapBnd), NoNewPrivs $(field NoNewPrivs), Seccomp $(field Seccomp)"
  out=$(podman run --rm --network=none --pull=never "${opts[@]}" --entrypoint /usr/bin/touch "$image" /usr/local/bin/probe 2>&1) && rc=0 || rc=$?
  say "$([[ $rc -ne 0 && "$out" == *"Read-only file system"* ]] && echo 0 || echo 1)" "$pod: the root file system refuses a write (touch: ${out##*: })"
done
out=$(podman run --rm --network=none --pull=never -v /dev/null:/usr/bin/dash:ro -v /dev/null:/usr/bin/bash:ro \
  --entrypoint /bin/sh "$image" -c true 2>&1) && rc=0 || rc=$?
say "$([[ $rc -ne 0 ]] && echo 0 || echo 1)" "with dash and bash masked (as every container of this run) /bin/sh cannot start (exit $rc)"
[[ $bad -eq 0 ]] || fail "the containers would not run with the pods' restrictions"

# The containers start more slowly than processes: a longer bound.
RUN_RENDERED_TIMEOUT=${RUN_RENDERED_TIMEOUT:-480} "$here/run_rendered.sh" "$tmp/bin"
