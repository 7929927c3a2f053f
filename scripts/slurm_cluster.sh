#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, real daemons (Debian's slurm-wlm 22.05 and munge), for trying
# run_post_train_slurm.sh the way a cluster runs it: sbatch, the early-warning signal, requeue.
#   bash scripts/slurm_cluster.sh start DIR   # installs the packages when missing (apt, as root), writes
#                                             # DIR/slurm.conf, starts munged (when none runs), slurmctld and slurmd
#   export SLURM_CONF=DIR/slurm.conf          # then sbatch, squeue, scontrol, scancel talk to it
#   bash scripts/slurm_cluster.sh stop DIR    # stops what start started
# The cluster: this host as its one node with every CPU (CPUs=$(nproc)), one partition, cons_tres, linuxproc process
# tracking, no accounting, jobs run as the submitting user, its state, logs and spool under DIR and its ports picked
# free, so it touches no /etc/slurm of the host. A requeued job starts again within seconds (AuthInfo cred_expire=5 and a scheduler pass every second;
# by default SLURM holds a requeued job until the previous credential expires and the next backfill pass, 30 s).
set -euo pipefail
usage() { echo "usage: bash scripts/slurm_cluster.sh start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
mkdir -p "$2"
dir=$(cd "$2" && pwd)

stop() {
  if [ -f "$dir/slurmctld.pid" ]; then  # cancel what still runs, so that no job outlives its cluster
    export SLURM_CONF=$dir/slurm.conf
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 300); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
    fi
  fi
  for name in slurmd slurmctld munged; do
    if [ -f "$dir/$name.pid" ]; then
      pid=$(cat "$dir/$name.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/$name.pid"
    fi
  done
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

start() {
  if [ "$(id -u)" != 0 ]; then
    echo "error: scripts/slurm_cluster.sh starts slurmd, which runs jobs as their users: run it as root" >&2
    exit 1
  fi
  if ! command -v slurmctld >/dev/null || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    echo "installing slurmd slurmctld slurm-client munge (apt)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q slurmd slurmctld slurm-client munge >/dev/null
  fi
  host=$(hostname -s)
  mkdir -p "$dir/state" "$dir/spool"
  cat > "$dir/slurm.conf" <<EOF
ClusterName=sage-test
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
AuthInfo=cred_expire=5
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if ! munge -n >/dev/null 2>&1; then  # no munged answers: start one (as the munge user, its /run/munge)
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$dir/munged.pid"
    for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF" -N "$host"
  for _ in $(seq 300); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then
      echo "SLURM_CONF=$SLURM_CONF"
      return
    fi
    sleep 0.1
  done
  echo "error: the SLURM node did not become idle in 30 s; see $dir/slurmctld.log and $dir/slurmd.log" >&2
  stop
  exit 1
}

case "$action" in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
