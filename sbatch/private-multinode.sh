#!/usr/bin/env bash
# A private multi-node Slurm cluster on one machine, for tests (runs as root): N "nodes", each a slurmd in
# its own network namespace with its own host name, address and /etc/hosts, and one slurmctld here.
#
#   sbatch/private-multinode.sh start DIR [N]   # N nodes (default 3): hpcrl-n1 .. hpcrl-nN; installs the packages
#                                               # if missing (private-common.sh)
#   sbatch/private-multinode.sh stop DIR        # stop the daemons, remove the namespaces and the bridge
#   sbatch/private-multinode.sh env DIR         # print `export SLURM_CONF=...` for your shell
#
# Network: a bridge hpcrlbr0 (10.232.0.1/24) here; node i is namespace hpcrl-n<i>, its eth0 at 10.232.0.<10+i>
# on a veth into the bridge, default route via the bridge. Each slurmd runs in `unshare --uts --mount` inside
# its namespace: `hostname` says hpcrl-n<i>, and DIR/hosts-hpcrl-n<i> (the other nodes' names and addresses, and
# a Debian-style 127.0.1.1 line for the node's own name) is bind-mounted on /etc/hosts (with a resolv.conf naming
# no reachable server),
# so a job's processes live in their node's namespace and resolve the other nodes as on a real cluster. The
# filesystem (the run directory, /dev/shm) is shared, as a cluster's shared filesystem is. slurmctld listens on 10.232.0.1; ports 7827/7828 (not the
# single-node cluster's), override with HPCRL_MN_SLURMCTLD_PORT / HPCRL_MN_SLURMD_PORT.
set -euo pipefail

cmd="${1:-}"; dir="${2:-}"; n="${3:-3}"
if [ -z "$cmd" ] || [ -z "$dir" ]; then echo "usage: $0 start|stop|env DIR [N]" >&2; exit 2; fi
mkdir -p "$dir"; dir="$(cd "$dir" && pwd)"
conf="$dir/slurm.conf"
ctld_port="${HPCRL_MN_SLURMCTLD_PORT:-7827}"; slurmd_port="${HPCRL_MN_SLURMD_PORT:-7828}"
BR=hpcrlbr0; NET=10.232.0

node_ip() { echo "$NET.$((10 + $1))"; }

# shellcheck source=sbatch/private-common.sh
. "$(dirname "$0")/private-common.sh"

need_root() { [ "$(id -u)" -eq 0 ] || { echo "$0: must run as root (namespaces, slurmd, munged)" >&2; exit 1; }; }

network_up() {
  ip link add "$BR" type bridge
  ip addr add "$NET.1/24" dev "$BR"
  ip link set "$BR" up
  for i in $(seq 1 "$n"); do
    ip netns add "hpcrl-n$i"
    ip link add "hpcrlv$i" type veth peer name eth0 netns "hpcrl-n$i"
    ip link set "hpcrlv$i" master "$BR" up
    ip -n "hpcrl-n$i" addr add "$(node_ip "$i")/24" dev eth0
    ip -n "hpcrl-n$i" link set eth0 up
    ip -n "hpcrl-n$i" link set lo up
    ip -n "hpcrl-n$i" route add default via "$NET.1"
  done
}

network_down() {
  for v in $(ip -o link show 2>/dev/null | awk -F': ' '$2 ~ /^hpcrlv[0-9]+@/ {sub(/@.*/, "", $2); print $2}'); do
    ip link del "$v" 2>/dev/null || true
  done
  for ns in $(ip netns list 2>/dev/null | awk '/^hpcrl-n[0-9]+/ {print $1}'); do ip netns del "$ns" || true; done
  ip link del "$BR" 2>/dev/null || true
}

write_files() {
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  # each node's /etc/hosts as Debian writes it: its own name on 127.0.1.1 first (the classic multi-node trap:
  # a process that advertises its host name's address offers the loopback), then the other nodes' addresses
  for i in $(seq 1 "$n"); do
    { echo "127.0.0.1 localhost"; echo "127.0.1.1 hpcrl-n$i"; echo "$NET.1 $(hostname -s)"
      for j in $(seq 1 "$n"); do [ "$j" = "$i" ] || echo "$(node_ip "$j") hpcrl-n$j"; done; } > "$dir/hosts-hpcrl-n$i"
  done
  # no DNS server is reachable from the namespaces: without this a reverse lookup (torch's TCPStore does one
  # per client) waits for the resolver's timeout (seen: 10 s per connection); 127.0.0.1:53 is refused at once
  echo "nameserver 127.0.0.1" > "$dir/resolv.conf"
  local mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / n ))
  cat > "$conf" <<CONF
# written by hpcrl sbatch/private-multinode.sh: $n namespaced nodes on one machine
ClusterName=hpcrl-multinode
SlurmctldHost=$(hostname -s)($NET.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
# %n: one spool, pid file and log per node (all slurmds share this machine's filesystem)
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
MinJobAge=600
JobRequeue=1
CONF
  for i in $(seq 1 "$n"); do
    echo "NodeName=hpcrl-n$i NodeAddr=$(node_ip "$i") NodeHostname=hpcrl-n$i CPUs=$(nproc) RealMemory=$mem State=UNKNOWN" >> "$conf"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >> "$conf"
}

wait_pid() {  # wait_pid FILE WHAT: the daemon wrote its pid file and runs, else say where its log is
  for _ in $(seq 1 40); do
    [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null && return 0
    sleep 0.5
  done
  echo "private-multinode: $2 did not start; see $dir/log/" >&2; return 1
}

start_nodes() {
  for i in $(seq 1 "$n"); do
    mkdir -p "$dir/spool/hpcrl-n$i"
    # own host name (uts) and own /etc/hosts (mount) inside the node's network namespace; nsenter, not
    # `ip netns exec`, which remounts /sys and so hides /sys/fs/cgroup from slurmd
    nsenter --net="/run/netns/hpcrl-n$i" unshare --uts --mount --propagation private sh -c \
      "hostname hpcrl-n$i && mount --bind '$dir/hosts-hpcrl-n$i' /etc/hosts && mount --bind '$dir/resolv.conf' /etc/resolv.conf \
       && exec slurmd -f '$conf' -N hpcrl-n$i"
    wait_pid "$dir/slurmd-hpcrl-n$i.pid" "slurmd of hpcrl-n$i"
  done
}

wait_idle() {
  for _ in $(seq 1 90); do
    if [ "$(SLURM_CONF="$conf" sinfo -h -o '%T %D' 2>/dev/null | awk '$1 ~ /^(idle|mixed|allocated)$/ {s += $2} END {print s+0}')" \
         -ge "$n" ]; then return 0; fi
    sleep 1
  done
  echo "private-multinode: not all $n nodes idle after 90 s; see $dir/log/" >&2
  SLURM_CONF="$conf" sinfo >&2 || true; return 1
}

stop_all() {
  for f in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
    [ -f "$f" ] || continue
    pid="$(cat "$f")"; kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true; rm -f "$f"
  done
  network_down
}

case "$cmd" in
  start)
    need_root
    install_packages ip unshare nsenter
    stop_all   # leftovers of an earlier start from DIR
    network_up
    write_files
    start_munge
    export SLURM_CONF="$conf"
    slurmctld -f "$conf"
    wait_pid "$dir/slurmctld.pid" slurmctld
    start_nodes
    wait_idle
    echo "private-multinode: $n nodes up (hpcrl-n1..hpcrl-n$n); export SLURM_CONF=$conf" >&2
    ;;
  stop) stop_all ;;
  env) echo "export SLURM_CONF=$conf" ;;
  *) echo "usage: $0 start|stop|env DIR [N]" >&2; exit 2 ;;
esac
