"""`python -m ablate [-m] group=option,... key=value`: compose conf/, run each grid point as a job."""
import hydra
from omegaconf import DictConfig

from ablate.schema import register

register()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from ablate.job import run_point  # after composition: `--cfg job` and `--help` stay fast

    run_point(cfg)


if __name__ == "__main__":
    main()
