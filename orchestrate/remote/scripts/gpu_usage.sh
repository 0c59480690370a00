# shellcheck shell=sh
# Run on a host over SSH (`status`, orchestrate/backends/docker_ssh/gpuusage.py): each GPU's index, utilisation
# (%) and memory used and total (MiB), one CSV line per GPU; nothing on a host without nvidia-smi.
command -v nvidia-smi >/dev/null 2>&1 || exit 0
exec nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits
