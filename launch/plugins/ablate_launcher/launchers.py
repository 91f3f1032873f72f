"""hydra-submitit-launcher's SLURM launcher, plus a row for every point whose job died without one.
Selected by conf/hydra/launcher/slurm.yaml; lives in `hydra_plugins.ablate_launcher` because Hydra
takes launcher classes from that namespace only.

A job killed outside Python (SLURM's OOM killer, a node failure, SIGKILL) cannot write its own
result.json; submitit then raises UncompletedJobError when the sweep collects results, which would
end the sweep with a traceback and lose the point. `launch` is the plugin's own (its final line
collects results with no hook in between), so this class repeats its submission and changes only
the collection: a dead job becomes an `error` row and the other points are still collected.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher as PluginLocalLauncher
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as PluginSlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


class SlurmLauncher(PluginSlurmLauncher):
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
            reason = (f"SLURM job {job.job_id} ended {job.state} without a result "
                      "(time limit, scancel, out-of-memory kill or node failure)")
            # COMPLETED as far as Hydra goes: the point's failure is its row, and Hydra's sweeper
            # would otherwise abort the whole sweep on a FAILED return.
            ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
            ret.return_value = self._record_dead(list(overrides), reason)
            return ret

    def _record_dead(self, overrides: list[str], reason: str) -> dict:
        from ablate.job import record_unlaunched

        log.error(f"{' '.join(overrides)}: {reason}")
        return record_unlaunched(self.hydra_context, self.config, overrides, "error", reason)


class LocalLauncher(PluginLocalLauncher):
    """hydra-submitit-launcher's local launcher, one point at a time: points running side by side
    would share (and pollute) the GPU memory each of them measures."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        returns: list[JobReturn] = []
        for i, overrides in enumerate(job_overrides):
            returns += super().launch([overrides], initial_job_idx + i)
        return returns
