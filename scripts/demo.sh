#!/usr/bin/env bash
# The end-to-end demo on one Linux box (root, no GPU): two simulated nodes (network and mount namespaces,
# each with its own sshd with stock settings, its own dockerd, its own home and temp folders; login as the
# non-root user ddp in the docker group), the CPU image sent to them over SSH, synthetic data in CIFAR-10's exact archive
# format sent and verified on each node, and a short 2-node DDP training (gloo) that prints its accuracy.
# Then it resumes the job with `up --resume`, draws its curves (demo-metrics.png here), stops it with `kill`, and
# removes the simulated nodes.
# Run via `make demo` (which builds the venv and the CPU image first). KEEP=1 keeps the nodes afterwards.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
NAME="${DEMO_NAME:-demo}"
JOB="${DEMO_JOB:-demo}"
WORK="$(mktemp -d /tmp/ddp-demo.XXXXXX)"
STATE="/var/lib/devcluster/$NAME"

say() { printf '\n\033[1m=== %s\033[0m\n' "$*"; }
cleanup() {
    if [[ "${KEEP:-0}" == 1 ]]; then
        echo "kept: nodes of cluster '$NAME' (remove with: $PY -m devcluster down --name $NAME)"
    else
        $PY -m devcluster down --name "$NAME" >/dev/null 2>&1 || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

say "1/6 two simulated nodes (own address, sshd, dockerd, home and temp folders each)"
$PY -m devcluster down --name "$NAME" >/dev/null 2>&1 || true
$PY -m devcluster up --hosts 2 --name "$NAME"
# Each node has its own folders, as real machines do: the hosts file needs no per-host dirs.
cp "$STATE/hosts.txt" "$WORK/hosts.txt"
cat "$WORK/hosts.txt"

say "2/6 synthetic data in the official archive format (labels learnable from the pixels)"
$PY -m trainer.data synth --out "$WORK/synth" --train 4000 --test 1000 --archive "$WORK/cifar-10-python.tar.gz"
MD5="$(md5sum "$WORK/cifar-10-python.tar.gz" | cut -d' ' -f1)"

ORCH=("$PY" -m orchestrate)
UP=("${ORCH[@]}" up --hosts "$WORK/hosts.txt" --ssh-config "$STATE/ssh_config" --job "$JOB" --gpus 0
    --image ddp-cifar:cpu --data-from "$WORK/cifar-10-python.tar.gz" --data-md5 "$MD5")
TRAIN=(--model resnet20 --batch-size 64 --lr 0.05 --allow-unverified-data)

say "3/6 train 2 epochs on 2 nodes: preflight, image and data moved, containers started and watched"
"${UP[@]}" -- --epochs 2 "${TRAIN[@]}"

say "4/6 status, then continue the same job to 4 epochs with up --resume"
"${ORCH[@]}" status --job "$JOB"
"${UP[@]}" --resume --max-restarts 1 -- --epochs 4 "${TRAIN[@]}"

say "5/6 the curves: metrics.jsonl from node 0, drawn here"
"${ORCH[@]}" plot --job "$JOB" --out "${DEMO_PNG:-demo-metrics.png}"

say "6/6 kill removes every container of the job (idempotent)"
"${ORCH[@]}" kill --job "$JOB"
echo "demo finished"
