"""`python -m launch.torchrun <spec.json>`: every rank of one grid point through torchrun's own
launcher (torch.distributed.run), and a structured report of which rank failed first.

Run as the job's child instead of the `torchrun` script so that a failure comes back as torch's
ChildFailedError (rank, exit code) rather than as text on stderr.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from ablate.events import EventWriter
from launch import cpus, warm_start

RDZV_PORT_BASE = 29400  # multi-node: port on the first node, offset by the SLURM job id


def rendezvous_args(nproc: int, nodes: int) -> list[str]:
    """Single node: standalone rendezvous on a free port (port 0), so sweeps on one host never
    collide. Several nodes: c10d rendezvous on the allocation's first node, from SLURM's env."""
    if nodes == 1:
        return ["--standalone", f"--nproc-per-node={nproc}"]
    hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    job = int(os.environ["SLURM_JOB_ID"])
    return [f"--nnodes={nodes}", f"--nproc-per-node={nproc}", f"--node-rank={os.environ['SLURM_NODEID']}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:{RDZV_PORT_BASE + job % 1000}",
            f"--rdzv-id={job}"]


def threads_per_rank(nproc: int) -> int:
    """CPU threads for each of a node's `nproc` ranks: this process's CPUs shared out. torchrun
    would set OMP_NUM_THREADS=1, which makes every rank's host work serial: the model's initial
    draws (ablate.models.gpt_module.normal_draws) and, under offload, the optimizer step that runs on the CPU."""
    return max(1, len(cpus.allowed()) // nproc)  # a SLURM allocation's, a gpu_pool point's share


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    parallel = spec["config"]["parallel"]
    # torchrun sets it only where it is unset; a user's own setting stands
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(parallel["nproc"])))
    argv = [*rendezvous_args(parallel["nproc"], parallel["nodes"]), "--monitor-interval=0.2",
            "-m", "ablate.worker", spec_path]
    try:
        run(get_args_parser().parse_args(argv))
        return 0
    except ChildFailedError as exc:  # every failed rank: which died of a signal tells the root cause
        failed = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)
        EventWriter(spec["run_dir"]).emit("launcher", host=socket.gethostname(),  # one per node
                                          failures=[{"rank": r, "exitcode": f.exitcode} for r, f in failed])
        return 1


if __name__ == "__main__":
    args = warm_start.arguments(sys.argv[1:])  # started warm: waits here, imported, for the go
    sys.exit(main(args[0]) if args else 0)
