#!/bin/sh
# Entrypoint of the ddp-cifar image: export the defaults in nccl.env (next to this script) for every
# variable that is not already set, then exec the command, so that the command - not this shell - receives
# signals. Containers run under Docker's --init (tini as PID 1), which forwards SIGTERM from `docker stop`
# to the command: torchrun, or the trainer itself.
#
# On an NGC base the Dockerfile's ENTRYPOINT replaces NGC's own, /opt/nvidia/nvidia_entrypoint.sh. That one
# sources /opt/nvidia/entrypoint.d/*.sh: the CUDA forward-compatibility setup (compat libcuda on
# LD_LIBRARY_PATH when the host driver is older than the image's CUDA: without it torch sees no GPU), and
# the driver, MOFED and /dev/shm notes. It ends in `exec "$@"`, so chaining to it with exec keeps the
# command the direct child of tini.
set -eu

defaults="$(dirname "$0")/nccl.env"
if [ -r "$defaults" ]; then
    while IFS= read -r line || [ -n "$line" ]; do
        case "$line" in
            '' | '#'*) continue ;;
        esac
        key="${line%%=*}"
        value="${line#*=}"
        case "$key" in
            # Only plain variable names reach the eval below; anything else is a broken defaults file.
            '' | [0-9]* | *[!A-Za-z0-9_]*)
                echo "entrypoint: ignoring malformed line in $defaults: $line" >&2
                continue ;;
        esac
        # A set variable (even set to empty) wins over the default.
        if eval "[ -z \"\${$key+set}\" ]"; then
            export "$key=$value"
        fi
    done <"$defaults"
fi

if [ "$#" -eq 0 ]; then
    echo "entrypoint: no command given" >&2
    exit 2
fi
# A lease (set by a Slurm job, docs/slurm.md "When the batch script's node dies"): the job's guard on this node
# writes a new number into DDP_LEASE_FILE every few seconds while it lives. If no new one comes for DDP_LEASE_S
# seconds (counted from here too: a guard that never came), the guard is gone, and nothing would end this
# container when Slurm ends the job: SIGTERM the command (this shell's PID, which exec keeps), which saves a
# checkpoint and exits. The watcher reads the file's text on its own clock: no stat, no clock shared with the
# guard, and a file left by an earlier job renews nothing.
watch_lease() {
    set +e
    last=$(cat "$DDP_LEASE_FILE" 2>/dev/null)
    renewed=$(date +%s)
    while kill -0 "$1" 2>/dev/null; do
        sleep 1
        now=$(date +%s)
        text=$(cat "$DDP_LEASE_FILE" 2>/dev/null)
        if [ -n "$text" ] && [ "$text" != "$last" ]; then
            last=$text
            renewed=$now
        elif [ $((now - renewed)) -ge "$DDP_LEASE_S" ]; then
            echo "entrypoint: lease $DDP_LEASE_FILE not renewed for $DDP_LEASE_S s (its guard is gone): SIGTERM" >&2
            kill -TERM "$1"
            return
        fi
    done
}
if [ -n "${DDP_LEASE_FILE:-}" ] && [ -n "${DDP_LEASE_S:-}" ]; then
    case "$DDP_LEASE_S" in
        *[!0-9]*)
            echo "entrypoint: DDP_LEASE_S=$DDP_LEASE_S is not a whole number of seconds" >&2
            exit 2 ;;
    esac
    watch_lease "$$" </dev/null >/dev/null &
fi
if [ -x /opt/nvidia/nvidia_entrypoint.sh ]; then
    exec /opt/nvidia/nvidia_entrypoint.sh "$@"
fi
exec "$@"
