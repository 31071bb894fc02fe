#!/bin/bash
# Runs an outbox binary inside the image, as its pod would: called through a
# symlink named after the binary (outbox-relay -> in_container.sh) in the
# wrapper directory that tests/deploy/run_image.sh makes and hands to
# run_rendered.sh as its BIN_DIR. The directory's `config` names the image,
# CONTAINERS_CONF and the run's id; args/<pod>.args (image_args.mjs) hold
# the pod's podman options (securityContext, limits), chosen by HOSTNAME
# (the instance name rendered.mjs gives, DEPLOYMENT-N), else by binary.
# What the container gets besides:
#  - the declared environment only: OUTBOX_* and PG* variables, HOSTNAME;
#  - the host's loopback (--network=host: the test PostgreSQL, the other
#    containers' ports; no other network is used);
#  - the local copies of the Secret volumes (EMULATE_IMAGE_MOUNTS), read-only
#    at the same paths;
#  - no shell: /usr/bin/dash and /usr/bin/bash are masked, so that nothing
#    at run time can rely on one.
# exec: the pid run_rendered.sh signals is podman's, which passes SIGTERM
# to the binary (PID 1 in the container) and exits with its status.
set -euo pipefail
self=$(readlink -f "${BASH_SOURCE[0]}")
dir=$(cd "$(dirname "$0")" && pwd)
bin=$(basename "$0")
[[ "$self" != "$dir/$bin" ]] || { echo "in_container.sh: call it through a symlink named after a binary" >&2; exit 2; }
# shellcheck source=/dev/null
source "$dir/config"   # IMAGE, CONTAINERS_CONF, RUN_ID
export CONTAINERS_CONF

pod=${HOSTNAME:-}
pod=${pod%-[0-9]*}
args_file="$dir/args/$bin.args"
[[ "$bin" != outboxctl && -n "$pod" && -f "$dir/args/$pod.args" ]] && args_file="$dir/args/$pod.args"
mapfile -t opts <"$args_file"

envs=()
while IFS= read -r name; do
  case "$name" in
    OUTBOX_* | PG*) envs+=(-e "$name") ;;
  esac
done < <(compgen -e)
[[ "$bin" != outboxctl && -n "${HOSTNAME:-}" ]] && envs+=(-e "HOSTNAME=$HOSTNAME")

mounts=()
IFS=: read -r -a dirs <<<"${EMULATE_IMAGE_MOUNTS:-}"
for d in "${dirs[@]}"; do
  [[ -n "$d" ]] && mounts+=(-v "$d:$d:ro")
done

name="outbox-it-$RUN_ID-${HOSTNAME:-$bin}"
[[ "$bin" == outboxctl || -z "${HOSTNAME:-}" ]] && name="outbox-it-$RUN_ID-$bin-$$"
exec /usr/bin/podman run --rm --name "$name" --label "org.outbox.test=$RUN_ID" \
  --network=host --pull=never \
  -v /dev/null:/usr/bin/dash:ro -v /dev/null:/usr/bin/bash:ro \
  "${opts[@]}" ${envs[@]+"${envs[@]}"} ${mounts[@]+"${mounts[@]}"} \
  --entrypoint "/usr/local/bin/$bin" "$IMAGE" "$@"
