"""Export a trained DFlash drafter to the z-lab layout (vLLM ``dflash`` / SGLang ``DFLASH``).

    python export.py ckpt=outputs/<run>/checkpoints/last.ckpt out=drafter/ [drafter=NAME] [dtype=bfloat16]

Config: conf/tools/export.yaml; the work is in dflash_lit.export.cli.
"""

import sys

import hydra
from omegaconf import DictConfig

import dflash_lit.resolvers  # noqa: F401  (registers ${repo_root:})
from dflash_lit.cli import entry_point


@hydra.main(version_base="1.3", config_path="conf/tools", config_name="export")
@entry_point
def main(cfg: DictConfig) -> None:
    from dflash_lit.export.cli import export

    code = export(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
