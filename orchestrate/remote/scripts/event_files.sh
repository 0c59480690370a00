# shellcheck shell=sh
# Run on a host over SSH (`tensorboard`'s Scheduler.files_named: orchestrate/backends/docker_ssh/hostfiles.py): "<bytes> <path under $1>" of every
# TensorBoard event file (a name starting with $2) under the folder $1, a job's log dir; nothing when there is none.
cd -- "$1" 2>/dev/null || exit 0
find . -type f -name "$2*" -exec stat -c '%s %n' {} + 2>/dev/null
exit 0
