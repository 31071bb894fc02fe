# Shared by scripts/image and the image tests (tests/deploy/image_*.sh): the
# podman configuration of this project, the Debian base images made with
# debootstrap when no registry is reachable, and the build of
# deploy/docker/Dockerfile. Source it after common.sh; it defines functions
# only.

# Debian 12 packages the image parts need (installed by scripts/image and by
# scripts/test for the image tests).
OUTBOX_IMAGE_PACKAGES=(podman buildah runc debootstrap uidmap zstd)

OUTBOX_IMAGE="${OUTBOX_IMAGE:-localhost/outbox:dev}"
OUTBOX_IMAGE_RELEASE=bookworm
# Where the private podman configuration and the base images' root file
# systems (by content key) are kept between runs.
OUTBOX_IMAGE_CACHE="${OUTBOX_IMAGE_CACHE:-/var/tmp/outbox-image}"
# Changes with what make_bases puts in a base image: a new value makes new
# bases (and so a rebuild of every layer above them).
OUTBOX_BASE_RECIPE=2

# image_podman_env: a containers.conf of our own in OUTBOX_IMAGE_CACHE, named
# by CONTAINERS_CONF, so that nothing of the host's configuration changes:
# runc (Debian's crun 1.8 refuses hybrid cgroup hierarchies), and default
# ulimits within the host's hard limits (podman's defaults for root, nofile
# and nproc 1048576, are above them on some machines, and raising a hard
# limit needs CAP_SYS_RESOURCE; runc also refused an nproc above
# kernel.pid_max there).
image_podman_env() {
  mkdir -p "$OUTBOX_IMAGE_CACHE"
  local conf="$OUTBOX_IMAGE_CACHE/containers.conf" nofile nproc pid_max
  nofile=$(ulimit -Hn)
  nproc=$(ulimit -Hu)
  pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)
  [ "$nofile" = unlimited ] && nofile=1048576
  [ "$nproc" = unlimited ] && nproc=1048576
  [ "$nproc" -gt "$pid_max" ] && nproc=$pid_max
  # Several callers at once (the image tests run in parallel): each writes
  # its own file and renames it into place.
  cat >"$conf.$$" <<EOF
# Written by scripts/lib/image.sh (image_podman_env); used through
# CONTAINERS_CONF by scripts/image and the image tests only.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
EOF
  mv -f "$conf.$$" "$conf"
  export CONTAINERS_CONF="$conf"
}

# The start of a test of the built image, SCRIPT run with ARGS: root
# (podman's storage is root's; through sudo when not root, running SCRIPT
# again), podman's settings, and IMAGE there.
image_test_setup() {  # SCRIPT IMAGE ARGS...
  local script=$1 image=$2
  shift 2
  [[ $(id -u) -eq 0 ]] || exec sudo --preserve-env bash "$script" "$@"
  command -v podman >/dev/null || die "podman not found (scripts/image installs it)"
  image_podman_env
  podman image exists "$image" || die "no image $image: build it with scripts/image"
}

# debian_sources: "URI SUITE" lines for the Debian release of the image,
# read from apt's own sources (one-line sources.list and deb822 .sources),
# main component, binary packages only. The first line's URI is the mirror
# debootstrap uses. Arguments: other source files to read instead.
debian_sources() {
  local files=("$@") f
  if [ $# -eq 0 ]; then
    [ -f /etc/apt/sources.list ] && files+=(/etc/apt/sources.list)
    for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
      [ -f "$f" ] && files+=("$f")
    done
  fi
  [ ${#files[@]} -gt 0 ] || return 0
  awk -v rel="$OUTBOX_IMAGE_RELEASE" '
    function emit(uris, suites, comps, types,   u, s, nu, ns, i, j, U, S) {
      if (types !~ /(^| )deb( |$)/ || comps !~ /(^| )main( |$)/) return
      nu = split(uris, U, " "); ns = split(suites, S, " ")
      for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++)
        if (S[j] ~ ("^" rel "(-updates|-security)?$")) print U[i], S[j]
    }
    FNR == 1 { if (deb822) emit(uris, suites, comps, types); deb822 = FILENAME ~ /\.sources$/; uris = suites = comps = types = ""; enabled = 1 }
    deb822 {
      if ($0 ~ /^[ \t]*$/) { if (enabled) emit(uris, suites, comps, types); uris = suites = comps = types = ""; enabled = 1; next }
      if ($0 ~ /^#/) next
      k = tolower($1); sub(/:$/, "", k); v = $0; sub(/^[^:]*:[ \t]*/, "", v)
      if (k == "uris") uris = v; else if (k == "suites") suites = v
      else if (k == "components") comps = v; else if (k == "types") types = v
      else if (k == "enabled" && tolower(v) == "no") enabled = 0
      next
    }
    $1 == "deb" {
      i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
      c = ""; for (j = i + 2; j <= NF; j++) c = c " " $j
      emit($i, $(i + 1), c, "deb")
    }
    END { if (deb822 && enabled) emit(uris, suites, comps, types) }
  ' "${files[@]}" | awk '!seen[$0]++' |
    # The release itself first: its URI is the mirror.
    sort -s -k2,2 | awk -v rel="$OUTBOX_IMAGE_RELEASE" '$2 == rel { print; next } { rest[++n] = $0 } END { for (i = 1; i <= n; i++) print rest[i] }'
}

# image_label IMAGE LABEL: the label's value, empty if there is no such
# image or label.
image_label() {
  podman image inspect --format "{{index .Labels \"$2\"}}" "$1" 2>/dev/null | grep -v '^<no value>$' || true
}

# The dpkg path excludes of Debian's -slim images (docs, man pages, locales
# out; copyright files kept), written into the slim base and applied to
# what debootstrap installed.
SLIM_DPKG_CFG='path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*'

# make_bases: docker.io/library/debian:RELEASE and RELEASE-slim, the names
# the Dockerfile's FROM lines use, unless images with the current content
# key are there already. The key covers the apt sources, debootstrap's
# version and OUTBOX_BASE_RECIPE; the root file systems are kept in
# OUTBOX_IMAGE_CACHE by key, so that a wiped podman storage is refilled
# without the mirror. OUTBOX_IMAGE_REFRESH=1 makes new ones (e.g. for
# Debian's security updates). Sets BASE_SECONDS (time spent).
make_bases() {
  local t0=$SECONDS sources mirror key full slim rootfs
  sources=$(debian_sources)
  [ -n "$sources" ] || die "no Debian $OUTBOX_IMAGE_RELEASE source in apt's sources (/etc/apt/sources.list, /etc/apt/sources.list.d/)"
  mirror=$(head -1 <<<"$sources" | cut -d' ' -f1)
  key=$( { echo "recipe $OUTBOX_BASE_RECIPE"; dpkg-query -W -f='${Version}\n' debootstrap; echo "$sources"; echo "$SLIM_DPKG_CFG"; } |
    sha256sum | cut -c1-16)
  full="docker.io/library/debian:$OUTBOX_IMAGE_RELEASE"
  slim="$full-slim"
  if [ "${OUTBOX_IMAGE_REFRESH:-0}" != 1 ] &&
    [ "$(image_label "$full" org.outbox.base-key)" = "$key" ] &&
    [ "$(image_label "$slim" org.outbox.base-key)" = "$key" ]; then
    log "base images $full and $slim are current (key $key)"
    BASE_SECONDS=$((SECONDS - t0))
    return 0
  fi
  local dir="$OUTBOX_IMAGE_CACHE/base-$key"
  if [ "${OUTBOX_IMAGE_REFRESH:-0}" = 1 ] || [ ! -f "$dir/full.tar" ] || [ ! -f "$dir/slim.tar" ]; then
    rm -rf "$OUTBOX_IMAGE_CACHE"/base-*
    mkdir -p "$dir"
    rootfs="$dir/rootfs"
    log "debootstrap --variant=minbase $OUTBOX_IMAGE_RELEASE from $mirror (log: $dir/debootstrap.log)"
    local t1=$SECONDS
    debootstrap --variant=minbase "$OUTBOX_IMAGE_RELEASE" "$rootfs" "$mirror" >"$dir/debootstrap.log" 2>&1 ||
      { tail -20 "$dir/debootstrap.log" >&2; die "debootstrap failed (full log: $dir/debootstrap.log)"; }
    log "debootstrap took $((SECONDS - t1)) s"
    # As Debian's own images: apt's sources (those of this machine), no
    # downloaded packages or lists, no host files, an empty /dev (the
    # container engine provides the devices; debootstrap's own nodes would
    # be world-writable files of the image).
    local m
    for m in dev proc sys; do
      ! mountpoint -q "$rootfs/$m" || die "$rootfs/$m is still mounted after debootstrap"
    done
    find "$rootfs/dev" -mindepth 1 -delete
    awk '{ print "deb " $1 " " $2 " main" }' <<<"$sources" >"$rootfs/etc/apt/sources.list"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/* \
      "$rootfs"/etc/resolv.conf "$rootfs"/etc/hostname "$rootfs"/var/log/bootstrap.log
    tar --numeric-owner --xattrs -C "$rootfs" -cf "$dir/full.tar" .
    # -slim: dpkg's path excludes, and what they exclude removed from the
    # packages already installed.
    mkdir -p "$rootfs/etc/dpkg/dpkg.cfg.d"
    printf '%s\n' "$SLIM_DPKG_CFG" >"$rootfs/etc/dpkg/dpkg.cfg.d/docker"
    find "$rootfs/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
    find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
    local d
    for d in info linda lintian/overrides locale man groff; do
      [ -d "$rootfs/usr/share/$d" ] && find "$rootfs/usr/share/$d" -mindepth 1 -delete
    done
    tar --numeric-owner --xattrs -C "$rootfs" -cf "$dir/slim.tar" .
    rm -rf "$rootfs"
  else
    log "base root file systems from $dir (key $key)"
  fi
  local changes=(--change "LABEL org.outbox.base-key=$key" --change 'CMD ["bash"]'
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin')
  podman import -q "${changes[@]}" "$dir/full.tar" "$full" >/dev/null
  podman import -q "${changes[@]}" "$dir/slim.tar" "$slim" >/dev/null
  log "imported $full and $slim (key $key)"
  BASE_SECONDS=$((SECONDS - t0))
}

# build_image: podman build of deploy/docker/Dockerfile, unchanged, with the
# local bases only (--pull=never) and layer caching (an unchanged layer is
# not rebuilt). Sets BUILD_SECONDS.
build_image() {
  local t0=$SECONDS out="$OUTBOX_IMAGE_CACHE/build.log" rc=0
  log "podman build -f deploy/docker/Dockerfile -t $OUTBOX_IMAGE (log: $out)"
  # The checkout's Release build compiled the same sources: its compiler
  # cache (read-only) saves compiling them again.
  local cache=()
  [ -d "$OUTBOX_CCACHE_DIR" ] && cache=(--volume "$OUTBOX_CCACHE_DIR:/ccache:ro")
  podman build --pull=never --layers "${cache[@]}" \
    -f "$OUTBOX_ROOT/deploy/docker/Dockerfile" \
    -t "$OUTBOX_IMAGE" "$OUTBOX_ROOT" >"$out" 2>&1 || rc=$?
  [ $rc -eq 0 ] || { tail -30 "$out" >&2; die "podman build failed (exit $rc; full log: $out)"; }
  BUILD_SECONDS=$((SECONDS - t0))
  # What a rebuild took from the cache.
  IMAGE_CACHED_STEPS=$(grep -c -- '--> Using cache' "$out" || true)
  IMAGE_STEPS=$(grep -cE '^(\[[0-9]+/[0-9]+\] )?STEP [0-9]+/' "$out" || true)
}
