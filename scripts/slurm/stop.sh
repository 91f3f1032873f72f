#!/usr/bin/env bash
# Stops what scripts/slurm/start.sh started: cancels every job still queued or running, then stops
# the slurmds, slurmctld, and munged if start.sh started it (a munged that was already running
# stays; KEEP_MUNGED=1 keeps ours too), and removes a several-node cluster's network namespaces,
# with whatever still runs in them, and its bridge. Idempotent. Keeps ABLATE_SLURM_DIR (logs,
# state: job ids keep counting up across restarts).
set -euo pipefail

DIR=${ABLATE_SLURM_DIR:-/tmp/ablate-slurm}
export SLURM_CONF=$DIR/slurm.conf
export PATH=$PATH:/usr/sbin:/sbin

say() { echo "slurm/stop.sh: $*" >&2; }
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop() {  # stop NAME...: SIGTERM to the daemons whose pid file is alive, SIGKILL after 10 s
  local pids=() name pid left
  for name in "$@"; do
    if alive "$DIR/$name.pid"; then pid=$(cat "$DIR/$name.pid"); say "stopping $name ($pid)"; pids+=("$pid"); fi
    rm -f "$DIR/$name.pid"
  done
  [[ ${#pids[@]} -gt 0 ]] || return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 100); do
    left=0; for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [[ $left == 1 ]] || break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

if alive "$DIR/slurmctld.pid"; then
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null || true)
  if [[ -n $jobs ]]; then
    say "cancelling jobs" $jobs
    # shellcheck disable=SC2086
    scancel $jobs || true
    # KillWait (5 s) after SIGTERM, SLURM kills what is left; wait for it while slurmd still runs.
    for _ in $(seq 300); do [[ -z $(timeout 10 squeue -h -o %A 2>/dev/null) ]] && break; sleep 0.1; done
  fi
fi
slurmds=()
for pidfile in "$DIR"/slurmd*.pid; do [[ -e $pidfile ]] && slurmds+=("$(basename "$pidfile" .pid)"); done
stop "${slurmds[@]}" slurmctld  # each takes about 2 s to shut down: together

# A several-node cluster's nodes: anything left in a namespace (a job's orphan) dies with it.
for ns in $(ip netns list 2>/dev/null | awk '/^ablate-n[0-9]+( |$)/ {print $1}'); do
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  # shellcheck disable=SC2086
  [[ -z $pids ]] || { say "killing what still runs on $ns:" $pids; kill -9 $pids 2>/dev/null || true; }
  ip netns del "$ns"  # takes its end of the veth pair, and so ours, with it
done
if ip link show ablate-br >/dev/null 2>&1; then ip link del ablate-br; fi
[[ -n ${KEEP_MUNGED:-} ]] || stop munged  # last: the SLURM daemons authenticate with it until they are gone
