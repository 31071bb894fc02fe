#!/usr/bin/env bash
# Checks, without a Docker engine, that the runtime stage of
# deploy/docker/Dockerfile installs every shared library the binaries need:
# for each binary in BIN_DIR, every library ldd resolves must belong to a
# Debian package that the runtime stage's `apt-get install` list pulls in
# (with its dependencies), or to the base image (Priority: required).
# Also checks that every package the Dockerfile installs (builder and
# runtime) exists in the configured Debian release, and that the builder
# stage hashes the same ccache settings as the host's build.
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
# One apt-cache call for every package (each call loads the whole cache,
# 0.7 s here): a package it does not know prints no block of its own.
declare -A candidate=()
while read -r pkg cand; do
  candidate[$pkg]=$cand
done < <(
  # shellcheck disable=SC2086
  apt-cache policy $builder_pkgs $runtime_pkgs 2>/dev/null |
    awk '/^[^ ].*:$/ {sub(/:$/, ""); pkg = $0} /^  Candidate:/ {print pkg, $2}'
)
for p in $builder_pkgs $runtime_pkgs; do
  cand=${candidate[$p]:-}
  if [[ -z "$cand" || "$cand" == "(none)" ]]; then
    echo "FAIL package $p is not available from the configured Debian release (apt-get update?)"
    failures=$((failures + 1))
  fi
done

# The image's builder finds the checkout's ccache entries (scripts/image
# mounts them) only if it hashes the same settings as the host's build
# (export_ccache_env in scripts/lib/common.sh). One changed alone fails
# nothing: the image would silently compile everything again.
ccache_settings() {
  local v
  for v in CCACHE_COMPILERCHECK CCACHE_NOHASHDIR LANG LC_ALL LC_CTYPE LC_MESSAGES; do
    echo "$v=${!v-}"
  done
}
host_ccache=$(env -i bash -c 'source "$1"; export_ccache_env; shift; eval "$*"; ccache_settings' _ \
  "$root/scripts/lib/common.sh" "$(declare -f ccache_settings)")
image_ccache=$(python3 - "$dockerfile" <<'PY'
import re, shlex, sys
text = open(sys.argv[1]).read().replace("\\\n", " ")
builder = re.split(r"^FROM\s", text, flags=re.M)[1]
env, workdir = {}, ""
for line in builder.splitlines():
    m = re.match(r"\s*(ENV|WORKDIR)\s+(.*)", line)
    if m and m.group(1) == "ENV":
        env.update(t.split("=", 1) for t in shlex.split(m.group(2)) if "=" in t)
    elif m:
        workdir = m.group(2).strip()
for v in ("CCACHE_COMPILERCHECK", "CCACHE_NOHASHDIR", "LANG", "LC_ALL",
          "LC_CTYPE", "LC_MESSAGES"):
    print(f"{v}={env.get(v, '')}")
if env.get("CCACHE_BASEDIR") != workdir:
    print(f"CCACHE_BASEDIR={env.get('CCACHE_BASEDIR', '')} (the sources are in {workdir})")
PY
)
if [[ "$host_ccache" != "$image_ccache" ]]; then
  echo "FAIL the Dockerfile's builder and scripts/lib/common.sh hash different ccache settings (the image would recompile everything):"
  diff <(echo "$host_ccache") <(echo "$image_ccache") | sed -n 's/^</       host: /p; s/^>/       image:/p'
  failures=$((failures + 1))
else
  echo "ok   ccache: the image's builder hashes what the host's build does ($(tr '\n' ' ' <<<"$host_ccache"))"
fi

closure=$(
  {
    # shellcheck disable=SC2086
    apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
      --no-breaks --no-replaces --no-enhances $runtime_pkgs 2>/dev/null | grep -E '^[a-z0-9]'
    # What a debian:bookworm-slim image already holds.
    dpkg-query -W -f '${Package} ${Priority} ${Essential}\n' | awk '$2 == "required" || $3 == "yes" {print $1}'
  } | sed 's/:.*//' | sort -u
)

# Every library any binary loads, resolved, and the package owning each:
# one dpkg -S for them all (each call reads the whole file database). With
# merged /usr a file is listed under /lib or /usr/lib, so both are asked.
# ldd runs once a binary (ldd_of: its output as printed).
declare -A ldd_of=() libs_of=() owner_of=()
all_libs=()
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  [[ -x "$bin_dir/$b" ]] || continue
  ldd_of[$b]=$(ldd "$bin_dir/$b")
  libs_of[$b]=$(awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' <<<"${ldd_of[$b]}" |
    xargs -r -n1 readlink -f | sort -u)
  mapfile -t -O "${#all_libs[@]}" all_libs <<<"${libs_of[$b]}"
done
alt_of() {
  case "$1" in
    /usr/lib/*) echo "${1#/usr}" ;;
    /lib/*) echo "/usr$1" ;;
    *) echo "$1" ;;
  esac
}
queries=()
for f in $(printf '%s\n' "${all_libs[@]}" | sort -u); do
  queries+=("$f" "$(alt_of "$f")")
done
if [[ ${#queries[@]} -gt 0 ]]; then
  while IFS= read -r line; do
    pkg=${line%%: *}
    owner_of[${line#*: }]=${pkg%%:*}
  done < <(dpkg -S "${queries[@]}" 2>/dev/null | grep -v '^diversion by' || :)
fi
owner() {
  local f=$1
  echo "${owner_of[$f]:-${owner_of[$(alt_of "$f")]:-}}"
}

checked=0
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  exe="$bin_dir/$b"
  if [[ ! -x "$exe" ]]; then
    echo "FAIL $exe missing"
    failures=$((failures + 1))
    continue
  fi
  # Not `ldd | grep -q`: grep stopping early breaks ldd's pipe, which
  # pipefail counts as no match.
  if grep -q 'not found' <<<"${ldd_of[$b]}"; then
    echo "FAIL $b: ldd reports a library not found on this host:"
    grep 'not found' <<<"${ldd_of[$b]}"
    failures=$((failures + 1))
  fi
  missing=()
  while read -r lib; do
    [[ -n "$lib" ]] || continue
    pkg=$(owner "$lib")
    if [[ -z "$pkg" ]]; then
      missing+=("$lib (no Debian package owns it)")
    elif ! grep -qx "$pkg" <<<"$closure"; then
      missing+=("$lib (package $pkg)")
    fi
  done <<<"${libs_of[$b]}"
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "FAIL $b needs libraries the runtime image lacks:"
    printf '       %s\n' "${missing[@]}"
    failures=$((failures + 1))
  else
    echo "ok   $b: all $(grep -c '=> /' <<<"${ldd_of[$b]}") libraries come from the runtime packages or the base image"
    checked=$((checked + 1))
  fi
done

echo "check_image_libs: $checked passed, $failures failed"
[[ $failures -eq 0 ]]
