#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try `hydra/launcher=slurm` sweeps without a cluster
# (tests/test_slurm.py uses it too). Needs root and no systemd: installs Debian's slurmctld, slurmd,
# slurm-client and munge with apt-get when missing, writes slurm.conf for this host, starts munged,
# slurmctld and slurmd, and waits until the node is idle. Idempotent: when the cluster is already
# up it only prints the environment, in well under a second.
#
#   eval "$(scripts/slurm/start.sh)"         # as root; or eval "$(sudo scripts/slurm/start.sh)"
#
# stdout is only `export` lines (progress goes to stderr), or, when the start fails, `false`: a
# failing command inside $(...) does not fail the `eval` around it, so the line it evaluates must.
#
# ABLATE_SLURM_DIR (default /tmp/ablate-slurm) holds slurm.conf, state, logs and the job completion
# file (jobcomp/filetxt). There is no accounting database: scripts/slurm/bin/sacct answers the
# `sacct` calls submitit makes from squeue and that file, so it must come first on PATH.
set -euo pipefail

DIR=${ABLATE_SLURM_DIR:-/tmp/ablate-slurm}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF
export PATH=$PATH:/usr/sbin:/sbin
NODE=$(hostname -s)

say() { echo "slurm/start.sh: $*" >&2; }
die() { say "$*"; echo false; exit 1; }
trap 'echo false' ERR  # any other failure (set -e) likewise: the caller's eval fails too
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
node_state() { timeout 10 sinfo -h -n "$NODE" -o %t 2>/dev/null | head -1 || true; }
print_env() {
  echo "export SLURM_CONF=$CONF"
  echo "export PATH=$HERE/bin:\$PATH"
}
stop_pid() {  # stop_pid PIDFILE: SIGTERM, then SIGKILL after 10 s
  alive "$1" || return 0
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

# Already up (idle, or running jobs): nothing to do.
if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && [[ $(node_state) =~ ^(idle|mix|alloc|comp) ]]; then
  print_env
  exit 0
fi

[[ $(id -u) == 0 ]] || die "run me as root (sudo): I install packages and start munged, slurmctld and slurmd"
[[ ! -e $DIR || -O $DIR ]] || die "$DIR belongs to another user; set ABLATE_SLURM_DIR"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || die "no apt-get: install slurmctld, slurmd, slurm-client and munge yourself"
  say "installing slurmctld slurmd slurm-client munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2
fi

mkdir -p "$DIR/state" "$DIR/spool"
chmod 755 "$DIR"  # users other than root read slurm.conf

# munge authenticates every SLURM message. Use a munged that already answers (systemd's), else ours.
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  [[ -s /etc/munge/munge.key ]] || die "no /etc/munge/munge.key (reinstall munge, or run mungekey)"
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  say "starting munged"
  munged --force --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log"
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# A half-started cluster (one daemon died, the node is down) starts over with a fresh config.
stop_pid "$DIR/slurmd.pid"
stop_pid "$DIR/slurmctld.pid"

# `slurmd -C` prints this machine's NodeName, CPUs, sockets, cores, threads and RealMemory.
HW=$(slurmd -C | head -1 | sed "s/^NodeName=[^ ]*/NodeName=$NODE/")
cat > "$CONF" <<CONF
# Written by scripts/slurm/start.sh: a one-node cluster on $NODE, for trying ablate's SLURM sweeps.
ClusterName=ablate
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
# No cgroups and no systemd needed.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
# scancel and the time limit send SIGTERM, then SIGKILL this many seconds later (submitit's job
# process ignores SIGTERM; the default 30 s only slows everything down).
KillWait=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# No slurmdbd: finished jobs are appended to this file, which scripts/slurm/bin/sacct reads.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
$HW NodeAddr=127.0.0.1 State=UNKNOWN
# EXCLUSIVE: one job at a time gets the whole machine, as with the default launcher: points that
# share a GPU would pollute each other's memory measurements.
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE
CONF

say "starting slurmctld and slurmd ($CONF)"
slurmctld -f "$CONF"
slurmd -f "$CONF"

for _ in $(seq 120); do
  state=$(node_state)
  case $state in
    idle*|mix*|alloc*) print_env; say "node $NODE is $state"; exit 0 ;;
    down*|drain*) scontrol update NodeName="$NODE" State=RESUME >&2 || true ;;
  esac
  sleep 0.5
done
die "node $NODE did not become idle (state '${state:-none}'); see $DIR/slurmctld.log and $DIR/slurmd.log"
