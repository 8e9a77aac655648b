"""Real acceptance length during training: speculative decoding with the current weights.

The offline streak (teacher-forced, on the training layout) can look healthy while real
acceptance collapses, so every ``every_n_steps`` steps and at the last step this callback
decodes ``num_prompts`` held-out prompts greedily against the target — chain, one DDTree
budget, and the model-free baselines on the same prompts (computed once: n-gram with vLLM's
rule and suffix decoding) — and logs per drafter:

- ``val/<name>/tau_chain``, ``val/<name>/tau_tree_b<b>``, ``val/tau_ngram``, ``val/tau_suffix``,
  ``val/tau_model_free`` (the larger of the two);
- ``val/<name>/tau_chain_vs_model_free`` (the ratio a user should watch: > 1 beats what a
  user gets without training) and ``val/<name>/tau_chain_vs_ngram``;
- ``val/<name>/chain_accept/<k>``: per-slot acceptance rate of the chain;
- ``val/<name>/lossless`` (1 = every output equal to the target's greedy decode);
- ``perf/real_tau_share``: this callback's share of the wall time so far.

Prompts are the prompt parts (the tokens before the first completion token) of the first
validation rows, so they are rendered exactly like the training data and need no tokenizer.
Runs on global rank 0 only; it reads no global RNG, so resume stays exact.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class RealAcceptance(Callback):
    """Logs real τ (chain, DDTree-``tree_budget``) and the n-gram baseline during training."""

    def __init__(self, every_n_steps: int = 250, num_prompts: int = 6, max_new_tokens: int = 64,
                 tree_budget: int = 16, min_prompt_tokens: int = 4) -> None:
        if every_n_steps < 1 or num_prompts < 1 or max_new_tokens < 1 or tree_budget < 1:
            raise ValueError(
                "callbacks.real_tau: every_n_steps, num_prompts, max_new_tokens and tree_budget "
                f"must be >= 1 (got {every_n_steps}, {num_prompts}, {max_new_tokens}, "
                f"{tree_budget})")
        self.every, self.num_prompts = int(every_n_steps), int(num_prompts)
        self.max_new, self.budget = int(max_new_tokens), int(tree_budget)
        self.min_prompt = int(min_prompt_tokens)
        self._model: Any = None
        self._prompts: list[tuple[str, list[int]]] | None = None
        self._ngram: dict[str, Any] | None = None
        self._spent = 0.0
        self._start = time.time()
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------ inputs
    def _target_model(self, pl_module) -> torch.nn.Module:
        """The HF target: the module's own (online) or loaded once (cached features)."""
        if self._model is None:
            inner = getattr(pl_module.target, "model", None)
            if inner is not None:
                self._model = inner
            else:
                info = pl_module.target_info
                if info.get("path"):
                    from transformers import AutoModelForCausalLM

                    self._model = AutoModelForCausalLM.from_pretrained(
                        info["path"], dtype=pl_module.target.dtype).eval()
                else:
                    from omegaconf import OmegaConf

                    from dflash_lit.train.build import _build_random

                    self._model = _build_random(OmegaConf.create(info["build"])).eval()
                self._model.to(pl_module.device).requires_grad_(False)
        return self._model

    def _prompt_ids(self, trainer: L.Trainer) -> list[tuple[str, list[int]]]:
        if self._prompts is None:
            dm = trainer.datamodule
            data = getattr(dm, "val_dataset", None)
            if data is None or len(data) == 0:
                data = dm.train_dataset
            prompts = []
            for i in range(len(data)):
                row = data[i]
                done = [j for j, m in enumerate(row["loss_mask"].tolist()) if m]
                cut = done[0] if done else len(row["input_ids"])
                if cut >= self.min_prompt:
                    prompts.append((f"row{i}", [int(t) for t in row["input_ids"][:cut]]))
                if len(prompts) == self.num_prompts:
                    break
            self._prompts = prompts
        return self._prompts

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer, pl_module) -> None:
        from dflash_lit.eval.suffix_engine import require_cache

        # the suffix baseline needs arctic-inference: say so before the first step, not at step N
        require_cache("callbacks.real_tau (drop it with ~callbacks.real_tau)")

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.time()
        self._spent = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        last = step >= getattr(pl_module, "total_steps", float("inf"))
        if step > 0 and (step % self.every == 0 or last) and trainer.is_global_zero:
            self.measure(trainer, pl_module)

    @torch.no_grad()
    def measure(self, trainer, pl_module) -> dict[str, float]:
        """Decode the prompts with every drafter; log and return the figures."""
        from dflash_lit.eval.report import EvalSettings, run_evaluation

        t0 = time.time()
        model, prompts = self._target_model(pl_module), self._prompt_ids(trainer)
        if not prompts:
            return {}
        out: dict[str, float] = {}
        if self._ngram is None:  # the baselines do not change with training: once
            first = next(iter(pl_module.drafters.values()))
            rep = run_evaluation(model, first, prompts, EvalSettings(
                methods=["ngram", "suffix"], max_new_tokens=self.max_new, warmup=False),
                progress=False)
            self._ngram = {"tau": rep["tau_ngram"], "suffix": rep["methods"]["suffix"]["tau"],
                           "lossless": rep["lossless"]}
        out["val/tau_ngram"] = float(self._ngram["tau"])
        out["val/tau_suffix"] = float(self._ngram["suffix"])
        out["val/tau_model_free"] = max(out["val/tau_ngram"], out["val/tau_suffix"])
        for name, drafter in pl_module.drafters.items():
            was_training = drafter.training
            rep = run_evaluation(model, drafter, prompts, EvalSettings(
                methods=["chain", "tree"], budgets=[self.budget], max_new_tokens=self.max_new,
                warmup=False), progress=False)
            drafter.train(was_training)
            chain = rep["methods"]["chain"]
            out[f"val/{name}/tau_chain"] = float(rep["tau_chain"])
            out[f"val/{name}/tau_tree_b{self.budget}"] = float(rep["tau_tree"][str(self.budget)])
            out[f"val/{name}/tau_chain_vs_ngram"] = float(rep["tau_chain"]) / out["val/tau_ngram"]
            out[f"val/{name}/tau_chain_vs_model_free"] = (float(rep["tau_chain"])
                                                         / out["val/tau_model_free"])
            out[f"val/{name}/lossless"] = float(rep["lossless"] and self._ngram["lossless"])
            for k, r in enumerate(chain.get("slot_accept_rate") or [], start=1):
                if r is not None:
                    out[f"val/{name}/chain_accept/{k}"] = float(r)
        self._spent += time.time() - t0
        out["perf/real_tau_share"] = self._spent / max(time.time() - self._start, 1e-9)
        for lg in trainer.loggers:
            lg.log_metrics(out, step=trainer.global_step)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in out.items()})
        self.last = out
        return out
