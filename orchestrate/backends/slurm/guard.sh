#!/bin/bash
# The per-node guard of a submitted job (docs/slurm.md, "When the batch script's node dies"). batch.sh starts one
# on every node of the allocation as a job step (srun), so it lives outside the batch script's process tree.
# dockerd's containers are outside the job (its cgroup, its processes), so Slurm cannot end them; when Slurm ends
# the job for any reason (the batch script killed, its node lost, scancel, the time limit), it sends every step
# SIGTERM, and this guard makes sure nothing of the job runs on its node before Slurm's KillWait runs out.
# While the batch script lives, its own stop (kill --grace) gives the containers their SIGTERM and checkpoint:
# the guard waits that long first (the grace, and the 5 s that stop takes to start and reach the nodes:
# STOP_OVERHEAD_S in script.py, which keeps both within KillWait) rather than signal them a second time, then
# SIGKILLs what is left.
# Slurm may also SIGKILL the guard with no SIGTERM first (seen when the first node's processes, srun's included, all
# died at once): so while it lives it renews each container's lease every RENEW_S seconds, and a container whose
# lease lapses stops itself (docker/entrypoint.sh; script.py's LEASE_S says how long).
# Arguments: JOB GRACE.
set -u
# Its output goes through srun on the first node; if that node died, writing would raise SIGPIPE: ignored, so the
# guard still does its work (and the line is lost with the node).
trap '' PIPE
job=$1
grace=$2
# A lease lasts script.py's LEASE_S (the containers' DDP_LEASE_S): many renewals, so a slow `docker` does not end it.
RENEW_S=5

# The job's running containers here that this Slurm job started: batch.sh gives `up` --env
# ORCHESTRATE_SLURM_JOB=<its id>, so neither another Slurm job of the same name nor another person's is touched.
running() {
    local id
    for id in $(docker ps -q --filter "label=ddp-cifar.job=$job"); do
        if docker inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$id" 2>/dev/null |
                grep -qx "ORCHESTRATE_SLURM_JOB=${SLURM_JOB_ID:-?}"; then
            echo "$id"
        fi
    done
}

# A new number in each container's lease file (DDP_LEASE_FILE, inside the container: written there with `docker
# exec`, so no path of this node is involved). A container ending meanwhile is no error.
renewals=0
renew() {
    local id
    renewals=$((renewals + 1))
    for id in "$@"; do
        docker exec "$id" sh -c 'echo "$1" >"$DDP_LEASE_FILE"' lease "$renewals" >/dev/null 2>&1
    done
}

stop() {
    trap '' TERM
    local deadline=$((SECONDS + grace + 5)) left
    # Renewing still: the guard lives, so the leases hold, and a container gets no SIGTERM but the stop's.
    while left=$(running) && [ -n "$left" ] && [ "$SECONDS" -lt "$deadline" ]; do
        # shellcheck disable=SC2086  # container ids: no spaces
        renew $left
        sleep 1
    done
    left=$(running)
    if [ -n "$left" ]; then
        echo "$left" | xargs docker kill >/dev/null
        echo "slurm job ${SLURM_JOB_ID:-?} ended; $(hostname): killed job $job's containers still running" \
             "(no stop came within $((grace + 5)) s): $(echo "$left" | wc -l)"
    fi
    exit 0
}

trap stop TERM
while :; do
    # shellcheck disable=SC2046  # container ids: no spaces
    renew $(running)
    # In the background: the trap runs at once on SIGTERM, not after the sleep.
    sleep "$RENEW_S" &
    wait $!
done
