"""Before a sweep (or a single run) writes anything: is there room for it? A Hydra callback
(conf/config.yaml, hydra.callbacks), because Hydra's own first writes (multirun.yaml, a point's
.hydra/ files) come before any of ablate's code runs, and on a full disk they fail with a
traceback. Between points the job makes the same check after each row (ablate/job.py)."""
from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback

from ablate.results import check_room


class RoomToWrite(Callback):
    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        check_room(str(config.hydra.sweep.dir), "no room to start the sweep")

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        check_room(str(config.hydra.run.dir), "no room to start the run")
