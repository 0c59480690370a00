# shellcheck shell=sh
# Run on a host over SSH (orchestrate/remote/ssh.py): write stdin to the file $1, atomically. The bytes go to an
# unpredictable temporary name made by mktemp (O_EXCL: a planted file or symlink is never opened) in the target's
# folder, then are renamed into place (rename replaces a symlink at the target instead of following it).
set -e
t=$(mktemp -- "$(dirname -- "$1")/.ddp-cifar.XXXXXXXXXX")
trap 'rm -f -- "$t"' EXIT
cat > "$t"
chmod 0644 -- "$t"
mv -f -- "$t" "$1"
trap - EXIT
