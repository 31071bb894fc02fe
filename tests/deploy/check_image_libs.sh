#!/usr/bin/env bash
# Checks, without a Docker engine, that the runtime stage of
# deploy/docker/Dockerfile installs every shared library the binaries need:
# for each binary in BIN_DIR, every library ldd resolves must belong to a
# Debian package that the runtime stage's `apt-get install` list pulls in
# (with its dependencies), or to the base image (Priority: required).
# Also checks that every package the Dockerfile installs (builder and
# runtime) exists in the configured Debian release.
#
# Usage: tests/deploy/check_image_libs.sh BIN_DIR   (e.g. build/bin)
# Needs: a Debian 12 host with the build's libraries installed (ldd must
# resolve them) and apt lists (fetched with apt-get update when missing and
# run as root; otherwise a failure). Exit 0 or 1.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
dockerfile="$root/deploy/docker/Dockerfile"
bin_dir=${1:?usage: check_image_libs.sh BIN_DIR}
bin_dir=$(cd "$bin_dir" && pwd)

fail() { echo "check_image_libs: $*" >&2; exit 1; }
for tool in ldd dpkg-query apt-cache python3; do
  command -v "$tool" >/dev/null || fail "$tool not found"
done

# The package lists of the apt-get install commands, per stage.
read_packages() {
  python3 - "$dockerfile" "$1" <<'PY'
import re, sys
text = open(sys.argv[1]).read().replace("\\\n", " ")
stages = re.split(r"^FROM\s", text, flags=re.M)[1:]
stage = stages[0] if sys.argv[2] == "builder" else stages[-1]
pkgs = []
for m in re.finditer(r"apt-get install ([^&]*)", stage):
    pkgs += [t for t in m.group(1).split() if not t.startswith("-")]
print(" ".join(pkgs))
PY
}
builder_pkgs=$(read_packages builder)
runtime_pkgs=$(read_packages runtime)
[[ -n "$runtime_pkgs" ]] || fail "no apt-get install list in the runtime stage of $dockerfile"
echo "runtime packages: $runtime_pkgs"

failures=0
# Without package lists neither the availability of the Dockerfile's
# packages nor the closure below can be known: fetch them (as root, as CI
# runs), or fail; never pass with the check left out.
if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "no apt package lists: apt-get update"
    apt-get update -qq >/dev/null || fail "apt-get update failed: cannot check the Dockerfile's packages"
  fi
  compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null ||
    fail "no apt package lists (run apt-get update as root): cannot check the Dockerfile's packages"
fi
for p in $builder_pkgs $runtime_pkgs; do
  cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')
  if [[ -z "$cand" || "$cand" == "(none)" ]]; then
    echo "FAIL package $p is not available from the configured Debian release (apt-get update?)"
    failures=$((failures + 1))
  fi
done

closure=$(
  {
    # shellcheck disable=SC2086
    apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
      --no-breaks --no-replaces --no-enhances $runtime_pkgs 2>/dev/null | grep -E '^[a-z0-9]'
    # What a debian:bookworm-slim image already holds.
    dpkg-query -W -f '${Package} ${Priority} ${Essential}\n' | awk '$2 == "required" || $3 == "yes" {print $1}'
  } | sed 's/:.*//' | sort -u
)

owner() {
  local f=$1 alt
  case "$f" in
    /usr/lib/*) alt=${f#/usr} ;;
    /lib/*) alt=/usr$f ;;
    *) alt=$f ;;
  esac
  { dpkg -S "$f" 2>/dev/null || dpkg -S "$alt" 2>/dev/null; } | head -n1 | cut -d: -f1
}

checked=0
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  exe="$bin_dir/$b"
  if [[ ! -x "$exe" ]]; then
    echo "FAIL $exe missing"
    failures=$((failures + 1))
    continue
  fi
  if ldd "$exe" | grep -q 'not found'; then
    echo "FAIL $b: ldd reports a library not found on this host:"
    ldd "$exe" | grep 'not found'
    failures=$((failures + 1))
  fi
  missing=()
  while read -r lib; do
    pkg=$(owner "$lib")
    if [[ -z "$pkg" ]]; then
      missing+=("$lib (no Debian package owns it)")
    elif ! grep -qx "$pkg" <<<"$closure"; then
      missing+=("$lib (package $pkg)")
    fi
  done < <(ldd "$exe" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | xargs -r -n1 readlink -f | sort -u)
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "FAIL $b needs libraries the runtime image lacks:"
    printf '       %s\n' "${missing[@]}"
    failures=$((failures + 1))
  else
    echo "ok   $b: all $(ldd "$exe" | grep -c '=> /') libraries come from the runtime packages or the base image"
    checked=$((checked + 1))
  fi
done

echo "check_image_libs: $checked passed, $failures failed"
[[ $failures -eq 0 ]]
