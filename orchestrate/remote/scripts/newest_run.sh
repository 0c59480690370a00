# shellcheck shell=sh
# Run on a host over SSH (orchestrate/backends/docker_ssh/control.py, `logs --rank`): the name of the newest run
# folder of the job's log folder $1 (torchrun's or trainer.launch's <run id>_<random>/attempt_<n>/; the trainer's
# own files beside them, stack-rank<R>.txt and tensorboard/, are newer and are not runs), or nothing.
# shellcheck disable=SC2012 # ls -t is the portable way to sort by time; the names are the launcher's own.
newest=$(ls -td -- "$1"/*/attempt_* 2>/dev/null | head -n 1)
[ -n "$newest" ] || exit 0
run=${newest%/attempt_*}
printf '%s\n' "${run##*/}"
