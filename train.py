"""Train DFlash drafters: ``python train.py experiment=v5_hardce`` (see README)."""

import hydra
from omegaconf import DictConfig

import dflash_lit.resolvers  # noqa: F401  (registers ${repo_root:})
from dflash_lit.cli import entry_point


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@entry_point
def main(cfg: DictConfig) -> float | None:
    from dflash_lit.train.run import train

    return train(cfg)


if __name__ == "__main__":
    main()
