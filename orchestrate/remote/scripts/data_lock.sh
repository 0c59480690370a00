# shellcheck shell=sh
# Run on a node over SSH: hold the lock of a data folder while the orchestrator fills it.
# $1: the data folder (it exists), $2: seconds to wait for another holder.
# Prints BUSY when another `up` holds the lock (then waits up to $2 s; exit 7 when it stays held), then
# "LOCKED WRITE" (the folder is the login's to fill) or "LOCKED READ <owner>" (it is not: only a verified copy
# already there can be used), and holds the lock until its standard input ends: the SSH channel closing, which
# also happens when the orchestrator is killed, releases it.
# The lock file is made 0666 by whoever creates it: another login that may not write the folder can still open
# it and wait for the copy being made (flock needs an fd open for writing on NFS).
lock="$1/.ddp-cifar.lock"
if [ -w "$lock" ] || { [ ! -e "$lock" ] && [ -w "$1" ]; }; then
  exec 9>>"$lock"
  chmod 0666 -- "$lock" 2>/dev/null
  if ! flock -n -x 9; then
    echo BUSY
    flock -w "$2" -x 9 || exit 7
  fi
fi
if [ -w "$1" ]; then
  echo "LOCKED WRITE"
else
  echo "LOCKED READ $(stat -c '%U (uid %u)' -- "$1")"
fi
cat >/dev/null
