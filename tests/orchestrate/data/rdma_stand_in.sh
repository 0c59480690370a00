# Run "$@" with stand-in RDMA devices: in a private mount namespace (unshare -m --propagation private), so the
# host's /dev and /sys are never changed. Usage: sh rdma_stand_in.sh SCRATCH_DIR COMMAND...
# /sys/class/infiniband gets mlx5_0 (InfiniBand, port 1 ACTIVE) and mlx5_1 (Ethernet = RoCE, port 1 DOWN), in the
# kernel's sysfs formats; /dev/infiniband gets uverbs0, rdma_cm and umad0 (names only: the probe only lists them).
set -e
scratch=$1; shift
: > "$scratch/null"
mount --bind /dev/null "$scratch/null"  # kept for the shell redirections once /dev is replaced
mount -t tmpfs none /sys/class
for dev in mlx5_0 mlx5_1; do mkdir -p "/sys/class/infiniband/$dev/ports/1"; done
echo InfiniBand > /sys/class/infiniband/mlx5_0/ports/1/link_layer
echo "4: ACTIVE" > /sys/class/infiniband/mlx5_0/ports/1/state
echo Ethernet > /sys/class/infiniband/mlx5_1/ports/1/link_layer
echo "1: DOWN" > /sys/class/infiniband/mlx5_1/ports/1/state
mount -t tmpfs none /dev
: > /dev/null
mount --bind "$scratch/null" /dev/null
mkdir /dev/infiniband
: > /dev/infiniband/uverbs0; : > /dev/infiniband/rdma_cm; : > /dev/infiniband/umad0
exec "$@"
