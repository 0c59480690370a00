# shellcheck shell=sh
# Run on a host over SSH (orchestrate/backends/docker_ssh/checkpoints.py). $1: a checkpoint folder, then the files
# its manifest lists: each one's type and size (stat does not follow a planted symlink), then each one's sha256.
cd -- "$1" && shift && stat -c "%F %s %n" -- "$@" && sha256sum -- "$@"
