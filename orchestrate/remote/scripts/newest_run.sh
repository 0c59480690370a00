# shellcheck shell=sh
# Run on a host over SSH (orchestrate/backends/docker_ssh/control.py, `logs`): the newest entry of the folder $1 (a job's log
# folder, whose run folders are named by the trainer: no newline in them), or nothing.
# shellcheck disable=SC2012 # ls -t is the portable way to sort by time; the names are the trainer's own.
ls -t -- "$1" 2>/dev/null | head -n 1
