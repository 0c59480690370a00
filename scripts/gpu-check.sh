#!/usr/bin/env bash
# The GPU check in one command, for a GPU machine whose python3 has torch with CUDA, and no Docker and no network
# (the machines this project can borrow, 15 minutes at a time):
#
#     scripts/gpu-check.sh [REPORT]          # default REPORT: out/gpu-check-<UTC time>.txt
#
# 1. Refuses in one line, exit 2, where torch sees no GPU, saying why (trainer/gpuprobe.py, why_no_cuda: a CPU
#    build, no driver, a torch built for a newer CUDA major than the driver's).
# 2. Installs nothing from the network. What the GPU tier needs beyond that python3 (pytest, pytest-xdist,
#    pytest-timeout, docker's SDK: tests/conftest.py imports them) comes as wheels in $GPU_CHECK_WHEELS
#    (default shared/wheels; make them where there is a network: pip download -d shared/wheels pytest
#    pytest-xdist pytest-timeout docker), installed into a venv beside the machine's own torch
#    (--system-site-packages, --no-index) only when python3 lacks them.
# 3. Runs the GPU tier (tests/trainer/gpu, what `make test-gpu` runs; its benchmark test is left to step 4) and
#    bench/gpu_throughput.py (eager and --compile inductor), each under a time limit, so the whole fits in
#    8 minutes.
# 4. Writes one report: the GPU, driver, torch, CUDA, cuDNN and NCCL versions, the tier's results and every
#    figure of the benchmark. Exit 0 when both passed, 1 otherwise.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-$REPO/shared/wheels}"
REPORT="${1:-$REPO/out/gpu-check-$(date -u +%Y%m%dT%H%M%SZ).txt}"
TIER_S=270   # the GPU tier: ~20 runs of the trainer on one GPU
BENCH_S=180  # eager and compiled: step loops, 5-epoch runs, inductor's compilation
NEEDED=(pytest xdist pytest_timeout docker numpy)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

die() { printf 'gpu-check: %s\n' "$*" >&2; exit 2; }

command -v "$PY" >/dev/null || die "no $PY on PATH (set PYTHON to the python with torch)"
why="$("$PY" - <<'PYEOF' 2>/dev/null
import torch
from trainer import gpuprobe
if not torch.cuda.is_available():
    print(gpuprobe.why_no_cuda(gpuprobe.probe()))
PYEOF
)" || die "$PY cannot import torch and the project's trainer package (is torch installed for $PY?)"
[[ -z "$why" ]] || die "no GPU to check: $why"

missing=()
for module in "${NEEDED[@]}"; do
    "$PY" -c "import $module" 2>/dev/null || missing+=("$module")
done
if ((${#missing[@]})); then
    compgen -G "$WHEELS/*.whl" >/dev/null || die "$PY lacks ${missing[*]} and there are no wheels in $WHEELS: on a \
machine with a network, pip download -d $WHEELS pytest pytest-xdist pytest-timeout docker, then copy them here"
    venv="$REPO/.gpu-check-venv"
    "$PY" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install --quiet --no-index --find-links "$WHEELS" pytest pytest-xdist pytest-timeout \
        docker numpy || die "the wheels in $WHEELS do not install (pip's error above): they must match $PY"
    PY="$venv/bin/python"
fi

mkdir -p "$(dirname "$REPORT")"
{
    echo "# gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
        | sed 's/^/gpu (nvidia-smi): /' || echo "gpu (nvidia-smi): not available"
    "$PY" -c 'import torch; v = torch.cuda.nccl.version(); print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {\".\".join(map(str, v))}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")'
} > "$REPORT"

section() { printf '\n## %s\n' "$1" >> "$REPORT"; }
tier_rc=0
section "GPU tier (pytest -m gpu tests/trainer/gpu, at most ${TIER_S} s)"
(cd "$REPO" && timeout "$TIER_S" "$PY" -m pytest -m gpu -p no:cacheprovider -q -rA --durations=20 tests/trainer/gpu \
    --deselect tests/trainer/gpu/test_gpu_tier.py::test_the_gpu_benchmark_meets_its_goals) >> "$REPORT" 2>&1 || tier_rc=$?
bench_rc=0
section "bench/gpu_throughput.py, eager and --compile inductor (at most ${BENCH_S} s)"
(cd "$REPO" && timeout "$BENCH_S" "$PY" bench/gpu_throughput.py) 2>&1 | grep -v " INFO " >> "$REPORT" || bench_rc=${PIPESTATUS[0]}
section "result"
echo "tier exit $tier_rc, benchmark exit $bench_rc (124: stopped at its time limit)" >> "$REPORT"
echo "gpu-check: tier exit $tier_rc, benchmark exit $bench_rc; report: $REPORT"
[[ $tier_rc -eq 0 && $bench_rc -eq 0 ]]
