# shellcheck shell=sh
# Run on a host over SSH (orchestrate/backends/docker_ssh/hostprobe.py, as `sh -c SCRIPT probe ARGS`): every
# shell fact preflight needs, in ONE exec. Arguments: $1 data dir, $2 ckpt dir, $3 master address, $4 master SSH
# port (0: do not try it), $5 list listening ports (1/0), $6 look for GPUs and RDMA (1/0), $7 log dir. Values are
# only ever expanded inside double quotes, and never become code.
# Output: key=value records separated by NUL (so paths with newlines cannot break the parsing).
out() { printf '%s=%s\0' "$1" "$2"; }
out clock "$(date +%s.%N)"
for kind in data ckpt log; do
  case $kind in data) d=$1;; ckpt) d=$2;; log) d=$7;; esac
  while [ ! -e "$d" ] && [ "$d" != / ]; do d=$(dirname -- "$d"); done
  out "${kind}_base" "$d"
  # The first folder of the chain owned by another account (not the login, not root): it could swap files.
  a=$d; me=$(id -u)
  while :; do
    o=$(stat -L -c %u -- "$a" 2>/dev/null)
    if [ -n "$o" ] && [ "$o" != "$me" ] && [ "$o" != 0 ]; then
      out "${kind}_foreign" "$a (owned by $(stat -L -c %U -- "$a"))"; break
    fi
    n=$(dirname -- "$a"); [ "$n" = "$a" ] && break; a=$n
  done
  if [ -d "$d" ]; then out "${kind}_isdir" 1; else out "${kind}_isdir" 0; fi
  if [ -w "$d" ]; then out "${kind}_writable" 1; else out "${kind}_writable" 0; fi
  out "${kind}_free_kb" "$(df -Pk -- "$d" 2>/dev/null | awk 'NR==2 {print $4}')"
done
out held "$(ip -o addr show to "$3" 2>/dev/null | awk '{print $2; exit}')"
out route "$(ip -o route get "$3" 2>/dev/null | head -n 1)"
if [ "$5" = 1 ]; then
  if listening=$(ss -Htln 2>/dev/null); then out ss_ok 1; else out ss_ok 0; fi
  out listening "$(printf '%s\n' "$listening" | awk '{print $4}' | tr '\n' ' ')"
fi
if [ "$4" != 0 ]; then
  # shellcheck disable=SC2016 # $0 and $1 are bash's own arguments, expanded by bash, not here.
  if timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$3" "$4" 2>/dev/null; then out probe 1; else out probe 0; fi
fi
if [ "$6" = 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    if g=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>&1); then out smi ok; else out smi "$g"; fi
    out gpus "$(printf '%s\n' "$g" | grep -c '^[0-9]')"
    out gpu_list "$g"
    out compute_apps "$(nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name --format=csv,noheader 2>/dev/null)"
  else
    out smi missing
  fi
  # InfiniBand/RoCE: the verbs devices, and each RDMA port as "DEVICE/PORT LINK_LAYER STATE".
  devs=
  for f in /dev/infiniband/*; do [ -e "$f" ] && devs="$devs${f##*/} "; done
  out ib_devs "$devs"
  ports=
  for p in /sys/class/infiniband/*/ports/*; do
    [ -r "$p/state" ] || continue
    d=${p#/sys/class/infiniband/}
    ports="$ports${d%%/*}/${p##*/} $(cat "$p/link_layer" 2>/dev/null || echo ?) $(cat "$p/state")
"
  done
  out rdma_ports "$ports"
fi
