# shellcheck shell=sh
# Run on a host over SSH (orchestrate/backends/docker_ssh/staging.py). $1: the data dir, $2: the staging folders' prefix. stdin: a
# tar of the changed files. Unpacked into a staging folder beside them, then each file renamed into place.
set -e
t=$(mktemp -d -- "$1/$2XXXXXX")
trap 'rm -rf -- "$t"' EXIT
tar -x -C "$t" -f -
cd -- "$t"
# shellcheck disable=SC2016 # the inner sh expands its own $0 (the data dir) and $f.
# Each failed mkdir or mv fails the batch (and so the script): a loop's status is its last command's only.
find . -type f -exec sh -c 'for f; do mkdir -p -- "$0/$(dirname -- "$f")" && mv -f -- "$f" "$0/$f" || exit 1; done' "$1" {} +
