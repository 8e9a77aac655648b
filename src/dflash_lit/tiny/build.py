"""End-to-end build of the embedded default: prompts, tokenizer, pretrained target, build_info.

Layout written under ``out``::

    prompts/train.jsonl, prompts/eval.jsonl
    target/  config.json model.safetensors generation_config.json tokenizer.json
             tokenizer_config.json build_info.json

Intermediate state (tokenizer, packed ids, Lightning checkpoints) lives in ``work`` so an
interrupted build resumes. ``target/`` is replaced atomically at every snapshot; its
``build_info.json`` says ``"complete": false`` until the last step.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast

from dflash_lit.atomic import publish_dir, remove_stale_temporaries, temporary_name

from .corpus import list_stdlib_files, read_files, split_files, stable_fraction, stdlib_root
from .model import TinyPreset, make_model
from .pretrain import chunk, mean_loss, pack_documents, pretrain
from .prompts import build_prompts, write_jsonl
from .tokenizer import build_tokenizer, save_tokenizer

TARGET_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json")


def corpus_split(p: TinyPreset) -> tuple[list[str], list[str]]:
    """(train, held-out) relative paths for a preset (``max_files`` picks a stable subset)."""
    rels = list_stdlib_files(include_tests=p.include_tests)
    if p.max_files is not None:
        rels = sorted(sorted(rels, key=lambda r: stable_fraction("subset:" + r))[: p.max_files])
    return split_files(rels, p.heldout_frac)


def save_target(model: torch.nn.Module, tok: PreTrainedTokenizerFast, out_dir: Path,
                info: dict, dtype: torch.dtype) -> None:
    """Write a HF model dir (weights cast to ``dtype``) + tokenizer + build_info, atomically."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries([out_dir.parent])
    tmp = temporary_name(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    m = copy.deepcopy(model).to(dtype).eval()
    m.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, do_sample=False)
    m.save_pretrained(str(tmp), safe_serialization=True)
    save_tokenizer(tok, tmp)
    publish_dir(tmp, out_dir, info)


def build(out: Path, preset: TinyPreset, seed: int = 0, work: Path | None = None,
          max_minutes: float | None = None, resume: bool = True,
          log: Callable[[str], None] = print) -> dict:
    """Run the whole build; returns the final ``build_info`` dict."""
    t_start = time.time()
    out = Path(out)
    work = Path(work) if work is not None else out / "_work"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    p = preset
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    train_rels, held_rels = corpus_split(p)
    train_files, held_files = read_files(train_rels), read_files(held_rels)
    if not held_files:
        raise ValueError(f"held-out split is empty (heldout_frac={p.heldout_frac}, "
                         f"{len(train_rels)} files): raise heldout_frac or max_files.")
    log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files "
        f"({sum(len(f.text) for f in train_files) / 1e6:.1f} MB train) from {stdlib_root()}")

    # Prompts first: cheap, and usable while the target is still training.
    tr_prompts, ev_prompts = build_prompts(train_files + held_files,
                                           max_train=p.max_train_prompts,
                                           max_eval=p.max_eval_prompts)
    write_jsonl(tr_prompts, out / "prompts" / "train.jsonl")
    write_jsonl(ev_prompts, out / "prompts" / "eval.jsonl")
    log(f"prompts: {len(tr_prompts)} train, {len(ev_prompts)} eval -> {out / 'prompts'}")

    tok_dir, ids_path = work / "tokenizer", work / "packed.pt"
    _check_work_preset(work, p, seed, resume)
    if resume and (tok_dir / "tokenizer.json").exists() and ids_path.exists():
        tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
        packed = torch.load(ids_path)
        log(f"tokenizer + packed ids reloaded from {work}")
    else:
        t0 = time.time()
        tok = build_tokenizer([f.text for f in train_files], p.vocab_size, tok_dir)
        packed = {"train": pack_documents(tok, [f.text for f in train_files]),
                  "heldout": pack_documents(tok, [f.text for f in held_files])}
        torch.save(packed, ids_path)
        log(f"tokenizer: vocab {len(tok)} trained in {time.time() - t0:.0f}s; "
            f"{packed['train'].numel()} train / {packed['heldout'].numel()} held-out tokens")
    if len(tok) != p.vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} tokens, preset wants {p.vocab_size}: "
                         "corpus too small for the vocab (lower vocab_size).")
    train_chunks = chunk(packed["train"], p.seq_len)
    val_chunks = chunk(packed["heldout"], p.seq_len)[: p.val_chunks]

    model = make_model(p, seed, tok.eos_token_id)
    n_params = sum(t.numel() for t in model.parameters())
    log(f"model: Qwen3 {p.num_hidden_layers}L h{p.hidden_size} ff{p.intermediate_size} "
        f"vocab {p.vocab_size}: {n_params / 1e6:.2f}M params; {p.max_steps} steps x "
        f"{p.batch_size}x{p.seq_len} tokens")
    dtype = getattr(torch, p.save_dtype)
    base_info = {
        "preset": p.to_dict(), "seed": seed, "n_params": n_params,
        # the stdlib relative to the interpreter's prefix: no machine path in shipped files
        "corpus": {"stdlib": os.path.relpath(stdlib_root(), sys.base_prefix),
                   "python": platform.python_version(),
                   "train_files": len(train_files), "heldout_files": len(held_files),
                   "train_tokens": int(packed["train"].numel()),
                   "heldout_tokens": int(packed["heldout"].numel()),
                   "train_chunks": len(train_chunks), "val_chunks": len(val_chunks)},
        "prompts": {"train": len(tr_prompts), "eval": len(ev_prompts)},
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "tokenizers": _version("tokenizers"), "lightning": _version("lightning")},
        "command": " ".join(["python -m dflash_lit.tiny", *sys.argv[1:]]), "num_threads": torch.get_num_threads(),
    }

    def snapshot(m: torch.nn.Module, step: int) -> None:
        info = dict(base_info, complete=False, steps=step,
                    tokens_seen=step * p.batch_size * p.seq_len,
                    wall_s=round(time.time() - t_start, 1))
        save_target(m, tok, out / "target", info, dtype)
        log(f"snapshot at step {step} -> {out / 'target'}")

    stats = pretrain(model, p, seed, train_chunks, val_chunks, work, snapshot,
                     max_minutes=max_minutes, resume=resume, log=log)
    held = mean_loss(model, chunk(packed["heldout"], p.seq_len), p.batch_size)
    info = dict(base_info, complete=stats["completed"], **stats, heldout_loss=round(held, 4),
                heldout_ppl=round(float(torch.exp(torch.tensor(held))), 2),
                wall_s=round(time.time() - t_start, 1))
    save_target(model, tok, out / "target", info, dtype)
    log(f"done: held-out loss {held:.4f} after {stats['steps']} steps; "
        f"{'complete' if stats['completed'] else 'STOPPED EARLY (max-minutes)'} -> {out / 'target'}")
    return json.loads((out / "target" / "build_info.json").read_text())


def _check_work_preset(work: Path, p: TinyPreset, seed: int, resume: bool) -> None:
    """Refuse to resume from a work dir written by a different preset/seed."""
    path = work / "preset.json"
    want = {"preset": p.to_dict(), "seed": seed}
    if resume and path.exists():
        have = json.loads(path.read_text())
        if have != want:
            raise ValueError(f"{path} was written by another build (preset/seed differ); "
                             "use a fresh --work dir or --no-resume.")
    elif not resume:
        for sub in ("ckpt", "tokenizer"):
            shutil.rmtree(work / sub, ignore_errors=True)
        (work / "packed.pt").unlink(missing_ok=True)
    path.write_text(json.dumps(want, indent=2) + "\n")


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)
