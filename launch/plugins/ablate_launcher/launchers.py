"""ablate's launchers over hydra-submitit-launcher: SLURM (conf/hydra/launcher/slurm.yaml), local
submitit jobs one at a time (submitit_local.yaml) and, the default, points side by side on a host
with several GPUs (gpu_pool.yaml). They live in `hydra_plugins.ablate_launcher` because Hydra takes
launcher classes from that namespace only.

A job killed outside Python (SLURM's OOM killer, a node failure, SIGKILL) cannot write its own
result.json; submitit then raises UncompletedJobError when the sweep collects results, which would
end the sweep with a traceback and lose the point. The plugin's `launch` collects results with no
hook in between, so SlurmLauncher repeats its submission and changes only the collection, and the
local launchers submit their own: a dead job becomes an `error` row and the other points are
still collected.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher as PluginLocalLauncher
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as PluginSlurmLauncher
from omegaconf import OmegaConf

from launch import cpus as host_cpus
from launch import environ, rebuild_launcher
from launch.compose_once import ComposeOnce
from launch.gpu_pool import Lease, QueuedPoint, gpus_wanted, host_gpus, packed
from launch.jobs import no_result
from launch.nvml import near_cpus

log = logging.getLogger(__name__)


class _Portable:
    """Pickled by name through `launch`: a job unpickles its launcher in a fresh process, where
    `hydra_plugins.ablate_launcher` imports only once launch/__init__.py has named its folder. A
    checkout run from PYTHONPATH without an install (a GPU host without network) would otherwise
    fail every pool job on `No module named 'hydra_plugins.ablate_launcher'` before it started."""

    def __reduce__(self):
        return rebuild_launcher, (type(self).__name__, self.__dict__)


class SlurmLauncher(_Portable, PluginSlurmLauncher):
    def _executor(self):
        import submitit

        init = {"folder": self.params["submitit_folder"], "slurm_max_num_timeout": self.params["max_num_timeout"]}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in self.params.items()
                                      if k not in ("max_num_timeout", "submitit_folder")})
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = self._executor().map_array(self, *zip(*params))
        return [self._collect(job, overrides) for job, overrides in zip(jobs, job_overrides)]

    def _collect(self, job: Any, overrides: Sequence[str]) -> JobReturn:
        from submitit.core.utils import UncompletedJobError

        try:
            return job.results()[0]
        except UncompletedJobError:
            reason = no_result(job, "SLURM job", "time limit, scancel, out-of-memory kill or node failure")
            # COMPLETED as far as Hydra goes: the point's failure is its row, and Hydra's sweeper
            # would otherwise abort the whole sweep on a FAILED return.
            ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
            ret.return_value = self._record_dead(list(overrides), reason)
            return ret

    def _record_dead(self, overrides: list[str], reason: str) -> dict:
        from ablate.job import record_unlaunched

        log.error(f"{' '.join(overrides)}: {reason}")
        return record_unlaunched(self.hydra_context, self.config, overrides, "error", reason)


class LocalLauncher(_Portable, PluginLocalLauncher):
    """hydra-submitit-launcher's local launcher, one point at a time: points running side by side
    on one GPU would share (and pollute) the memory each of them measures. Each point sees the
    sweep's GPUs (the first `gpus_per_node` of them when set): the plugin's own launch hides them
    all, as submitit's local executor sets CUDA_VISIBLE_DEVICES to `visible_gpus[:gpus_per_node]`,
    "" while gpus_per_node is unset."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        gpus = host_gpus()
        if self.params.get("gpus_per_node") is not None:
            gpus = gpus[:self.params["gpus_per_node"]]
        self._make_sweep_dir()
        returns = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            returns.append(self._collect(self._submit(idx, overrides, gpus), overrides))
        return returns

    def _make_sweep_dir(self) -> None:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit 'local' sweep output dir : {sweep_dir}")

    def _submit(self, idx: int, overrides: Sequence[str], gpus: list[int], cpus: Sequence[int] = ()) -> Any:
        """The point as a local submitit job pinned to `gpus` (its CUDA_VISIBLE_DEVICES) and, when
        given, to `cpus` (launch/cpus.ENV, which the job reads before it starts its worker)."""
        import submitit

        # The LocalExecutor itself: AutoExecutor refuses its `visible_gpus`. No requeue after a
        # time limit (max_num_timeout 0): the worker cannot resume.
        executor = submitit.LocalExecutor(folder=self.params["submitit_folder"],
                                          max_num_timeout=self.params.get("max_num_timeout", 0))
        queue = {k: v for k, v in self.params.items()  # the GPUs are this call's to give
                 if v is not None and k not in ("submitit_folder", "max_num_timeout", "gpus_per_node")}
        executor.update_parameters(**queue, gpus_per_node=len(gpus), visible_gpus=list(gpus))
        # submitit's local job takes this process's environment as it starts: the CPUs go in it
        with environ(host_cpus.ENV, host_cpus.fmt(cpus) if cpus else None):
            return executor.submit(self, list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                                   Singleton.get_state())

    def _collect(self, job: Any, overrides: Sequence[str]) -> JobReturn:
        """The job's return; a job killed outside Python (the host's OOM killer, kill -9) gets an
        `error` row, as under SLURM, and the sweep goes on."""
        from submitit.core.utils import UncompletedJobError

        from ablate.job import record_unlaunched

        try:
            return job.results()[0]
        except UncompletedJobError:
            reason = no_result(job, "local submitit job",
                                "killed outside Python: the host's out-of-memory killer, kill -9")
            log.error(f"{' '.join(overrides)}: {reason}")
            ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
            ret.return_value = record_unlaunched(self.hydra_context, self.config, list(overrides), "error", reason)
            return ret


class GpuPoolLauncher(LocalLauncher):
    """hydra/launcher=gpu_pool, the default. On a host with several GPUs: grid points side by side,
    one per free GPU (parallel.nproc=k takes k; launch/gpu_pool.py), each a local submitit job
    pinned to its own GPUs. With one GPU or none: Hydra's basic launcher, exactly as before (one
    point at a time, in the sweep's own process)."""

    def __init__(self, gpus: Any = "auto", points_per_gpu: int = 1, **params: Any) -> None:
        super().__init__(**params)
        self.gpus = OmegaConf.to_container(gpus) if OmegaConf.is_config(gpus) else gpus
        if not isinstance(points_per_gpu, int) or isinstance(points_per_gpu, bool) or points_per_gpu < 1:
            raise ValueError(f"hydra.launcher.points_per_gpu={points_per_gpu!r} must be a positive integer "
                             "(1: each point a GPU of its own)")
        self.per_gpu = points_per_gpu

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        # The sweeper holds the same context: its check of each point goes through ComposeOnce too.
        if not isinstance(hydra_context.config_loader, ComposeOnce):
            hydra_context.config_loader = ComposeOnce(hydra_context.config_loader)
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        gpus = host_gpus(self.gpus)
        if len(gpus) * self.per_gpu < 2:
            basic = BasicLauncher()
            basic.setup(hydra_context=self.hydra_context, task_function=self.task_function, config=self.config)
            return basic.launch(job_overrides, initial_job_idx)
        # Pinned ids as nvidia-smi and NVML number them (PCI order), so that a job's NVML sampling
        # watches its own GPUs; CUDA's default order can differ on a host of mixed GPUs.
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        self._make_sweep_dir()
        points = [self._point(idx, overrides, len(gpus))
                  for idx, overrides in enumerate(job_overrides, start=initial_job_idx)]
        each = "one GPU each" if self.per_gpu == 1 else \
            f"up to {self.per_gpu} at once on each GPU (points_per_gpu: their times and utilisation are shared)"
        print(f"{len(points)} point{'s' if len(points) != 1 else ''} over GPUs {_ids(gpus)}, {each} "
              "(parallel.nproc=k: k); each point's own output: <sweep dir>/.submitit/", flush=True)
        # A point wanting more GPUs than there are is invalid here, as the worker's own check would
        # find, without starting its ranks.
        returns = {p.idx: self._too_big(p, gpus) for p in points if p.on_gpu and p.wants > len(gpus)}
        seats = host_cpus.plan(gpus, self.per_gpu, host_cpus.allowed(), near_cpus(gpus))  # CPUs of their own
        jobs = packed([p for p in points if p.idx not in returns], gpus, self._start, lambda job: job.done(), _stop,
                      per_gpu=self.per_gpu, cpus=seats)
        with _sigterm_stops_the_points(), contextlib.closing(jobs):
            for point, job, lease in jobs:
                returns[point.idx] = self._collect(job, point.overrides)
                _show_done(point, f"{point.label}  GPU {_ids(lease.ids)}", returns[point.idx])
        return [returns[p.idx] for p in points]

    def _point(self, idx: int, overrides: Sequence[str], host: int) -> QueuedPoint:
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        distributed = not str(cfg.parallel._target_).endswith(".Single")  # torchrun's ranks (ablate/outcome.py)
        return QueuedPoint(idx, list(overrides), gpus_wanted(distributed, cfg.parallel.get("nproc", 1), host),
                     cfg.device != "cpu" and not cfg.predict_only, cfg.hydra.job.override_dirname or "defaults",
                     Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir))

    def _too_big(self, point: QueuedPoint, gpus: list[int]) -> JobReturn:
        from ablate.job import record_unlaunched

        reason = (f"parallel.nproc={point.wants} > {len(gpus)} GPUs on this host "
                  f"(hydra.launcher.gpus: {_ids(gpus)}); not run")
        ret = JobReturn(overrides=point.overrides, status=JobStatus.COMPLETED)
        ret.return_value = record_unlaunched(self.hydra_context, self.config, point.overrides, "invalid", reason)
        _show_done(point, point.label, ret)
        return ret

    def _start(self, point: QueuedPoint, lease: Lease) -> Any:
        point.submitted = datetime.now(timezone.utc).isoformat()
        print(f"[running] {point.label}  GPU {_ids(lease.ids)}  CPUs {host_cpus.fmt(lease.cpus)}", flush=True)
        return self._submit(point.idx, point.overrides, lease.ids, lease.cpus)

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """In the point's job: on its own CPUs before anything starts, then the plugin's job."""
        host_cpus.pin_from_env()
        return super().__call__(*args, **kwargs)


def _ids(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids))


def _stop(job: Any, grace_s: float = 15.0) -> None:
    """End a running point's job (the sweep was stopped) as Ctrl-C ends a point under the basic
    launcher: SIGINT to the job, which takes its worker along; no row is written, and the next sweep
    runs the point. A job that ignores SIGINT (a sweep started in the background inherits that) is
    killed with every process under it (its worker, torchrun's ranks) after `grace_s` (more than
    the job's own grace for its worker, launch/local.py). Either way submitit's controller then
    ends quietly, as after any job (SIGINT to it would print a traceback on the sweep's console)."""
    import psutil

    try:
        tasks = psutil.Process(int(job.job_id)).children()
        for task in tasks:
            task.send_signal(signal.SIGINT)
        _, alive = psutil.wait_procs(tasks, timeout=grace_s)
        for proc in [p for task in alive for p in task.children(recursive=True)] + alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    except psutil.Error:  # the job ended meanwhile
        pass


def _show_done(point: QueuedPoint, label: str, ret: JobReturn) -> None:
    """The point's line in the sweep's console (`label` names its GPUs), as its job printed it in
    its own log."""
    from ablate.console import Progress
    from ablate.results import RESULT_FILE

    if ret.status != JobStatus.COMPLETED:
        print(f"[ failed] {label}  the job raised {ret._return_value!r}", flush=True)
        return
    result = ret.return_value
    if result:
        started = (result.get("timing") or {}).get("started_at")
        Progress(label).done(result, str(point.run_dir / RESULT_FILE),
                             skipped=started is not None and started < point.submitted)


class _Terminated(KeyboardInterrupt):
    """SIGTERM to the sweep, raised where it lands so that the running points are stopped."""


@contextlib.contextmanager
def _sigterm_stops_the_points():
    """A sweep told to stop (SIGTERM: `kill`, `timeout`) stops its running points first, as Ctrl-C
    does (submitit's local jobs are made to outlive the process that started them, and would keep
    their GPUs busy), then ends by the signal, as under the basic launcher."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(sig, frame):
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)
        raise  # where a handler of the caller's own let the process live on
    finally:
        signal.signal(signal.SIGTERM, previous)
