"""Default training data: the tiny target regenerates completions of the stdlib prompts.

Runs ``regenerate.py`` (backend ``hf``) twice — training prompts -> ``data/train``, held-out
evaluation prompts -> ``data/val`` — so the shipped data is exactly what the public pipeline
produces. Greedy decoding makes it deterministic for a given target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash_lit.paths import repo_root

# Function bodies end where the next top-level statement starts; cap long ones.
DEFAULT_STOP = ["\ndef ", "\nclass ", "\n\n\n"]


def regenerate_split(artifacts: Path, split: str, out_name: str, max_new_tokens: int,
                     batch_size: int, limit: int | None = None) -> dict:
    """One regenerate.py run over ``prompts/<split>.jsonl``; returns its summary.json."""
    out = artifacts / "data" / out_name
    stop = "[" + ",".join(json.dumps(s) for s in DEFAULT_STOP) + "]"
    args = [
        sys.executable, str(Path(repo_root()) / "regenerate.py"),
        f"target.path={artifacts / 'target'}",
        f"sources=[{{path:{artifacts / 'prompts' / (split + '.jsonl')},field:prompt,"
        f"name:stdlib_{split},id_field:id}}]",
        f"out={out}",
        f"generation.max_new_tokens={max_new_tokens}",
        f"generation.stop={stop}",
        f"hf.batch_size={batch_size}",
        "hf.device=cpu",
        "hf.dtype=float32",
        "rows_per_shard=1000",
        "chat=false",
        f"run_name=tiny_data_{out_name}",
    ]
    if limit:
        args.append(f"num_prompts={limit}")
    subprocess.run(args, check=True, env=dict(os.environ))
    return json.loads((out / "summary.json").read_text())


def build_data(artifacts: Path, max_new_tokens: int = 192, batch_size: int = 32,
               limit: int | None = None) -> dict:
    """Regenerate train and val data for the tiny target at ``artifacts``."""
    if not (artifacts / "target" / "config.json").is_file():
        raise FileNotFoundError(f"{artifacts}/target: build the tiny target first")
    train = regenerate_split(artifacts, "train", "train", max_new_tokens, batch_size, limit)
    val = regenerate_split(artifacts, "eval", "val", max_new_tokens, batch_size)
    return {"train": train, "val": val}
