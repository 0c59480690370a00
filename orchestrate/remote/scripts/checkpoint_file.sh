# shellcheck shell=sh
# Run on a host over SSH (orchestrate/backends/docker_ssh/checkpoints.py): $1 is a regular file (-f, and not a
# planted symlink: -L); print its size, then its sha256 line.
test -f "$1" && ! test -L "$1" && stat -c %s -- "$1" && sha256sum -- "$1"
