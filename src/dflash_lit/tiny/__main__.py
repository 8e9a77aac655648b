"""CLI: ``python -m dflash_lit.tiny build [--out DIR] [--seed N] [--toy] [--max-minutes M]``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the requested command."""
    ap = argparse.ArgumentParser(prog="python -m dflash_lit.tiny",
                                 description="Build the embedded tiny target + default prompts.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="tokenizer + pretrained Qwen3 target + prompts")
    b.add_argument("--out", type=Path, default=Path("artifacts/tiny"))
    b.add_argument("--work", type=Path, default=None,
                   help="intermediate state / checkpoints (default: OUT/_work)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--toy", action="store_true", help="seconds-long toy build (tests)")
    b.add_argument("--max-minutes", type=float, default=None,
                   help="safety cap on pretraining wall time (the step count stays fixed)")
    b.add_argument("--max-steps", type=int, default=None, help="override the preset's max_steps")
    b.add_argument("--no-resume", action="store_true", help="ignore work-dir state")
    d = sub.add_parser("data", help="regenerate the default data with the built tiny target")
    d.add_argument("--out", type=Path, default=Path("artifacts/tiny"))
    d.add_argument("--max-new-tokens", type=int, default=192)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--limit", type=int, default=None, help="train prompts (default: all)")
    args = ap.parse_args(argv)

    if args.cmd == "data":
        from .data import build_data

        summary = build_data(args.out, args.max_new_tokens, args.batch_size, args.limit)
        for split, s in summary.items():
            print(f"{split}: {json.dumps(s.get('dataset'))} | {json.dumps(s.get('throughput'))}")
        return 0

    from .build import build
    from .model import get_preset

    preset = get_preset("toy" if args.toy else "default", max_steps=args.max_steps)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{(time.time() - t0) / 60:5.1f}m] {msg}", flush=True)

    build(args.out, preset, seed=args.seed, work=args.work, max_minutes=args.max_minutes,
          resume=not args.no_resume, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
