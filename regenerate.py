"""Regenerate training completions with the target: ``python regenerate.py target.path=DIR``.

See ``conf/regenerate.yaml`` for every option; the work is in ``dflash_lit.data.regenerate``.
"""

import hydra
from omegaconf import DictConfig

import dflash_lit.resolvers  # noqa: F401  (registers ${repo_root:})
from dflash_lit.cli import entry_point


@hydra.main(version_base="1.3", config_path="conf", config_name="regenerate")
@entry_point
def main(cfg: DictConfig) -> None:
    """Hydra entry point: run the regeneration described by ``cfg``."""
    from dflash_lit.data.regenerate import run

    run(cfg)


if __name__ == "__main__":
    main()
