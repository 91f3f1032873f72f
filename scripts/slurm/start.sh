#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try `hydra/launcher=slurm` sweeps without a cluster
# (tests/test_slurm.py uses it too). Needs root and no systemd: installs Debian's slurmctld, slurmd,
# slurm-client and munge with apt-get when missing, writes slurm.conf for this host, starts munged,
# slurmctld and slurmd, and waits until the node is idle. Idempotent: when the cluster is already
# up it only prints the environment, in well under a second.
#
#   eval "$(scripts/slurm/start.sh)"           # as root; or eval "$(sudo scripts/slurm/start.sh)"
#   eval "$(scripts/slurm/start.sh --nodes 2)" # two nodes, each in its own network namespace
#
# --nodes N (N >= 2) makes N nodes named ablate-n1..N on one machine, for multi-node points
# (parallel.nodes=2): each node is a network namespace joined to a bridge (ablate-br, 10.77.0.1/24,
# where slurmctld listens) by a veth pair, with address 10.77.0.1<i>, its own hostname (a UTS
# namespace) and its own /etc/hosts naming every node (a mount namespace); one slurmd runs in each.
# Everything a job starts on a node runs in that node's namespaces, so ranks on two nodes talk
# over the bridge as they would over a network. A cluster of another size is stopped first.
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

say() { echo "slurm/start.sh: $*" >&2; }
die() { say "$*"; echo false; exit 1; }
trap 'echo false' ERR  # any other failure (set -e) likewise: the caller's eval fails too

NODES=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --nodes) NODES=${2:-}; shift 2 || die "--nodes needs a number" ;;
    --nodes=*) NODES=${1#--nodes=}; shift ;;
    *) die "unknown argument '$1' (valid: --nodes N)" ;;
  esac
done
[[ $NODES =~ ^[1-9][0-9]?$ ]] || die "--nodes $NODES: give a number from 1 to 99"

# One node: this machine itself. Several: ablate-n1..N, in network namespaces (addresses 10.77.0.1<i>).
BRIDGE=ablate-br
SUBNET=10.77.0
if [[ $NODES == 1 ]]; then NAMES=("$(hostname -s)"); else NAMES=(); for i in $(seq "$NODES"); do NAMES+=("ablate-n$i"); done; fi
NODE=${NAMES[0]}
slurmd_pid() { if [[ $NODES == 1 ]]; then echo "$DIR/slurmd.pid"; else echo "$DIR/slurmd-$1.pid"; fi; }

alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
node_state() { timeout 10 sinfo -h -n "$1" -o %t 2>/dev/null | head -1 || true; }
all_up() {  # every daemon alive and every node taking jobs, in a cluster of this size
  [[ -s $CONF ]] && [[ $(grep -c '^NodeName=' "$CONF") == "$NODES" ]] && alive "$DIR/slurmctld.pid" || return 1
  local name
  for name in "${NAMES[@]}"; do
    alive "$(slurmd_pid "$name")" && [[ $(node_state "$name") =~ ^(idle|mix|alloc|comp) ]] || return 1
  done
}
print_env() {
  echo "export SLURM_CONF=$CONF"
  echo "export PATH=$HERE/bin:\$PATH"
}

# Already up (idle, or running jobs): nothing to do.
if all_up; then
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

# A half-started cluster (a daemon died, a node is down) or one of another size starts over with a
# fresh config: its daemons, and the namespaces of its nodes, go first.
if alive "$DIR/slurmctld.pid" || compgen -G "$DIR/slurmd*.pid" >/dev/null || ip netns list 2>/dev/null | grep -q '^ablate-n'; then
  say "stopping the cluster that is there (not up, or not of $NODES nodes)"
  KEEP_MUNGED=1 "$HERE/stop.sh" >&2
fi

if [[ $NODES == 1 ]]; then
  CTLD_ADDR=127.0.0.1
else
  command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null \
    || die "--nodes $NODES needs ip (iproute2), nsenter and unshare (util-linux)"
  say "making $NODES nodes: network namespaces ${NAMES[*]} on bridge $BRIDGE ($SUBNET.1/24)"
  CTLD_ADDR=$SUBNET.1
  ip link add "$BRIDGE" type bridge
  ip addr add "$CTLD_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  { echo "127.0.0.1 localhost"; echo "$CTLD_ADDR $(hostname -s)"
    for i in $(seq "$NODES"); do echo "$SUBNET.1$i ablate-n$i"; done; } > "$DIR/hosts"
  for i in $(seq "$NODES"); do
    ns=ablate-n$i
    ip netns add "$ns"
    ip link add "ablate-v$i" type veth peer name eth0 netns "$ns"
    ip link set "ablate-v$i" master "$BRIDGE" up
    ip -n "$ns" addr add "$SUBNET.1$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
fi

# `slurmd -C` prints this machine's CPUs, sockets, cores, threads and RealMemory; every node of a
# several-node cluster claims all of them (they share this machine, as the jobs' ranks do).
HW=$(slurmd -C | head -1 | sed "s/^NodeName=[^ ]* //")
if [[ $NODES == 1 ]]; then
  NODE_LINES="NodeName=$NODE $HW NodeAddr=127.0.0.1 State=UNKNOWN"
  SLURMD_FILES="SlurmdPidFile=$DIR/slurmd.pid
SlurmdLogFile=$DIR/slurmd.log
SlurmdSpoolDir=$DIR/spool"
else
  NODE_LINES=$(for i in $(seq "$NODES"); do echo "NodeName=ablate-n$i NodeAddr=$SUBNET.1$i NodeHostname=ablate-n$i $HW State=UNKNOWN"; done)
  # %n: each node's own name, so the slurmds of one machine keep apart.
  SLURMD_FILES="SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdLogFile=$DIR/slurmd-%n.log
SlurmdSpoolDir=$DIR/spool/%n"
fi
PARTITION_NODES=$(IFS=,; echo "${NAMES[*]}")
cat > "$CONF" <<CONF
# Written by scripts/slurm/start.sh: a $NODES-node cluster on $(hostname -s), for trying ablate's SLURM sweeps.
ClusterName=ablate
SlurmctldHost=$(hostname -s)($CTLD_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/slurmctld.log
$SLURMD_FILES
# No cgroups and no systemd needed.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
# scancel and the time limit send SIGTERM, then SIGKILL this many seconds later (submitit's job
# process ignores SIGTERM; the default 30 s only slows everything down).
KillWait=5
# A node that stops answering is DOWN after 30 s (default 300 s) and its jobs end NODE_FAIL.
SlurmdTimeout=30
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# No slurmdbd: finished jobs are appended to this file, which scripts/slurm/bin/sacct reads.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
$NODE_LINES
# EXCLUSIVE: one job at a time gets a whole node, as with the default launcher: points that
# share a GPU would pollute each other's memory measurements.
PartitionName=debug Nodes=$PARTITION_NODES Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE
CONF

say "starting slurmctld and ${NODES} slurmd ($CONF)"
slurmctld -f "$CONF"
if [[ $NODES == 1 ]]; then
  slurmd -f "$CONF"
else
  for name in "${NAMES[@]}"; do
    mkdir -p "$DIR/spool/$name"
    # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup filesystem slurmd reads.
    nsenter --net="/run/netns/$name" unshare --uts --mount --propagation private \
      sh -c "mount --bind '$DIR/hosts' /etc/hosts && hostname $name && exec slurmd -N $name -f '$CONF'"
  done
fi

# The state directory keeps job ids counting up, but the jobs it holds belong to daemons that are
# gone (we only get here when the cluster was down), and their processes with them. Recovered as
# RUNNING, such a job would hold its node (every job is exclusive) until slurmctld notices that no
# slurmd knows it, minutes later; new jobs would wait behind it. Their launchers see them CANCELLED.
for _ in $(seq 40); do stale=$(timeout 10 squeue -h -o %A 2>/dev/null) && break; sleep 0.5; done
if [[ -n ${stale:-} ]]; then
  # shellcheck disable=SC2086
  say "cancelling jobs left from the cluster that stopped:" $(sort -u <<<"$stale")
  # shellcheck disable=SC2086
  scancel $stale >&2 || true
fi

for _ in $(seq 120); do
  waiting=()
  for name in "${NAMES[@]}"; do
    state=$(node_state "$name")
    case $state in
      idle*|mix*|alloc*) ;;
      down*|drain*) scontrol update NodeName="$name" State=RESUME >&2 || true; waiting+=("$name") ;;
      *) waiting+=("$name") ;;
    esac
  done
  if [[ ${#waiting[@]} == 0 ]]; then print_env; say "nodes ${NAMES[*]} are up"; exit 0; fi
  sleep 0.5
done
die "node ${waiting[0]} did not become idle (state '${state:-none}'); see $DIR/slurmctld.log and $DIR/slurmd*.log"
