#!/usr/bin/env bash
# Stands in for `docker build` + `docker run` where no container engine
# exists: builds the runtime stage of deploy/docker/Dockerfile as a chroot
# (debootstrap of Debian bookworm, then the stage's own RUN commands), copies
# the binaries in, and writes wrappers that run each binary the way the pods
# do: image root file system mounted read-only, as uid/gid 10001, no HOME,
# and the directories in EMULATE_IMAGE_MOUNTS (run_rendered.sh: the local
# copies of the pods' Secret volumes, i.e. the certificates) shown read-only.
# Feed the wrapper directory to run_rendered.sh:
#
#   sudo tests/deploy/emulate_image.sh build/bin /tmp/outbox-image
#   OUTBOX_TEST_PG_URL=... tests/deploy/run_rendered.sh /tmp/outbox-image/bin
#
# Needs root, debootstrap (apt-get install debootstrap), util-linux unshare,
# and access to the Debian mirror. Not part of CI; exit 0 or 1.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
dockerfile="$root/deploy/docker/Dockerfile"
bin_dir=${1:?usage: emulate_image.sh BIN_DIR OUT_DIR}
out=${2:?usage: emulate_image.sh BIN_DIR OUT_DIR}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

fail() { echo "emulate_image: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || fail "needs root (debootstrap, chroot, mount)"
command -v debootstrap >/dev/null || fail "debootstrap not found (apt-get install debootstrap)"
mkdir -p "$out"
out=$(cd "$out" && pwd)
rootfs="$out/rootfs"
ro="$out/ro"

if [[ ! -x "$rootfs/bin/sh" ]]; then
  echo "debootstrap bookworm (minbase) into $rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$out/debootstrap.log" 2>&1 ||
    fail "debootstrap failed, see $out/debootstrap.log"
fi
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
# The kubelet gives every pod an /etc/hosts with localhost in it.
grep -qs localhost "$rootfs/etc/hosts" ||
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >>"$rootfs/etc/hosts"

# The runtime stage's RUN commands, in order; COPY of the binaries between
# the first and the last as in the Dockerfile.
mapfile -t runs < <(python3 - "$dockerfile" <<'PY'
import re, sys
text = open(sys.argv[1]).read().replace("\\\n", " ")
stage = re.split(r"^FROM\s", text, flags=re.M)[-1]
for line in stage.split("\n"):
    if line.startswith("RUN "):
        print(line[4:].strip())
PY
)
[[ ${#runs[@]} -ge 1 ]] || fail "no RUN in the runtime stage"
chroot_run() {
  chroot "$rootfs" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    DEBIAN_FRONTEND=noninteractive /bin/sh -ec "$1"
}
if ! chroot "$rootfs" getent passwd 10001 >/dev/null; then
  echo "RUN ${runs[0]:0:100}..."
  chroot_run "${runs[0]}" >"$out/run0.log" 2>&1 || fail "runtime RUN #1 failed, see $out/run0.log"
fi
mkdir -p "$rootfs/usr/local/bin"
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  [[ -x "$bin_dir/$b" ]] || fail "$bin_dir/$b missing"
  install -m 0755 "$bin_dir/$b" "$rootfs/usr/local/bin/$b"
  strip --strip-unneeded "$rootfs/usr/local/bin/$b"
done
for ((i = 1; i < ${#runs[@]}; i++)); do
  echo "RUN ${runs[$i]:0:100}..."
  chroot_run "${runs[$i]}" || fail "runtime RUN #$((i + 1)) failed"
done

mkdir -p "$ro" "$out/bin"
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  cat >"$out/bin/$b" <<EOF
#!/bin/sh
# $b as in its pod: read-only image root, uid/gid 10001 (exec chain: the pid stays the same).
# EMULATE_IMAGE_MOUNTS: colon-separated host directories shown read-only at the same path
# inside, as a pod's Secret volumes are (run_rendered.sh sets it for the certificates);
# the binary does not see the variable.
for d in \$(echo "\${EMULATE_IMAGE_MOUNTS:-}" | tr ':' ' '); do mkdir -p "$rootfs\$d"; done
exec unshare -m --propagation private /bin/sh -c '
  mount --bind "$rootfs" "$ro" && mount -o remount,bind,ro "$ro" || exit 1
  for d in \$(echo "\${EMULATE_IMAGE_MOUNTS:-}" | tr ":" " "); do
    mount --bind "\$d" "$ro\$d" && mount -o remount,bind,ro "$ro\$d" || exit 1
  done
  exec env -u EMULATE_IMAGE_MOUNTS chroot --userspec=10001:10001 "$ro" /usr/local/bin/$b "\$@"' $b "\$@"
EOF
  chmod +x "$out/bin/$b"
done
# (abseil's --helpfull exits 1: look at what it prints.)
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  help=$("$out/bin/$b" --helpfull 2>&1 || true)
  grep -q -- '--log_format' <<<"$help" || fail "$b does not start in the emulated image: $help"
done
echo "emulated runtime image in $rootfs ($(du -sh --exclude=proc "$rootfs" | cut -f1)); wrappers in $out/bin"
