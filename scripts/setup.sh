#!/usr/bin/env bash
# Make this machine ready to build, test and demo the project, from nothing but Python and apt (run as root):
# installs the missing tools (docker.io, openssh-server, iproute2, iptables, debootstrap, docker-compose, tini,
# make, python3-venv, docker-registry for the --pull test, shellcheck for make lint, Slurm and munge for the test
# hosts' Slurm), starts dockerd if none answers, and creates .venv with the project and its dev deps.
# Idempotent: a second run changes nothing and takes a second or two. Used by README's commands and .ci/run.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG_DIR="$REPO/out"
DOCKERD_WAIT_S=60
# Binaries the project and its tests run, and the Debian package that brings each one.
declare -A PACKAGE_OF=(
    [docker]=docker.io [dockerd]=docker.io [sshd]=openssh-server [ip]=iproute2 [iptables]=iptables
    [debootstrap]=debootstrap [docker-compose]=docker-compose [tini]=tini [make]=make [nsenter]=util-linux
    [docker-registry]=docker-registry [shellcheck]=shellcheck
    [slurmctld]=slurm-wlm [slurmd]=slurm-wlm [sbatch]=slurm-wlm [munged]=munge
)

say() { printf '=== [setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf 'setup: FAILED: %s\n' "$*" >&2; exit 1; }

# sbin may be missing from a non-login root PATH, and sshd, iptables and debootstrap live there.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

check_root() {
    [[ "$(id -u)" -eq 0 ]] || die "run as root: the test hosts need network namespaces, sshd and dockerd"
    command -v apt-get >/dev/null || die "apt-get not found: this script supports Debian and Ubuntu"
    command -v python3 >/dev/null || die "python3 not found"
}

install_missing() {
    local missing=() bin
    for bin in "${!PACKAGE_OF[@]}"; do
        command -v "$bin" >/dev/null || missing+=("${PACKAGE_OF[$bin]}")
    done
    # Not binaries: venv support for python3, the Debian archive key for debootstrap on Ubuntu,
    # CA certificates for pip.
    python3 -m venv --help >/dev/null 2>&1 && python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
    [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] || missing+=(debian-archive-keyring)
    [[ -f /etc/ssl/certs/ca-certificates.crt ]] || missing+=(ca-certificates)
    if [[ ${#missing[@]} -eq 0 ]]; then
        echo "all tools present"
        return
    fi
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    echo "installing: ${missing[*]}"
    apt-get update -q || die "apt-get update failed"
    apt-get install -y -q --no-install-recommends "${missing[@]}" || die "apt-get install ${missing[*]} failed"
    python3 -c 'import ensurepip' 2>/dev/null || die "python3 cannot make a venv even after installing python3-venv"
    for bin in "${!PACKAGE_OF[@]}"; do
        command -v "$bin" >/dev/null || die "$bin still missing after apt-get install ${PACKAGE_OF[$bin]}"
    done
}

start_dockerd() {
    if docker info >/dev/null 2>&1; then
        echo "dockerd already answers: $(docker version --format '{{.Server.Version}}')"
        return
    fi
    mkdir -p "$LOG_DIR"
    local log="$LOG_DIR/dockerd.log" waited=0
    echo "starting dockerd (log: $log)"
    # setsid: the daemon outlives this script and gets no signal meant for it.
    setsid dockerd >"$log" 2>&1 </dev/null &
    local pid=$!
    until docker info >/dev/null 2>&1; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 30 "$log" >&2 || true
            die "dockerd exited during start (log above: $log)"
        fi
        if [[ $waited -ge $DOCKERD_WAIT_S ]]; then
            tail -n 30 "$log" >&2 || true
            die "dockerd did not answer within ${DOCKERD_WAIT_S}s (log above: $log)"
        fi
        sleep 1
        waited=$((waited + 1))
    done
    echo "dockerd up after ${waited}s: $(docker version --format '{{.Server.Version}}')"
}

main() {
    cd "$REPO"
    say "check"; check_root
    say "install"; install_missing
    say "dockerd"; start_dockerd
    say "venv"; make setup
    say "ready"
}

main "$@"
