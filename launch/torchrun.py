"""`python -m launch.torchrun <spec.json>`: every rank of one grid point through torchrun's own
launcher (torch.distributed's elastic agent), and a structured report of every rank that failed.

Run as the job's child instead of the `torchrun` script so that a failure comes back as torch's
ChildFailedError (rank, exit code) rather than as text on stderr. The ranks are forked from this
process, which has imported torch and the worker already (and waited for its point imported, when
started warm: launch/warm_start.py), instead of each starting an interpreter that imports them
again: seconds per rank on a GPU host. Nothing here sets CUDA up, so each rank can.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

from ablate import worker
from ablate.events import EventReader, EventWriter
from launch import cpus, environ, warm_start

RDZV_PORT_BASE = 29400  # multi-node: port on the first node, offset by the SLURM job id
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch.cuda.is_available() through NVML: no cuInit


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


class RankEnds:
    """How each of this node's ranks ended, seen by this launcher as each one ends.

    torch's agent reports one failed rank: the first whose end it finds at its next poll. When a
    rank is killed and a peer then fails on the broken connection before that poll, both have ended
    and the peer, first in rank order, is the one reported; the killed rank, the root cause, is not.
    So while the ranks run, every SIGCHLD looks at each rank (its pid from its "started" event)
    without reaping it (WNOWAIT: the agent still reaps its own), and notes its exit code. Python runs
    the handler in the main thread, the one the agent reaps in, before that thread's next bytecode:
    a rank's end is always seen before the agent can reap it."""

    def __init__(self, run_dir: str, host: str):
        self._events = EventReader(run_dir)
        self._host = host
        self._pids: dict[int, int] = {}  # rank -> pid, this node's ranks that have started
        self.ends: dict[int, dict] = {}  # rank -> {"rank", "exitcode" (-signal if killed), "t"}

    def __enter__(self) -> RankEnds:
        self._previous = signal.signal(signal.SIGCHLD, self._on_child)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGCHLD, self._previous)

    def _on_child(self, signum, frame) -> None:
        self._pids.update({e["rank"]: e["pid"] for e in self._events.read_new()
                           if e["event"] == "started" and e.get("host") == self._host})
        now = time.time()
        for rank, pid in self._pids.items():
            if rank in self.ends:
                continue
            try:
                end = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped already, or another node's pid on a shared hostname
                continue
            if end is not None:
                killed = end.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
                self.ends[rank] = {"rank": rank, "exitcode": -end.si_status if killed else end.si_status, "t": now}

    def failures(self, reported: ChildFailedError) -> list[dict]:
        """Every rank that failed: those seen ending here in the order they were seen (ranks found
        ended at the same look, which cannot tell their order, by rank), then any other that torch
        reported (one it reaped while this handler waited its turn: a survivor it stopped)."""
        seen = sorted(self.ends.values(), key=lambda end: (end["t"], end["rank"]))
        failed = [{"rank": end["rank"], "exitcode": end["exitcode"]} for end in seen if end["exitcode"] != 0]
        return failed + [{"rank": r, "exitcode": f.exitcode} for r, f in sorted(reported.failures.items())
                         if r not in self.ends]


def rank_main(spec_path: str) -> None:
    """One rank, forked from this launcher: the worker's main, its failure as the rank's exit code."""
    # The signal handlers a new interpreter starts with: the elastic agent's (a SIGTERM stops its
    # ranks) and the launcher's RankEnds came with the fork, and a rank told to stop stops, as
    # torchrun's own ranks do.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # torch read OMP_NUM_THREADS once, when this launcher imported it; a new interpreter would read
    # the rank's (threads_per_rank), and more threads than that would contend for the rank's CPUs.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    code = worker.main(spec_path)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


def launch_config(argv: list[str]) -> LaunchConfig:
    """torchrun's launch settings for its arguments `argv`, as torch.distributed.run makes them,
    with forked ranks. LaunchConfig asks whether CUDA is available (for a default NUMA binding);
    asked the usual way, that sets CUDA's driver up in this process, and no rank forked after it
    could use CUDA. Asked through NVML, it does not."""
    args = get_args_parser().parse_args([*argv, "-m", "ablate.worker"])  # the script: rank_main instead
    if args.standalone:  # as torch.distributed.run.run does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    with environ(NVML_CHECK, "1"):  # the ranks inherit the environment: theirs stays the user's
        config, _, _ = config_from_args(args)
    config.start_method = "fork"
    return config


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    parallel = spec["config"]["parallel"]
    # torchrun sets it only where it is unset; a user's own setting stands
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(parallel["nproc"])))
    config = launch_config([*rendezvous_args(parallel["nproc"], parallel["nodes"]), "--monitor-interval=0.2"])
    gc.freeze()  # what this process holds, the ranks' collections never walk (as launch/warm_start.py's)
    host = socket.gethostname()
    try:
        with RankEnds(spec["run_dir"], host) as ends:
            elastic_launch(config, rank_main)(spec_path)
        return 0
    except ChildFailedError as exc:  # every failed rank: which died of a signal tells the root cause
        EventWriter(spec["run_dir"]).emit("launcher", host=host, failures=ends.failures(exc))  # one per node
        return 1


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # inherited by the ranks, as ablate.worker's
    args = warm_start.arguments(sys.argv[1:], worker.prepare)  # started warm: waits here, imported, for the go
    sys.exit(main(args[0]) if args else 0)
