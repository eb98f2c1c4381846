#!/usr/bin/env bash
# A private single-node Slurm cluster for tests and laptops (runs as root).
#
#   sbatch/private-cluster.sh start DIR   # install packages if missing, start munged + slurmctld + slurmd
#   sbatch/private-cluster.sh stop DIR    # stop the daemons started from DIR
#   sbatch/private-cluster.sh env DIR     # print `export SLURM_CONF=...` for your shell
#
# HPCRL_PRIVATE_PREEMPT=1 adds preemptible capacity: a `scavenger` partition whose jobs an `owner` job
# preempts (PreemptMode=REQUEUE), for tests of preempted rollout jobs (see write_conf).
#
# Everything lives under DIR (config, state, spool, logs, pid files) and the
# daemons use non-default ports (7817/7818, override with HPCRL_SLURMCTLD_PORT /
# HPCRL_SLURMD_PORT), so a system cluster on the same machine is never touched.
# Client commands find this cluster only through SLURM_CONF=DIR/slurm.conf.
set -euo pipefail

cmd="${1:-}"; dir="${2:-}"
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop|env DIR" >&2; exit 2
fi
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
conf="$dir/slurm.conf"
ctld_port="${HPCRL_SLURMCTLD_PORT:-7817}"
preempt="${HPCRL_PRIVATE_PREEMPT:-0}"
slurmd_port="${HPCRL_SLURMD_PORT:-7818}"

# shellcheck source=sbatch/private-common.sh
. "$(dirname "$0")/private-common.sh"

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "$0: must run as root (it starts slurmd and munged)" >&2; exit 1
  fi
}

write_conf() {
  local host; host="$(hostname -s)"
  local debug_share="OverSubscribe=FORCE:4" cpus overrides=""
  cpus="$(nproc)"
  if [ "$preempt" = 1 ]; then
    # Preemption needs cores that are not shared: Slurm 22.05 never places a job of an OverSubscribe=NO partition
    # (the owner) on a node running jobs of a FORCE one, so nothing is preempted for it; every partition is NO.
    # The node then declares at least 8 cores (slurmd takes the declared count with config_overrides): a trainer
    # and a fleet of rollout jobs fit on a 2-core test machine, as they do on the default cluster by sharing cores.
    debug_share="OverSubscribe=NO PriorityTier=10 PreemptMode=OFF"
    if [ "$cpus" -lt 8 ]; then cpus=8; fi
    overrides="SlurmdParameters=config_overrides"
  fi
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  cat > "$conf" <<CONF
# written by hpcrl sbatch/private-cluster.sh: a one-node test cluster
ClusterName=hpcrl-private
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
# keep finished jobs visible to scontrol for 10 minutes (there is no accounting: no sacct)
MinJobAge=600
# requeued jobs may start again as soon as possible
JobRequeue=1
$overrides
NodeName=$host CPUs=$cpus RealMemory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 )) State=UNKNOWN
# OverSubscribe lets trainer + rollout jobs share the few cores of a test machine
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP $debug_share
CONF
  if [ "$preempt" = 1 ]; then
    cat >> "$conf" <<CONF
# HPCRL_PRIVATE_PREEMPT=1: preemption is real. A job of a higher PriorityTier partition that cannot start
# otherwise requeues the jobs of the preemptible one. Seen with Slurm 22.05: the backfill scheduler selects
# them, their steps get SIGTERM at once, and they are requeued (killed) after the partition's GraceTime unless
# they ended by then (then they are merely complete); a requeued job keeps its id and array task id. Cores are
# not shared (one job per declared core), so it is off unless asked for. A job that asks for the whole node's
# memory (sbatch's default) is never started by preemption here: an owner job gives --mem.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# the schedulers run every second, not every 60 and 30 s: a preemption (by the backfill scheduler) takes seconds
SchedulerParameters=sched_interval=1,bf_interval=1
# scavenger capacity (resources.rollout_preemptible.partition=scavenger): any job may use it until the owner
# needs its cores back: an owner job that does not fit beside the running jobs requeues as many scavenger jobs as
# it needs (what a higher-priority user does to preemptible capacity); jobs of debug are never preempted
PartitionName=scavenger Nodes=ALL MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1 PreemptMode=REQUEUE GraceTime=5
PartitionName=owner Nodes=ALL MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=20 PreemptMode=OFF
CONF
  fi
}

wait_idle() {
  for _ in $(seq 1 60); do
    if SLURM_CONF="$conf" sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      return 0
    fi
    sleep 1
  done
  echo "private-cluster: node not idle after 60 s; see $dir/log/" >&2
  SLURM_CONF="$conf" sinfo >&2 || true
  return 1
}

case "$cmd" in
  start)
    need_root
    install_packages
    write_conf
    start_munge
    export SLURM_CONF="$conf"
    for d in slurmctld slurmd; do
      if [ -f "$dir/$d.pid" ] && kill -0 "$(cat "$dir/$d.pid")" 2>/dev/null; then continue; fi
      "$d" -f "$conf"
      # a daemon that cannot bind its port (another cluster on it) exits at once: say so
      for _ in $(seq 1 20); do
        [ -f "$dir/$d.pid" ] && kill -0 "$(cat "$dir/$d.pid")" 2>/dev/null && break
        sleep 0.5
      done
      if ! { [ -f "$dir/$d.pid" ] && kill -0 "$(cat "$dir/$d.pid")" 2>/dev/null; }; then
        echo "private-cluster: $d did not start (port $ctld_port/$slurmd_port taken by another cluster?);" \
             "see $dir/log/$d.log" >&2
        tail -5 "$dir/log/$d.log" >&2 || true
        exit 1
      fi
    done
    wait_idle
    echo "private-cluster: up; export SLURM_CONF=$conf" >&2
    ;;
  stop)
    for d in slurmd slurmctld; do
      if [ -f "$dir/$d.pid" ]; then
        pid="$(cat "$dir/$d.pid")"
        kill "$pid" 2>/dev/null || true
        # wait for it to go, so the next start finds its port free; force it after 10 s
        for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$dir/$d.pid"
      fi
    done
    ;;
  env)
    echo "export SLURM_CONF=$conf"
    ;;
  *)
    echo "usage: $0 start|stop|env DIR" >&2; exit 2 ;;
esac
