"""Run every evaluation method over a prompt set and write report.json / summary.md / a plot.

τ of a method = all committed tokens of its speculative steps / number of steps (pooled over
prompts; the prefill's first token belongs to no step). Every method's output is compared
with the target's greedy decode (``baseline``); any difference is a losslessness failure.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_lit.errors import UserError
from dflash_lit.eval.model_free import NGRAM_RULES, SuffixIndex
from dflash_lit.eval.offline import offline_streak
from dflash_lit.eval.speculative import (
    GenerationResult,
    chain_generate,
    first_mismatch,
    hybrid_generate,
    ngram_generate,
    suffix_generate,
    suffix_tree_generate,
    target_greedy,
    tree_generate,
)
from dflash_lit.eval.suffix_engine import EngineSuffix, SuffixSettings
from dflash_lit.eval.target_runner import TargetRunner
from dflash_lit.eval.verify_cost import Trimmer
from dflash_lit.eval.verify_cost import measure as measure_verify_cost
from dflash_lit.model.drafter import DFlashDrafter

METHODS = ("chain", "tree", "ngram", "suffix", "suffix_tree", "hybrid", "merged", "baseline")
MODEL_FREE = ("ngram", "suffix", "suffix_tree")  # the baselines a user gets without training anything
TREE_SUFFIX_KEYS = ("suffix_tree", "hybrid", "merged")  # methods that keep a global SuffixIndex


class LosslessError(RuntimeError):
    """A speculative method's output differs from the target's greedy decode."""


@dataclass
class EvalSettings:
    """What to run; validated before any model is loaded."""

    methods: list[str] = field(default_factory=lambda: list(METHODS))
    budgets: list[int] = field(default_factory=lambda: [4, 8, 16, 32])
    max_new_tokens: int = 256
    block_size: int | None = None  # None: the drafter's trained block size
    tree_top_k: int | None = None  # None: min(budget, vocab)
    ngram_n_max: int = 3
    ngram_n_min: int = 1
    ngram_rule: str = "earliest"  # vLLM's; "latest" = the most recent occurrence
    ngram_tokens: int = 15  # n-gram tokens drafted per step (vLLM num_speculative_tokens)
    suffix: SuffixSettings = field(default_factory=SuffixSettings)  # vLLM's suffix decoding
    suffix_budget: int = 16  # suffix_tree: draft tree nodes per step
    suffix_tree_depth: int = 15  # suffix_tree: deepest draft node, also the suffix half of hybrids
    suffix_depth: int = 32  # suffix_tree: longest substring the suffix indexes count
    suffix_min_prob: float = 0.1  # suffix_tree: drop draft nodes whose path probability is below this
    offline_streak: bool = False
    warmup: bool = True
    trim_drafts: bool = False  # per step, verify only the draft prefix worth this machine's verify cost

    def validate(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise UserError(f"methods={list(self.methods)}: unknown {bad}; choose from {list(METHODS)}")
        for m in ("tree", "hybrid", "merged"):
            if m in self.methods and not self.budgets:
                raise UserError(f"budgets=[]: method {m} needs at least one node budget (e.g. [4, 8])")
        for b in self.budgets:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise UserError(
                    f"budgets={list(self.budgets)}: budget {b!r} is invalid; a DDTree node "
                    "budget (root excluded) must be an int >= 1"
                )
        if len(set(self.budgets)) != len(self.budgets):
            raise UserError(f"budgets={list(self.budgets)} lists a budget twice")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens={self.max_new_tokens!r}: must be an int >= 1")
        if self.block_size is not None and self.block_size < 2:
            raise UserError(f"block_size={self.block_size}: need >= 2 (anchor + one draft) or null")
        if self.ngram_rule not in NGRAM_RULES:
            raise UserError(f"ngram.rule={self.ngram_rule!r}: choose one of {list(NGRAM_RULES)}")
        self.suffix.validate()
        if self.suffix_budget < 1 or self.suffix_depth < 2 or not 0 < self.suffix_min_prob <= 1:
            raise UserError(
                f"suffix_tree: budget={self.suffix_budget}, depth={self.suffix_depth}, min_prob="
                f"{self.suffix_min_prob}: need budget >= 1, depth >= 2, 0 < min_prob <= 1"
            )
        if not 1 <= self.ngram_n_min <= self.ngram_n_max:
            raise UserError(
                f"ngram n_min={self.ngram_n_min}, n_max={self.ngram_n_max}: need 1 <= n_min <= n_max"
            )
        for key, v in (("ngram.num_speculative_tokens", self.ngram_tokens),
                       ("suffix_tree.max_tree_depth", self.suffix_tree_depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"{key}={v!r}: tokens drafted per step, must be an int >= 1")

    def method_keys(self) -> list[str]:
        keys = []
        for m in self.methods:
            if m in ("tree", "hybrid", "merged"):
                keys += [f"{m}_b{b}" for b in self.budgets]
            elif m != "baseline":
                keys.append(m)
        return keys


def _run_method(key, target, drafter, ids, s: EvalSettings, eos, bs, max_new,
                index: SuffixIndex | EngineSuffix | None = None,
                vocab: torch.Tensor | None = None,
                trimmer: Trimmer | None = None,
                request_id: str = "0") -> GenerationResult:
    """One method on one prompt; ``index``: the suffix methods' global state of earlier
    outputs (``suffix``: the engine's cache, the others: a ``SuffixIndex``);
    ``vocab``: the drafter's draft vocabulary (None: the full vocab); ``trimmer``: the
    method's cost rule (``verify_cost``; None: verify whole drafts)."""
    if key == "chain":
        return chain_generate(target, drafter, ids, max_new, eos, block_size=s.block_size,
                              draft_vocab=vocab, trimmer=trimmer)
    if key == "ngram":
        return ngram_generate(target, ids, max_new, eos, block_size=s.ngram_tokens + 1,
                              n_max=s.ngram_n_max, n_min=s.ngram_n_min, rule=s.ngram_rule)
    if key == "suffix":
        return suffix_generate(target, ids, max_new, eos, engine=index or EngineSuffix(s.suffix),
                               request_id=request_id)
    suffix = {"depth": s.suffix_depth, "min_prob": s.suffix_min_prob, "global_index": index}
    if key == "suffix_tree":
        return suffix_tree_generate(target, ids, max_new, eos, block_size=s.suffix_tree_depth + 1,
                                    budget=s.suffix_budget, trimmer=trimmer, **suffix)
    method, budget = key.rsplit("_b", 1)
    if method == "tree":
        return tree_generate(target, drafter, ids, max_new, int(budget), eos,
                             block_size=s.block_size, top_k=s.tree_top_k, draft_vocab=vocab,
                             trimmer=trimmer)
    return hybrid_generate(target, drafter, ids, max_new, int(budget), eos,
                           block_size=s.block_size, top_k=s.tree_top_k, merge=method == "merged",
                           draft_vocab=vocab, suffix_slots=s.suffix_tree_depth, trimmer=trimmer,
                           **suffix)


def run_evaluation(
    target: torch.nn.Module,
    drafter: DFlashDrafter,
    prompts: Sequence[tuple[str, list[int]]],
    settings: EvalSettings,
    eos_ids: Sequence[int] = (),
    progress: bool = True,
    draft_vocab: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Evaluate ``drafter`` on ``prompts`` [(id, token ids)]; returns the report dict.
    ``draft_vocab``: token ids the drafter's methods draft over (None: the full vocab).

    Never raises on a losslessness failure: the report's ``lossless`` / ``mismatches`` say it
    (``check_lossless`` raises), so the caller can write the report first.
    """
    settings.validate()
    bs = int(settings.block_size or drafter.config.block_size)
    keys = settings.method_keys()
    eos = [int(e) for e in eos_ids]
    cost = None
    if settings.trim_drafts and prompts:  # this machine's verify cost, once per evaluation
        cost = measure_verify_cost(TargetRunner(target), prompts[0][1])
    trimmers = {k: Trimmer(cost) for k in keys if cost is not None and k not in ("ngram", "suffix")}
    if settings.warmup and prompts:  # first-call costs (allocator, kernels) off the clock
        ids = prompts[0][1]
        target_greedy(target, ids, min(8, settings.max_new_tokens), eos)
        for k in keys:
            _run_method(k, target, drafter, ids, settings, eos, bs, min(8, settings.max_new_tokens),
                        vocab=draft_vocab, trimmer=Trimmer(cost) if k in trimmers else None)
    results: dict[str, list[GenerationResult]] = {k: [] for k in ["baseline", *keys]}
    # suffix methods also draft from the outputs already served (a global cache), per method;
    # ``suffix`` keeps the engine's own cache, which records each response as it is generated
    indexes: dict[str, SuffixIndex | EngineSuffix] = {
        k: SuffixIndex(settings.suffix_depth) for k in keys if k.startswith(TREE_SUFFIX_KEYS)}
    if "suffix" in keys:
        indexes["suffix"] = EngineSuffix(settings.suffix)
    per_prompt: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    offline: list[Any] = []
    t_start = time.perf_counter()
    it = prompts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(prompts, desc="evaluate", unit="prompt")
    for n, (pid, ids) in enumerate(it):
        ref = target_greedy(target, ids, settings.max_new_tokens, eos)
        results["baseline"].append(ref)
        row: dict[str, Any] = {"id": pid, "prompt_tokens": len(ids), "generated_tokens": len(ref.tokens)}
        for k in keys:
            r = _run_method(k, target, drafter, ids, settings, eos, bs, settings.max_new_tokens,
                            indexes.get(k), draft_vocab, trimmers.get(k), request_id=str(n))
            results[k].append(r)
            row[k] = r.acceptance_lengths
            pos = first_mismatch(r.tokens, ref.tokens)
            if pos is not None:
                mismatches.append({
                    "prompt_id": pid, "method": k, "position": pos,
                    "expected": ref.tokens[pos] if pos < len(ref.tokens) else None,
                    "got": r.tokens[pos] if pos < len(r.tokens) else None,
                })
        for index in indexes.values():
            if isinstance(index, SuffixIndex):
                index.extend(ref.tokens)
                index.end_sequence()
        if settings.offline_streak:
            off = offline_streak(target, drafter, ids, ref.tokens, block_size=bs)
            offline.append(off)
            row["offline_streaks"] = off.streaks
        per_prompt.append(row)
    wall = time.perf_counter() - t_start
    report: dict[str, Any] = {
        "num_prompts": len(prompts),
        "block_size": bs,
        "lossless": not mismatches,
        "mismatches": mismatches,
        "methods": {k: summarize(v, results["baseline"]) for k, v in results.items()},
        "per_prompt": per_prompt,
        "wall_time_s": wall,
        "settings": asdict(settings),
        "draft_vocab": None if draft_vocab is None else len(draft_vocab),
        "verify_cost": None if cost is None else cost.to_dict(),
    }
    m = report["methods"]
    report["tau_chain"] = m["chain"]["tau"] if "chain" in m else None
    report["tau_tree"] = {str(b): m[f"tree_b{b}"]["tau"] for b in settings.budgets if f"tree_b{b}" in m}
    report["tau_ngram"] = m["ngram"]["tau"] if "ngram" in m else None
    report["best_model_free"] = best_model_free(m)
    if settings.offline_streak:
        streaks = [s for o in offline for s in o.streaks]
        correct = [sum(o.slot_correct[k] for o in offline) for k in range(bs - 1)]
        valid = [sum(o.slot_valid[k] for o in offline) for k in range(bs - 1)]
        mean = sum(streaks) / len(streaks) if streaks else float("nan")
        report["offline"] = {
            "streak": mean, "tau_offline": mean + 1, "blocks": len(streaks),
            "slot_acc": [c / v if v else None for c, v in zip(correct, valid)],
            "tau_chain": report["tau_chain"],
        }
    return strict_json(report)


def best_model_free(methods: dict[str, Any]) -> str | None:
    """The model-free method (n-gram, suffix) with the most tokens/s in this run: the baseline
    every "× model-free" ratio is against."""
    cands = [k for k in MODEL_FREE if k in methods and methods[k]["tokens_per_s"] is not None]
    return max(cands, key=lambda k: methods[k]["tokens_per_s"]) if cands else None


def summarize(rs: list[GenerationResult], baseline: list[GenerationResult]) -> dict[str, Any]:
    """Pooled statistics of one method over all prompts."""
    base_tps = sum(len(r.tokens) for r in baseline) / max(sum(r.wall_time for r in baseline), 1e-12)
    slots = max((len(r.slot_accepts) for r in rs), default=0)
    acc = [sum(r.slot_accepts[k] for r in rs if k < len(r.slot_accepts)) for k in range(slots)]
    att = [sum(r.slot_attempts[k] for r in rs if k < len(r.slot_attempts)) for k in range(slots)]
    return {
        **pooled_stats([r.acceptance_lengths for r in rs], sum(len(r.tokens) for r in rs),
                       sum(r.wall_time for r in rs), base_tps,
                       sum(r.target_forwards for r in rs), acc, att,
                       sum(d for r in rs for d in r.draft_lengths)),
        "recomputed": any(r.recomputed for r in rs),
    }


def pooled_stats(step_taus: list[list[int]], tokens: int, wall: float, base_tps: float | None,
                 target_forwards: int, slot_accepts: list[int], slot_attempts: list[int],
                 drafted: int) -> dict[str, Any]:
    """A method's report fields from each prompt's per-step τ and the pooled counts (in-process
    and engine evaluations alike)."""
    taus = [t for per in step_taus for t in per]
    per_prompt = [sum(per) / len(per) for per in step_taus if per]
    tps = tokens / wall if wall > 0 else float("nan")
    return {
        "tau": sum(taus) / len(taus) if taus else None,
        "tau_per_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "steps": len(taus),
        "tokens": tokens,
        "wall_time_s": wall,
        "tokens_per_s": tps,
        "speedup": tps / base_tps if base_tps else None,
        "target_forwards": target_forwards,
        "slot_accepts": slot_accepts,
        "slot_attempts": slot_attempts,
        "slot_accept_rate": [a / t if t else None for a, t in zip(slot_accepts, slot_attempts)],
        "tau_histogram": {str(t): n for t, n in sorted(Counter(taus).items())},
        "mean_draft_length": drafted / len(taus) if taus else None,
    }


def strict_json(obj: Any) -> Any:
    """NaN/inf -> None so report.json is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [strict_json(v) for v in obj]
    return obj


def check_lossless(report: dict[str, Any]) -> None:
    """Raise ``LosslessError`` naming prompt id, method and first differing position."""
    mm = report.get("mismatches") or []
    if mm:
        lines = [
            f"prompt {m['prompt_id']}: method {m['method']} differs from target greedy at output "
            f"position {m['position']} (expected {m['expected']}, got {m['got']})"
            for m in mm[:10]
        ]
        more = f" (+{len(mm) - 10} more)" if len(mm) > 10 else ""
        raise LosslessError("speculative output is not lossless:\n  " + "\n  ".join(lines) + more)


# --------------------------------------------------------------------------- outputs
def write_outputs(report: dict[str, Any], out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    """report.json, summary.md and (``plot``) acceptance.png under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report": out / "report.json", "summary": out / "summary.md"}
    paths["report"].write_text(json.dumps(report, indent=2) + "\n")
    paths["summary"].write_text(summary_markdown(report))
    if plot:
        paths["plot"] = out / "acceptance.png"
        plot_acceptance(report, paths["plot"])
    return paths


def _fmt(x: Any, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def vs_best_text(report: dict[str, Any], method: str) -> str:
    """``method``'s tokens/s over the strongest model-free method's: an engine report's paired
    per-round ratio (median, with its range over several rounds), else the plain ratio."""
    r = (report.get("vs_best") or {}).get(method)
    if r is None:
        best = report["methods"][report["best_model_free"]]
        return f"{report['methods'][method]['tokens_per_s'] / best['tokens_per_s']:.2f}x"
    band = f" [{r['min']:.2f}-{r['max']:.2f}]" if r["rounds"] > 1 else ""
    return f"{r['median']:.2f}x{band}"


def summary_markdown(report: dict[str, Any]) -> str:
    """A Markdown table: τ, tokens/s and speedup per method, plus per-slot acceptance."""
    s = report["settings"]
    lines = [
        "# Speculative decoding evaluation",
        "",
        f"- prompts: {report['num_prompts']}, max_new_tokens: {s['max_new_tokens']}, "
        f"block size: {report['block_size']}",
        f"- lossless: **{'yes' if report['lossless'] else 'NO'}**"
        + ("" if report["lossless"] else f" ({len(report['mismatches'])} mismatches)"),
        "",
    ]
    eng = report.get("engine")
    if eng:
        reps = eng.get("repeats", 1)
        lines += [f"- served by **{eng['name']} {eng['version']}** ({eng['dtype']}; every method "
                  "in a fresh engine; chain = vLLM's dflash method with the exported drafter); "
                  f"tokens/s below at concurrency {eng['tokens_per_s_measured_at']}"
                  + (f"; {reps} rounds: tokens/s and speedups are medians, ratios the median "
                     "[min-max] of the ratios within each round" if reps > 1 else ""), ""]
    best = report.get("best_model_free")
    ref = report["methods"].get(best) if best else None
    if best:
        lines += [f"- strongest model-free baseline in this run (most tokens/s): **{best}**"
                  + (f" (rule {s['ngram_rule']})" if best == "ngram" else ""), ""]
    lines += [
        "| method | τ | τ (per-prompt mean) | steps | tokens/s | speedup | vs " + (best or "-")
        + " (τ / tokens/s) | target forwards |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, m in report["methods"].items():
        tau = "1 (by definition)" if k == "baseline" else _fmt(m["tau"])
        vs = "-"
        if ref and k != "baseline" and m["tau"] and ref["tau"] and ref["tokens_per_s"]:
            vs = f"{m['tau'] / ref['tau']:.2f}x / {vs_best_text(report, k)}"
        lines.append(
            f"| {k} | {tau} | {_fmt(m['tau_per_prompt_mean'])} | {m['steps']} | "
            f"{_fmt(m['tokens_per_s'], 1)} | {_fmt(m['speedup'])}x | {vs} | {m['target_forwards']} |"
        )
    slot_methods = [k for k in report["methods"] if k != "baseline"]
    if slot_methods:
        n = max(len(report["methods"][k]["slot_accept_rate"]) for k in slot_methods)
        lines += ["", "Per-slot acceptance rate (slot k accepted / steps where it could be verified):",
                  "", "| method | " + " | ".join(str(k + 1) for k in range(n)) + " |",
                  "|---|" + "---|" * n]
        for k in slot_methods:
            rates = report["methods"][k]["slot_accept_rate"]
            lines.append(f"| {k} | " + " | ".join(_fmt(r) for r in rates) + " |")
    if eng and len(eng["concurrency"]) > 1:
        lines += ["", "Tokens/s by requests in flight (speedup over the engine without speculation):",
                  "", "| method | " + " | ".join(f"concurrency {c}" for c in eng["concurrency"]) + " |",
                  "|---|" + "---|" * len(eng["concurrency"])]
        for k in report["methods"]:
            cells = [eng["concurrency"][c].get(k) for c in eng["concurrency"]]
            lines.append(f"| {k} | " + " | ".join(
                "-" if c is None else f"{_fmt(c['tokens_per_s'], 1)} ({_fmt(c['speedup'])}x)"
                for c in cells) + " |")
    off = report.get("offline")
    if off:
        lines += ["", f"Offline (teacher-forced, every anchor): streak {_fmt(off['streak'])}, "
                      f"τ_offline {_fmt(off['tau_offline'])} vs online τ_chain {_fmt(off['tau_chain'])} "
                      f"over {off['blocks']} blocks."]
    lines += ["", f"Wall time: {_fmt(report['wall_time_s'], 1)} s", ""]
    return "\n".join(lines)


def plot_acceptance(report: dict[str, Any], path: str | Path) -> None:
    """Histogram of τ per method and the per-slot acceptance curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = {k: m for k, m in report["methods"].items() if k != "baseline" and m["steps"]}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    bs = report["block_size"]
    width = 0.8 / max(len(methods), 1)
    for i, (k, m) in enumerate(methods.items()):
        xs = list(range(1, bs + 1))
        total = max(m["steps"], 1)
        ys = [m["tau_histogram"].get(str(x), 0) / total for x in xs]
        ax1.bar([x + (i - (len(methods) - 1) / 2) * width for x in xs], ys, width=width,
                label=f"{k} (τ={_fmt(m['tau'])})")
        rates = m["slot_accept_rate"]
        ax2.plot(range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates],
                 marker="o", label=k)
    ax1.set(xlabel="acceptance length τ per step", ylabel="share of steps", title="τ histogram")
    ax2.set(xlabel="draft slot / tree depth", ylabel="acceptance rate", ylim=(0, 1.02),
            title="per-slot acceptance")
    ax1.set_xticks(range(1, bs + 1) if bs <= 20 else range(1, bs + 1, max(1, bs // 10)))
    ax2.set_xticks(range(1, bs) if bs <= 20 else range(1, bs, max(1, bs // 10)))
    for ax in (ax1, ax2):
        if methods:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
