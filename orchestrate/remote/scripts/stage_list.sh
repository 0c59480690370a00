# shellcheck shell=sh
# Run on a host over SSH (orchestrate/backends/docker_ssh/staging.py). $1: the data dir, $2: the staging folders' prefix, $3: the
# node manifest's name. Every regular file but those, NUL-separated: "<size> <mtime> <path relative to $1>".
cd -- "$1" 2>/dev/null || exit 0
find . -path "./$2*" -prune -o -type f ! -name "$3" -printf '%s %T@ %P\0'
