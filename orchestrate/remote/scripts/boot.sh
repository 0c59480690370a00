# shellcheck shell=sh
# Run on a host over SSH (orchestrate/backends/docker_ssh/hostboot.py): what tells this boot of the host and this
# start of its Docker daemon from any other. Line 1: the kernel's boot id (new on every boot). Line 2, only while
# dockerd runs: its pid and start time (clock ticks since boot) from the pid file a stock install keeps.
cat /proc/sys/kernel/random/boot_id
pid=$(cat /var/run/docker.pid 2>/dev/null) || exit 0
# Field 22 of /proc/PID/stat is the start time; the name before it ("(dockerd)") holds no space.
[ -r "/proc/$pid/stat" ] && echo "$pid $(cut -d' ' -f22 "/proc/$pid/stat")"
exit 0
