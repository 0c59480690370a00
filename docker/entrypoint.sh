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
if [ -x /opt/nvidia/nvidia_entrypoint.sh ]; then
    exec /opt/nvidia/nvidia_entrypoint.sh "$@"
fi
exec "$@"
