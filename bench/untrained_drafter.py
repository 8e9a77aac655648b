"""Write a randomly initialised drafter with a checkpoint's exact config (z-lab layout): the
"untrained" row of the README tables, evaluated with the same commands as the trained one.

    python bench/untrained_drafter.py CKPT OUT_DIR [--drafter NAME] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from dflash_lit import DFlashDrafter
from dflash_lit.eval.loading import load_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    trained, _ = load_drafter(args.ckpt, args.drafter)
    torch.manual_seed(args.seed)
    DFlashDrafter(trained.config).save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
