# shellcheck shell=sh
# Run on a host over SSH (orchestrate/backends/docker_ssh/staging.py). $1: the data dir, then paths relative to it: their sha256,
# NUL-separated "<digest>  <path>" records.
cd -- "$1" && shift && sha256sum -z -- "$@"
