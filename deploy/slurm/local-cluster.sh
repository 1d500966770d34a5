#!/usr/bin/env bash
# A one-node Slurm cluster in a directory, for trying the batch script on one machine (and for
# the test that does): munged, slurmctld and slurmd with their state, sockets and logs under
# DIR, on loopback ports of their own; nothing in /etc is touched. Needs root and Debian's
# slurm-wlm (apt-get install slurm-wlm).
#
#   deploy/slurm/local-cluster.sh start DIR [CPUS]   # prints: export SLURM_CONF=DIR/slurm.conf
#   deploy/slurm/local-cluster.sh stop DIR
set -euo pipefail
cmd=${1:?start or stop}
dir=${2:?a directory}
case "$cmd" in
start)
  cpus=${3:-$(nproc)}
  for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install slurm-wlm" >&2; exit 2; }
  done
  [ "$(id -u)" = 0 ] || { echo "a local Slurm cluster needs root (its daemons run as root)" >&2; exit 2; }
  mkdir -p "$dir"/{state,spool,log,munge,run}
  dir=$(cd "$dir" && pwd)
  chmod 700 "$dir/munge"
  chmod 755 "$dir" "$dir/run"
  head -c 1024 /dev/urandom >"$dir/munge/munge.key"
  chmod 400 "$dir/munge/munge.key"
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/run/munge.sock" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
  # Two free ports on loopback for the daemons.
  read -r ctld_port slurmd_port < <(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(*[x.getsockname()[1] for x in s])')
  mem=$(awk '/MemTotal/ {print int($2/1024/2)}' /proc/meminfo)
  cat >"$dir/slurm.conf" <<CONF
ClusterName=lazarus-local
SlurmctldHost=$(hostname -s)(127.0.0.1)
MailProg=/bin/true
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
AuthInfo=socket=$dir/run/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
NodeName=node1 NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=node1 Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF" -N node1
  for _ in $(seq 1 100); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then
      echo "export SLURM_CONF=$SLURM_CONF"
      exit 0
    fi
    sleep 0.2
  done
  echo "the local Slurm cluster did not come up: see $dir/log" >&2
  exit 1
  ;;
stop)
  dir=$(cd "$dir" && pwd)
  for pid in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  ;;
*)
  echo "usage: $0 start|stop DIR [CPUS]" >&2
  exit 2
  ;;
esac
