#!/usr/bin/env bash
# What an operator's image scanner would look at, in the built image:
#  - the Debian packages and versions of the runtime image (printed: the
#    list a scanner matches against advisories), read from the image's dpkg
#    database without running anything in it;
#  - no build tools in the runtime stage: no compiler, make, cmake,
#    binutils, pkg-config, protoc, no -dev package, no cc/c++/ld/make file;
#  - no file or directory owned by the user the pods run as (uid/gid 10001)
#    nor writable by everyone (sticky directories aside): the process can
#    change nothing of its image even where the root is not mounted
#    read-only;
#  - no shell needed at run time: the entrypoint is exec form, an absolute
#    path to an ELF binary, no Cmd wraps it in a shell, the configured user
#    is numeric and not root, and every `command:` of the rendered overlays
#    (dev, prod) is an absolute path to an ELF binary in the image;
#  - setuid/setgid files are listed (no-new-privileges makes them inert).
#
# Usage: tests/deploy/image_scan.sh [IMAGE]    (default localhost/outbox:dev)
# Needs root (podman image mount). Exit 0 if every check passed, 1 otherwise.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=../../scripts/lib/common.sh
source "$root/scripts/lib/common.sh"
# shellcheck source=../../scripts/lib/image.sh
source "$root/scripts/lib/image.sh"
image=${1:-$OUTBOX_IMAGE}

image_test_setup "$0" "$image" "$@"

passed=0
failed=0
check() {
  if [[ $1 == 0 ]]; then
    passed=$((passed + 1))
    echo "ok   $2"
  else
    failed=$((failed + 1))
    echo "FAIL $2"
  fi
}

mnt=$(podman image mount "$image")
trap 'podman image unmount "$image" >/dev/null 2>&1 || true' EXIT
[[ -d "$mnt/usr" ]] || die "podman image mount gave no root file system ($mnt)"

# ---------------------------------------------------------------- packages
pkgs=$(dpkg-query --admindir="$mnt/var/lib/dpkg" -W -f='${db:Status-Abbrev} ${Package}:${Architecture} ${Version}\n' |
  awk '$1 == "ii" { print $2, $3 }')
size=$(podman image inspect --format '{{.Size}}' "$image")
echo "packages of $image ($(wc -l <<<"$pkgs") installed, image $((size / 1000000)) MB):"
sed 's/^/  /' <<<"$pkgs"
check 0 "the image's dpkg database lists $(wc -l <<<"$pkgs") installed packages"
for p in libgrpc++1.51 libpqxx-6.4 libprotobuf32 libpq5 ca-certificates; do
  grep -q "^$p:" <<<"$pkgs"
  check $? "runtime package $p is installed (dpkg owns the libraries, so a scanner sees their versions)"
done

# ---------------------------------------------------------------- build tools
tools=$(awk '{ sub(/:.*/, "", $1); print $1 }' <<<"$pkgs" |
  grep -E '^(gcc|g\+\+|cpp|clang|llvm|make|cmake|binutils|build-essential|pkg-?config|pkgconf|autoconf|automake|libtool|dpkg-dev|ninja-build|protobuf-compiler.*|libc6-dev)(-[0-9.]+)?$|-dev$' || true)
check "$([[ -z "$tools" ]] && echo 0 || echo 1)" "no build tools or -dev packages in the runtime image${tools:+: $(echo $tools)}"
files=()
for f in cc c++ gcc g++ cpp ld as make cmake protoc grpc_cpp_plugin strip; do
  [[ -e "$mnt/usr/bin/$f" || -L "$mnt/usr/bin/$f" ]] && files+=("/usr/bin/$f")
done
check "$([[ ${#files[@]} -eq 0 ]] && echo 0 || echo 1)" "no compiler, linker or build tool in /usr/bin${files[*]:+: ${files[*]}}"

# ---------------------------------------------------------------- ownership
user=$(podman image inspect --format '{{.Config.User}}' "$image")
uid=${user%%:*}
gid=${user#*:}
[[ "$gid" == "$user" ]] && gid=$uid
owned=$(find "$mnt" -xdev \( -uid "$uid" -o -gid "$gid" \) -printf '/%P\n' 2>/dev/null | head -20)
check "$([[ -z "$owned" ]] && echo 0 || echo 1)" "no file owned by the image's user $uid or group $gid${owned:+: $(echo $owned)}"
writable=$(find "$mnt" -xdev -perm -0002 ! -type l ! \( -type d -perm -1000 \) -printf '/%P\n' 2>/dev/null | head -20)
check "$([[ -z "$writable" ]] && echo 0 || echo 1)" "nothing writable by everyone (sticky directories aside)${writable:+: $(echo $writable)}"
suid=$(find "$mnt" -xdev -type f \( -perm -4000 -o -perm -2000 \) -printf '/%P\n' 2>/dev/null | sort)
echo "note setuid/setgid files (inert under no-new-privileges and without capabilities): $(echo ${suid:-none})"

# ---------------------------------------------------------------- no shell at run time
is_elf() { [[ -f "$mnt$1" && "$(head -c 4 "$mnt$1" | od -An -c | tr -d ' ')" == '177ELF' ]]; }
entry=$(podman image inspect --format '{{json .Config.Entrypoint}}' "$image")
cmd=$(podman image inspect --format '{{json .Config.Cmd}}' "$image")
first=$(node -e 'const e = JSON.parse(process.argv[1]); console.log(Array.isArray(e) && e.length === 1 && e[0].startsWith("/") ? e[0] : "")' "$entry")
check "$([[ -n "$first" ]] && is_elf "$first" && echo 0 || echo 1)" "the entrypoint is exec form, an absolute path to an ELF binary ($entry)"
check "$(node -e 'const c = JSON.parse(process.argv[1]); process.exit(c === null || (Array.isArray(c) && !/(^|\/)(ba|da)?sh$/.test(c[0] ?? "")) ? 0 : 1)' "$cmd" && echo 0 || echo 1)" "no Cmd runs a shell (Cmd: $cmd)"
check "$([[ "$uid" =~ ^[0-9]+$ && "$uid" != 0 ]] && echo 0 || echo 1)" "the image's user is numeric and not root (User: $user), as runAsNonRoot needs"
for overlay in dev prod; do
  rendered=$(kubectl kustomize "$root/deploy/k8s/overlays/$overlay") || { check 1 "kubectl kustomize $overlay"; continue; }
  commands=$(node --input-type=module -e '
    import { parseDocs, podSpecOf } from "'"$here"'/lib/k8s.mjs";
    import { readFileSync } from "node:fs";
    for (const o of parseDocs(readFileSync(0, "utf8"))) {
      const spec = o.kind === "CronJob" ? o.spec?.jobTemplate?.spec?.template?.spec : ["Deployment", "StatefulSet", "DaemonSet", "Job"].includes(o.kind) ? podSpecOf(o) : null;
      for (const c of spec?.containers ?? []) if (/(^|\/)outbox/.test(c.image ?? "")) console.log(`${o.metadata.name}/${c.name} ${(c.command ?? ["(none)"])[0]} ${c.command?.length ?? 0}`);
    }' <<<"$rendered")
  [[ -n "$commands" ]] || { check 1 "$overlay: the rendered overlay runs outbox containers"; continue; }
  while read -r who path n; do
    check "$([[ "$path" == /* && "$n" == 1 ]] && is_elf "$path" && echo 0 || echo 1)" "$overlay $who: command $path is an absolute path to an ELF binary of the image, run without a shell"
  done <<<"$commands"
done

echo "image_scan: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
