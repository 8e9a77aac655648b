"""Acceptance length τ of a DFlash drafter by real greedy speculative decoding.

    python evaluate.py ckpt=outputs/<run>/checkpoints/last.ckpt prompts=humaneval
    python evaluate.py ckpt=drafter_dir/ target=Qwen/Qwen3-8B prompts=jsonl prompts_path=p.jsonl

Config: conf/tools/evaluate.yaml (every key documented); the work is in dflash_lit.eval.cli.
"""

import sys

import hydra
from omegaconf import DictConfig

import dflash_lit.resolvers  # noqa: F401  (registers ${repo_root:})
from dflash_lit.cli import entry_point


@hydra.main(version_base="1.3", config_path="conf/tools", config_name="evaluate")
@entry_point
def main(cfg: DictConfig) -> None:
    from dflash_lit.eval.cli import main as evaluate

    code = evaluate(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
