#!/bin/sh
# Entrypoint of the ddp-cifar image: export the defaults in nccl.env (next to this script) for every
# variable that is not already set, then exec the command, so that the command - not this shell - receives
# signals. Containers run under Docker's --init (tini as PID 1), which forwards SIGTERM from `docker stop`
# to the command: torchrun, or the trainer itself.
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
exec "$@"
