#!/usr/bin/env bash
# Build the CPU base image `ddp-cifar-base:cpu` from nothing, without any registry:
#   1. debootstrap a minimal Debian bookworm (python3 + venv + CA certificates) into a tarball, cached;
#   2. `docker import` the tarball as a raw base (re-imported only when the tarball changes);
#   3. download the CPU torch wheel, tensorboard (rank 0's event files) and their runtime deps ON THE HOST
#      into docker/wheels/ (inside a build, the network is reachable only through a TLS proxy; a local wheel set
#      needs no network at all);
#   4. build docker/cpu-base/Dockerfile: /opt/venv with those wheels, installed with --no-index.
# Every step is skipped or served from cache when its inputs did not change, so a second run takes seconds.
# Environment knobs: DEBIAN_MIRROR, TORCH_VERSION, NUMPY_VERSION, TENSORBOARD_VERSION, CPU_BASE_TAG, DDP_CACHE_DIR.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly REPO_ROOT
readonly SUITE=bookworm
# bookworm ships CPython 3.11: the wheels below must be cp311.
readonly PY_TAG=311
readonly TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
readonly NUMPY_VERSION="${NUMPY_VERSION:-2.4.6}"
readonly TENSORBOARD_VERSION="${TENSORBOARD_VERSION:-2.21.0}"
readonly CACHE_DIR="${DDP_CACHE_DIR:-$REPO_ROOT/.cache}/cpu-base"
readonly WHEEL_DIR="$REPO_ROOT/docker/wheels"
readonly ROOTFS_TAR="$CACHE_DIR/$SUITE-minbase.tar"
readonly RAW_TAG="ddp-cifar-rootfs:$SUITE"
readonly BASE_TAG="${CPU_BASE_TAG:-ddp-cifar-base:cpu}"
readonly PIP="${PIP:-$REPO_ROOT/.venv/bin/pip}"

log() { printf '[cpu-base %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# The Debian mirror apt already uses on this machine (a Debian archive, not -security, not Ubuntu's);
# deb.debian.org when apt points elsewhere (e.g. an Ubuntu host).
debian_mirror() {
    if [[ -n "${DEBIAN_MIRROR:-}" ]]; then echo "$DEBIAN_MIRROR"; return; fi
    local uri
    uri="$( { grep -hsE '^[[:space:]]*URIs:' /etc/apt/sources.list.d/*.sources | awk '{for (i=2;i<=NF;i++) print $i}';
              grep -hsE '^[[:space:]]*deb[[:space:]]' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
                | sed -E 's/\[[^]]*\]//' | awk '{print $2}'; } \
            | grep -E '^https?://.*/debian/?$' | head -n1 || true)"
    echo "${uri:-http://deb.debian.org/debian}"
}

build_rootfs_tarball() {
    if [[ -s "$ROOTFS_TAR" ]]; then log "rootfs: cached $ROOTFS_TAR"; return; fi
    command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install debootstrap"
    local mirror work keyring_opt=()
    mirror="$(debian_mirror)"
    [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] \
        && keyring_opt=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
    mkdir -p "$CACHE_DIR"
    work="$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")"
    # shellcheck disable=SC2064  # expand $work now: it is local to this function
    trap "rm -rf '$work'" EXIT
    log "rootfs: debootstrap --variant=minbase $SUITE from $mirror (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "${keyring_opt[@]}" "$SUITE" "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 \
        || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap of $SUITE from $mirror failed (log above)"; }
    # Shrink what ships to every test host: downloaded .debs, apt lists, docs, man pages, locales.
    rm -rf "$work/root"/var/cache/apt/archives/*.deb "$work/root"/var/lib/apt/lists/* \
           "$work/root"/usr/share/doc/* "$work/root"/usr/share/man/* "$work/root"/usr/share/info/* \
           "$work/root"/usr/share/locale/* "$work/root"/var/log/*.log "$work/root"/debootstrap
    # The image must resolve names through Docker's resolv.conf, not this machine's.
    : >"$work/root/etc/resolv.conf"
    tar --numeric-owner -C "$work/root" -cf "$ROOTFS_TAR.part" .
    mv "$ROOTFS_TAR.part" "$ROOTFS_TAR"
    rm -rf "$work"
    trap - EXIT
    log "rootfs: wrote $ROOTFS_TAR ($(du -h "$ROOTFS_TAR" | cut -f1))"
}

# What the raw base is made from: debootstrap's suite, variant, packages and mirror, and the version of the
# clean-up above (bump ROOTFS_RECIPE_VERSION when build_rootfs_tarball changes what it removes).
readonly ROOTFS_RECIPE_VERSION=1
rootfs_recipe() {
    printf '%s minbase python3,python3-venv,ca-certificates %s v%s' "$SUITE" "$(debian_mirror)" "$ROOTFS_RECIPE_VERSION"
}

# A raw base made from the same recipe is reused as it is: a fresh clone (CI's) on a machine that built it once
# skips debootstrap (about a minute) and the import, and the build below then hits Docker's cache.
raw_base_is_current() {
    local have
    have="$(docker image inspect -f '{{index .Config.Labels "ddp-cifar.rootfs-recipe"}}' "$RAW_TAG" 2>/dev/null || true)"
    [[ "$have" == "$(rootfs_recipe)" ]]
}

# Import the tarball as $RAW_TAG unless an image made from the same tarball is already there.
import_raw_base() {
    local sum have
    sum="$(sha256sum "$ROOTFS_TAR" | cut -d' ' -f1)"
    have="$(docker image inspect -f '{{index .Config.Labels "ddp-cifar.rootfs-sha256"}}' "$RAW_TAG" 2>/dev/null || true)"
    if [[ "$have" == "$sum" ]]; then log "raw base: $RAW_TAG is current"; return; fi
    log "raw base: docker import -> $RAW_TAG"
    docker import \
        --change "LABEL ddp-cifar.rootfs-sha256=$sum" \
        --change "LABEL ddp-cifar.rootfs-recipe=\"$(rootfs_recipe)\"" \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        "$ROOTFS_TAR" "$RAW_TAG" >/dev/null
}

# torch (CPU wheel, from this machine's local package files), its runtime deps, numpy and tensorboard, all cp311.
download_wheels() {
    [[ -x "$PIP" ]] || die "$PIP is missing: run 'make setup' first (or set PIP=)"
    mkdir -p "$WHEEL_DIR" "$CACHE_DIR"
    local arch
    arch="$(uname -m)"  # x86_64 or aarch64: the wheels must match the machine the image runs on
    local wanted=("torch==$TORCH_VERSION" "numpy==$NUMPY_VERSION" "tensorboard==$TENSORBOARD_VERSION")
    log "wheels: pip download ${wanted[*]} (cp$PY_TAG) -> $WHEEL_DIR"
    "$PIP" download --quiet --dest "$WHEEL_DIR" --only-binary=:all: \
        --python-version "3.$((PY_TAG % 100))" --implementation cp --abi "cp$PY_TAG" \
        --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" \
        --platform "manylinux2014_$arch" --platform any \
        "${wanted[@]}" 2>"$CACHE_DIR/pip-download.log" \
        || { cat "$CACHE_DIR/pip-download.log" >&2; die "pip download of ${wanted[*]} failed (log above; is the package index reachable?)"; }
    # The build installs exactly this list, so stale wheels from an older version change nothing.
    (cd "$WHEEL_DIR" && printf '%s\n' "${wanted[@]}" >requirements.txt)
}

build_base() {
    log "image: docker build -> $BASE_TAG"
    DOCKER_BUILDKIT=0 docker build \
        --build-arg "RAW_BASE=$RAW_TAG" \
        -f "$REPO_ROOT/docker/cpu-base/Dockerfile" -t "$BASE_TAG" "$WHEEL_DIR" >&2
    log "image: $BASE_TAG $(docker image inspect -f '{{.Size}}' "$BASE_TAG" | awk '{printf "%.0f MB", $1/1e6}')"
}

main() {
    docker info >/dev/null 2>&1 || die "dockerd is unreachable: start it (e.g. 'dockerd &') and retry"
    if [[ ! -s "$ROOTFS_TAR" ]] && raw_base_is_current; then
        log "raw base: $RAW_TAG is current (made from the same recipe: $(rootfs_recipe))"
    else
        build_rootfs_tarball
        import_raw_base
    fi
    download_wheels
    build_base
}

main "$@"
