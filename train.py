"""Train DFlash drafters: ``python train.py experiment=v5_hardce`` (see README)."""

import hydra
from omegaconf import DictConfig

import dflash_lit.resolvers  # noqa: F401  (registers ${repo_root:})


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from dflash_lit.train.run import train

    return train(cfg)


if __name__ == "__main__":
    main()
