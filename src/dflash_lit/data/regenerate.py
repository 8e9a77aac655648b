"""Regenerate training completions with the target: prompts → target generation → shards.

The drafter learns the *target's* distribution, so every completion is written by the target
(``hf`` or ``openai`` backend) from prompts of the source datasets. Output: Parquet shards
``shard-NNNNN.parquet`` with columns ``id, source, input_ids (prompt + generated),
loss_mask (1 on generated tokens), prompt_len, gen_len, finish_reason, backend``, each
written atomically (tmp → fsync → rename). A rerun with the same ``out`` skips ids already in
finished shards, so nothing is duplicated. ``summary.json`` holds the run's statistics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import dflash_lit.resolvers  # noqa: F401  (${repo_root:} in conf/paths)
from dflash_lit.atomic import atomic_write, remove_stale_temporaries
from dflash_lit.data import shards
from dflash_lit.data.backends import GenerationSettings, GenRequest, eos_token_ids, make_backend
from dflash_lit.data.prompts import Prompt, PromptError, load_source, mix, parse_sources
from dflash_lit.data.render import PromptRenderer, resolve_chat
from dflash_lit.data.vocab import META_KEY, check_tokenizer_fits, tokenizer_fingerprint
from dflash_lit.errors import UserError
from dflash_lit.hf import text_config
from dflash_lit.paths import repo_relative

log = logging.getLogger(__name__)

SHARD_GLOB = "shard-*.parquet"
FINGERPRINT_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SCHEMA = pa.schema(
    [
        *shards.SCHEMA,
        ("prompt_len", pa.int32()),
        ("gen_len", pa.int32()),
        ("finish_reason", pa.string()),
        ("backend", pa.string()),
    ]
)


# -- shards ----------------------------------------------------------------------------------


class ShardWriter:
    """Buffers rows and writes ``rows_per_shard``-row Parquet shards atomically.

    On open it removes temp files of a killed run, reads the ids of finished shards
    (``done_ids``) and checks they were made with the same ``settings``.
    """

    def __init__(self, out: Path, rows_per_shard: int, settings: Mapping[str, Any]) -> None:
        if rows_per_shard < 1:
            raise UserError(f"rows_per_shard: must be >= 1, got {rows_per_shard}")
        self.out, self.rows_per_shard = Path(out), int(rows_per_shard)
        self.settings = json.loads(json.dumps(settings))
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"out={self.out}: cannot create the output directory "
                                   f"({e.strerror or e}); choose a writable out=") from e
        remove_stale_temporaries([self.out])  # a killed run's half-written shard
        self.done_ids: set[str] = set()
        self.next_index = 0
        for shard in sorted(self.out.glob(SHARD_GLOB)):
            try:
                pf = pq.ParquetFile(shard)
                ids = pf.read(columns=["id"]).column(0).to_pylist()
                meta = (pf.schema_arrow.metadata or {}).get(META_KEY)
            except Exception as e:
                raise UserError(f"cannot read finished shard {shard}: {e}; move it away") from e
            self._check_settings(shard, json.loads(meta) if meta else None)
            self.done_ids.update(ids)
            self.next_index = max(self.next_index, int(shard.stem.split("-")[-1]) + 1)
        self._rows: list[dict[str, Any]] = []
        self.written: list[Path] = []

    def _check_settings(self, shard: Path, old: dict[str, Any] | None) -> None:
        if old is None:
            return
        for key in sorted(old):  # a key the writer of an older shard did not record is no conflict
            if old.get(key) != self.settings.get(key):
                raise UserError(
                    f"out={self.out} holds {shard.name}, generated with different settings "
                    f"({key}: {old.get(key)!r} there, {self.settings.get(key)!r} now); resume "
                    "needs the same target/chat/generation settings: use a new out= or restore them"
                )

    def add(self, row: dict[str, Any]) -> Path | None:
        """Buffer one row; write a shard when the buffer is full (returns its path)."""
        self._rows.append(row)
        if len(self._rows) >= self.rows_per_shard:
            return self.flush()
        return None

    def flush(self) -> Path | None:
        """Write buffered rows (if any) as the next shard."""
        if not self._rows:
            return None
        schema = SCHEMA.with_metadata({META_KEY: json.dumps(self.settings).encode()})
        table = pa.Table.from_pylist(self._rows, schema=schema)
        path = self.out / f"shard-{self.next_index:05d}.parquet"
        atomic_write(path, lambda f: pq.write_table(table, f), what="shard",
                     intact=f"the finished shards in {self.out} are intact and a rerun skips "
                            "their ids")
        self.next_index += 1
        self.done_ids.update(r["id"] for r in self._rows)
        self._rows = []
        self.written.append(path)
        return path


def make_row(req: GenRequest, gen_ids: list[int], finish_reason: str, backend: str) -> dict[str, Any]:
    """One output row: prompt + generated tokens, loss on the generated ones only."""
    p, g = len(req.prompt_ids), len(gen_ids)
    return {
        "id": req.id,
        "source": req.source,
        "input_ids": list(req.prompt_ids) + list(gen_ids),
        "loss_mask": [0] * p + [1] * g,
        "prompt_len": p,
        "gen_len": g,
        "finish_reason": finish_reason,
        "backend": backend,
    }


# -- summary ---------------------------------------------------------------------------------


def _dist(values: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": int(a.max())}


def dataset_stats(out: Path) -> dict[str, Any]:
    """Statistics over every finished shard in ``out`` (the whole dataset, all runs)."""
    shards = sorted(Path(out).glob(SHARD_GLOB))
    cols = ["source", "prompt_len", "gen_len", "finish_reason"]
    tables = [pq.read_table(s, columns=cols) for s in shards]
    t = pa.concat_tables(tables) if tables else pa.table({c: [] for c in cols})
    prompt_len = t.column("prompt_len").to_pylist()
    gen_len = t.column("gen_len").to_pylist()
    finish = Counter(t.column("finish_reason").to_pylist())
    return {
        "shards": len(shards),
        "rows": t.num_rows,
        "gen_tokens": int(sum(gen_len)),
        "prompt_tokens": int(sum(prompt_len)),
        "prompt_len": _dist(prompt_len),
        "gen_len": _dist(gen_len),
        "total_len": _dist([a + b for a, b in zip(prompt_len, gen_len)]),
        "finish_reason": dict(finish),
        "truncated": int(finish.get("length", 0)),
        "rows_per_source": dict(Counter(t.column("source").to_pylist())),
    }


def _print_summary(s: dict[str, Any]) -> None:
    d, p = s["dataset"], s["prompts"]
    print(
        f"regenerate [{s['status']}]: {p['generated']} generated this run "
        f"({s['throughput']['gen_tokens_per_s']:.1f} tok/s), {p['done_before']} already done, "
        f"{p['too_long']} too long, {p['malformed']} malformed, {p['empty']} empty\n"
        f"  dataset: {d['rows']} rows in {d['shards']} shards, {d['gen_tokens']} generated tokens, "
        f"gen_len mean {d['gen_len']['mean']:.1f} p50 {d['gen_len']['p50']:.0f} "
        f"p90 {d['gen_len']['p90']:.0f} p99 {d['gen_len']['p99']:.0f}, "
        f"truncated {d['truncated']}\n  summary: {s['summary_path']}"
    )


# -- orchestration ---------------------------------------------------------------------------


def _load_tokenizer(target: str):
    from transformers import AutoTokenizer

    if not Path(target).exists():
        from dflash_lit.targets import build_hint

        hint = build_hint(target) or (
            " (the embedded tiny target is built by `python -m dflash_lit.tiny build`)")
        raise FileNotFoundError(
            f"target.path: {target} does not exist; pass target.path=<HF model/tokenizer dir>"
            + hint
        )
    try:
        return AutoTokenizer.from_pretrained(target)
    except Exception as e:
        raise UserError(f"target: cannot load a tokenizer from {target}: {e}") from e


def _target_vocab_size(target: str) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(target)
    return int(text_config(cfg).vocab_size)


def _generation_settings(cfg: Any, target: str, tokenizer: Any) -> GenerationSettings:
    g = cfg.generation
    stop_ids = eos_token_ids(target, tokenizer)
    for t in g.stop_token_ids or []:
        if int(t) not in stop_ids:
            stop_ids.append(int(t))
    if int(g.max_new_tokens) < 1:
        raise UserError(f"generation.max_new_tokens: must be >= 1, got {g.max_new_tokens}")
    return GenerationSettings(
        max_new_tokens=int(g.max_new_tokens),
        temperature=float(g.temperature),
        top_p=float(g.top_p),
        top_k=int(g.top_k),
        stop=[str(s) for s in (g.stop or [])],
        stop_token_ids=stop_ids,
        eos_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (
            stop_ids[0] if stop_ids else None),
        seed=int(cfg.seed),
    )


def target_fingerprint(target: str) -> str:
    """sha256 over the target's small config/tokenizer files (not the weights, not the path).

    Resume compares it, so a moved checkout still resumes but a different tokenizer or model
    config does not silently mix into the same shards.
    """
    h = hashlib.sha256()
    for name in FINGERPRINT_FILES:
        f = Path(target) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def run(cfg: Any) -> dict[str, Any]:
    """Regenerate completions as configured by ``conf/regenerate.yaml``; return the summary."""
    from omegaconf import OmegaConf

    t_start = time.time()
    target_path = OmegaConf.select(cfg, "target.path", throw_on_missing=False)
    if not target_path:
        raise UserError(
            "target.path: not set (a target built in memory has no tokenizer); pass "
            "target.path=<HF model/tokenizer dir>"
        )
    if OmegaConf.is_missing(cfg, "sources"):
        raise UserError("sources: missing; pass sources='[{path: prompts.jsonl, field: prompt}]'")
    target = str(target_path)
    strict = bool(cfg.strict)
    tokenizer = _load_tokenizer(target)
    check_tokenizer_fits(tokenizer, _target_vocab_size(target), f"target.path={target}",
                         "put the target's own tokenizer files in that directory")
    use_chat = resolve_chat(cfg.chat, tokenizer, target)
    sources = parse_sources(OmegaConf.to_container(cfg.sources, resolve=True))
    for i, s in enumerate(sources):
        if s.is_chat and not use_chat:
            raise UserError(
                f"sources[{i}] ({s.name}): field 'messages' needs a chat template but chat is off "
                f"(chat={cfg.chat}, tokenizer at {target}); use a tokenizer with a template"
            )
    gen = _generation_settings(cfg, target, tokenizer)
    chat_kwargs = OmegaConf.to_container(cfg.chat_template_kwargs, resolve=True) or {}
    renderer = PromptRenderer(tokenizer, use_chat, cfg.system_prompt, chat_kwargs)
    settings = {
        "target": target_fingerprint(target),
        "tokenizer": tokenizer_fingerprint(tokenizer),  # training refuses these ids for another
        **renderer.settings(),
        "generation": {k: getattr(gen, k) for k in ("max_new_tokens", "temperature", "top_p",
                                                     "top_k", "stop", "stop_token_ids")},
    }

    pools, load_stats = [], {}
    for s in sources:
        prompts, st = load_source(s, strict=strict)
        pools.append(prompts)
        load_stats[s.name] = st

    out = Path(str(cfg.out))
    writer = ShardWriter(out, int(cfg.rows_per_shard), settings)
    try:
        record = repo_relative(OmegaConf.to_container(cfg, resolve=True))
        (out / "regenerate_config.yaml").write_text(OmegaConf.to_yaml(record))
    except Exception:  # e.g. a ${hydra:...} key outside a Hydra app: the copy is only a record
        pass
    done = set(writer.done_ids)
    max_prompt = cfg.max_prompt_tokens
    per_source = {s.name: Counter() for s in sources}
    requests: dict[str, GenRequest] = {}

    def accept(p: Prompt) -> bool:
        c = per_source[p.source]
        if p.id in done:  # accepted the first time: keeps the seeded selection identical
            c["done_before"] += 1
            return True
        try:
            text, ids, messages = renderer(p)
        except Exception as e:  # jinja errors from a template (roles must alternate, ...)
            if strict:
                raise PromptError(f"{p.origin}: chat template failed: {e} (strict=true)") from e
            log.warning("skipping prompt %s: chat template failed: %s", p.origin, e)
            c["malformed"] += 1
            return False
        if max_prompt is not None and len(ids) > int(max_prompt):
            c["too_long"] += 1
            return False
        requests[p.id] = GenRequest(p.id, p.source, ids, text, messages)
        return True

    num = None if cfg.num_prompts is None else int(cfg.num_prompts)
    selected, mix_stats = mix(pools, sources, num, int(cfg.seed), accept)
    todo = [requests[p.id] for p in selected if p.id not in done]
    log.info("regenerate: %d prompts selected, %d already done, %d to generate",
             len(selected), len(selected) - len(todo), len(todo))

    backend_name = str(cfg.backend)
    status, gen_tokens, generated, backend_stats = "ok", 0, 0, {}
    t_gen = time.time()
    try:
        if todo:
            from tqdm import tqdm

            backend = make_backend(backend_name, cfg, target, tokenizer, gen)
            t_gen = time.time()
            with tqdm(total=len(todo), unit="prompt", desc="regenerate", dynamic_ncols=True,
                      disable=not bool(cfg.progress)) as bar:
                try:
                    for res in backend.generate(todo):
                        req = requests[res.id]
                        writer.add(make_row(req, res.gen_ids, res.finish_reason, backend.name))
                        generated += 1
                        gen_tokens += len(res.gen_ids)
                        per_source[req.source]["generated"] += 1
                        rate = gen_tokens / max(time.time() - t_gen, 1e-9)
                        bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
                        bar.update(1)
                finally:
                    backend_stats = backend.stats()
    except BaseException as e:
        status = f"failed: {type(e).__name__}"
        raise
    finally:
        writer.flush()  # keep whatever finished, even on failure
        try:
            summary = _summary(
                out, status, target, backend_name, sources, load_stats, mix_stats, per_source,
                selected, generated, gen_tokens, t_start, t_gen, backend_stats, writer,
            )
        except Exception:
            if status == "ok":
                raise
            log.exception("regenerate: could not write summary.json after the failure")
        if status != "ok":
            log.error("regenerate failed; %d rows kept in %d shards under %s (rerun to resume)",
                      len(writer.done_ids), len(list(out.glob(SHARD_GLOB))), out)
    _print_summary(summary)
    return summary


def _run_history(path: Path, generated: int, gen_tokens: int, generation_s: float,
                 status: str) -> list[dict]:
    """Every run that added rows to ``out``: the previous summary's list plus this run (a
    resume that finds nothing left to do adds nothing), so no run's throughput is lost."""
    runs: list[dict] = []
    if path.is_file():
        try:
            prev = json.loads(path.read_text())
        except (OSError, ValueError):
            prev = {}
        runs = list(prev.get("runs") or [])
        if not runs and prev.get("prompts", {}).get("generated"):  # written before the history
            runs = [{"generated": prev["prompts"]["generated"],
                     "gen_tokens": prev.get("tokens", {}).get("generated_this_run"),
                     "gen_tokens_per_s": prev.get("throughput", {}).get("gen_tokens_per_s"),
                     "status": prev.get("status")}]
    if generated:
        runs.append({"generated": generated, "gen_tokens": gen_tokens,
                     "gen_tokens_per_s": gen_tokens / generation_s, "status": status})
    return runs


def _summary(out, status, target, backend_name, sources, load_stats, mix_stats, per_source,
             selected, generated, gen_tokens, t_start, t_gen, backend_stats, writer) -> dict:
    elapsed_gen = max(time.time() - t_gen, 1e-9)
    ds = dataset_stats(out)
    sources_out = {}
    for s in sources:
        c, st = per_source[s.name], load_stats[s.name]
        sources_out[s.name] = {
            **st.to_dict(),
            "weight": s.weight,
            "selected": mix_stats.selected.get(s.name, 0),
            "done_before": c["done_before"],
            "generated": c["generated"],
            "too_long": c["too_long"],
            "template_failed": c["malformed"],
            "rows": ds["rows_per_source"].get(s.name, 0),
        }
    tot = lambda k: sum(v[k] for v in sources_out.values())  # noqa: E731
    summary = {
        "status": status,
        "out": str(out),
        "target": target,
        "backend": backend_name,
        "prompts": {
            "requested": mix_stats.requested,
            "selected": len(selected),
            "done_before": tot("done_before"),
            "generated": generated,
            "too_long": tot("too_long"),
            "malformed": tot("malformed") + tot("template_failed"),
            "empty": tot("empty"),
            "records": tot("records"),
        },
        "tokens": {"generated_this_run": gen_tokens},
        "throughput": {
            "elapsed_s": time.time() - t_start,
            "generation_s": elapsed_gen if generated else 0.0,
            "gen_tokens_per_s": gen_tokens / elapsed_gen if generated else 0.0,
        },
        "dataset": {k: v for k, v in ds.items() if k != "rows_per_source"},
        "runs": _run_history(Path(out) / "summary.json", generated, gen_tokens,
                             elapsed_gen, status),
        "per_source": sources_out,
        "backend_stats": backend_stats,
        "shards_written_this_run": [p.name for p in writer.written],
        "summary_path": str(Path(out) / "summary.json"),
    }
    summary = repo_relative(summary)  # a shipped record: no build-machine paths
    data = json.dumps(summary, indent=2).encode()
    atomic_write(Path(out) / "summary.json", lambda f: f.write(data), what="summary")
    return summary
