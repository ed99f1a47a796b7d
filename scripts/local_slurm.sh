#!/usr/bin/env bash
# Starts a single-node SLURM on this machine (munge, slurmctld, slurmd), as root: what the
# SLURM tests (tests/test_clusters.py) run on, and a way to try `srun`/`sbatch` by hand.
# Installs Debian's slurmctld, slurmd, slurm-client, munge and openmpi-bin when missing.
# Idempotent: a running cluster is left as it is. `scripts/local_slurm.sh stop` stops it.
set -euo pipefail
STATE=${PAISOAR_SLURM_STATE:-/var/tmp/paisoar-slurm}
if [ "${1:-}" = stop ]; then
  pkill -x slurmd || true
  pkill -x slurmctld || true
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "local_slurm.sh: needs root (it starts daemons and writes /etc/slurm)" >&2
  exit 2
fi
if ! command -v slurmctld > /dev/null || ! command -v mpirun > /dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq > /dev/null
  apt-get install -y -qq slurmctld slurmd slurm-client munge openmpi-bin > /dev/null
fi
if sinfo -h -o %T 2> /dev/null | grep -q idle; then
  exit 0  # already up
fi
mkdir -p "$STATE"/{ctld,d} /var/log/slurm /run/munge /etc/slurm
# munge: one key, its daemon (SLURM signs every message with it).
[ -s /etc/munge/munge.key ] || mungekey --create --force 2> /dev/null \
  || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2> /dev/null
chown -R munge:munge /etc/munge /run/munge 2> /dev/null || true
chmod 0400 /etc/munge/munge.key
pgrep -x munged > /dev/null || munged --force
# One node, named as this host calls itself, with its cores and memory; no cgroups (a
# container has none to give), processes tracked by their parent pid.
host=$(hostname -s)
# SLURM looks its node up by name: a container's name may not resolve.
getent hosts "$host" > /dev/null || echo "127.0.0.1 $host" >> /etc/hosts
cpus=$(nproc)
memory_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))
cat > /etc/slurm/slurm.conf << CONF
ClusterName=paisoar
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again once its old credential expires (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=10
NodeName=$host CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
pgrep -x slurmctld > /dev/null || slurmctld
pgrep -x slurmd > /dev/null || slurmd
for _ in $(seq 60); do
  if sinfo -h -o %T 2> /dev/null | grep -qE "idle|mixed|allocated"; then
    exit 0
  fi
  scontrol update nodename="$host" state=resume > /dev/null 2>&1 || true
  sleep 0.5
done
echo "local_slurm.sh: the node did not come up; see /var/log/slurm/*.log" >&2
exit 1
