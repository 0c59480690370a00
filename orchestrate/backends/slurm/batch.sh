#!/bin/bash
# The batch script of `python -m orchestrate submit` (docs/slurm.md), given to sbatch as it is.
# Slurm runs it on the allocation's first node. It runs `up --hosts slurm` there: the allocation's nodes, node 0
# first, each with the GPUs Slurm granted on it. It passes Slurm's SIGTERM on: at `scancel`, and ahead of the
# time limit (sbatch --signal=B:TERM@SECONDS), it stops the job on every node before Slurm's KillWait runs out
# (each rank saves a checkpoint at SIGTERM), so `submit --resume` continues it.
# If this script dies without its stop (its node lost, its processes killed), the guard started on every node
# (guard.sh, a job step of its own) ends what runs there when Slurm ends the job; sbatch --no-requeue makes that
# job FAILED or NODE_FAIL, and `submit --resume` continues it from its last checkpoint. A guard Slurm SIGKILLs
# without its SIGTERM cannot: so each container holds a lease that its node's guard renews while it lives, and
# stops itself (SIGTERM to its command: a checkpoint) once the lease lapses (LEASE seconds; docker/entrypoint.sh).
# Arguments: PYTHON JOB GRACE LEASE GUARD N, N options of up's that `kill` takes too (--ssh-config FILE,
# --accept-new-host-keys: the stop reaches the nodes as `up` did), then up's options and `-- trainer options`. GUARD
# is guard.sh's text, not its path: it travels with the job as this script does, so no node needs to see the
# submitting machine's files. A secret of up's --env comes as `--env NAME`, its value in this script's environment
# (sbatch's, never a command line).
set -u
python=$1
job=$2
grace=$3
lease=$4
guard=$5
connect=("${@:7:$6}")
shift $((6 + $6))

stop() {
    trap '' TERM
    echo "slurm job ${SLURM_JOB_ID:-?}: SIGTERM; stopping job $job on every node (grace ${grace} s)"
    # `up` first (Slurm signals it too at scancel, but not at --signal=B:), so that it starts nothing more; then
    # the containers, found by their labels, wherever `up` had got to.
    kill -TERM "$up" 2>/dev/null
    wait "$up"
    "$python" -m orchestrate kill --hosts slurm --job "$job" --grace "$grace" "${connect[@]}"
    exit 143
}

# One guard a node. --overlap: it holds nothing another step could need.
srun --overlap --ntasks-per-node=1 bash -c "$guard" guard.sh "$job" "$grace" &
# `up` only once the guards' step runs: a batch script that died before would leave its containers to nobody
# (seen: its step still being created when the script was killed). Bounded: without guards the job still runs.
for _ in $(seq 60); do
    squeue -h -s -j "${SLURM_JOB_ID:-0}" -o %i 2>/dev/null | grep -qx "${SLURM_JOB_ID:-0}\.0" && break
    sleep 1
done
echo "slurm job ${SLURM_JOB_ID:-?}: up --hosts slurm --job $job on $(hostname)"
# The lease file is in the container's own /tmp: the guard writes it there (docker exec), so it names no path of
# the node and no earlier job's file is ever read. Up's options come after: their --env wins.
"$python" -m orchestrate up --hosts slurm --job "$job" --env "ORCHESTRATE_SLURM_JOB=${SLURM_JOB_ID:-}" \
    --env DDP_LEASE_FILE=/tmp/ddp-cifar.lease --env "DDP_LEASE_S=$lease" "$@" &
up=$!
trap stop TERM
wait "$up"
