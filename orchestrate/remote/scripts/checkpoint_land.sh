# shellcheck shell=sh
# Run on a host (orchestrate/backends/docker_ssh/ckptrelay.py, by the relay's fetch). $1: the checkpoint dir, $2: the
# checkpoint's manifest (relative to it). stdin: a tar of the checkpoint's files, its manifest among them. Unpacked
# into a temporary folder beside them, then each file renamed into place, the manifest last: a copy cut short never
# counts (no manifest), and a reader never sees half a file.
set -e
mkdir -p -- "$1"
t=$(mktemp -d -- "$1/.ddp-relay.XXXXXX")
trap 'rm -rf -- "$t"' EXIT
tar -x --no-same-owner -C "$t" -f -
test -f "$t/$2"
cd -- "$t"
# shellcheck disable=SC2016 # the inner sh expands its own $0 (the checkpoint dir) and $f.
find . -type f ! -path "./$2" -exec sh -c 'for f; do mkdir -p -- "$0/$(dirname -- "$f")"; mv -f -- "$f" "$0/$f" || exit 1; done' "$1" {} +
mkdir -p -- "$1/$(dirname -- "$2")"
mv -f -- "$2" "$1/$2"
