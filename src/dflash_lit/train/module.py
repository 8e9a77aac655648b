"""The LightningModule: one frozen target forward per batch feeds every drafter.

- The target lives *outside* the module tree (not a submodule), so it is never in
  ``state_dict``, a checkpoint, or the optimizer; it is moved to the device in ``setup``.
- One optimizer (AdamW, or Muon + AdamW as one ``train/optim.py`` object) with param groups
  per drafter: automatic optimization, so ``global_step`` counts batches (manual
  optimization with K optimizers would count K per batch).
- Everything random per step (anchors, noise) derives from (seed, global_step, rank, drafter),
  so an exact resume needs no saved RNG state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from dflash_lit import checkpoint as ckpt_contract
from dflash_lit.compat import check_compatible
from dflash_lit.hashing import seed_from
from dflash_lit.model.block_forward import draft_hidden
from dflash_lit.model.drafter import DFlashDrafter
from dflash_lit.model.layout import (
    IGNORE,
    build_layout,
    gather_target_argmax,
    gather_target_logits,
)
from dflash_lit.model.target import FrozenTarget, TargetOutput
from dflash_lit.train.anchors import fixed_anchors, sample_anchors, step_generator
from dflash_lit.train.linear_ce import fused_head_loss, restrict_vocab
from dflash_lit.train.losses import build_loss, resolve_argmax_labels
from dflash_lit.train.metrics import DrafterMetrics, accuracy, streak
from dflash_lit.train.optim import MUON_SUFFIX, build_optimizer, group_drafter
from dflash_lit.train.plateau import PlateauDiagnostics, plateau_message
from dflash_lit.train.schedules import lr_factor, max_anchors_at, noise_sigma
from dflash_lit.train.spec import DrafterSpec, MuonSettings, capture_layer_ids


def _init_drafter(spec: DrafterSpec, seed: int) -> DFlashDrafter:
    """A drafter initialised from (seed, name) alone: the same weights whatever ran before
    (an online target build, a feature-cache build, other drafters)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_from("init", seed, spec.name))
        return DFlashDrafter(spec.model)


@dataclass(frozen=True)
class ModuleSettings:
    """Run-wide settings of ``DFlashModule`` (per-drafter ones are each ``DrafterSpec``'s).
    Defaults are the config's (``conf/train.yaml``, ``conf/optim/adamw.yaml``);
    ``train.run.module_settings`` reads them from a composed config."""

    total_steps: int  # optimizer steps the LR / noise / anchor schedules span
    warmup_frac: float = 0.04  # optim.warmup_frac
    min_lr_ratio: float = 0.0  # optim.min_lr_ratio
    betas: tuple[float, float] = (0.9, 0.95)  # optim.betas
    eps: float = 1e-8  # optim.eps
    muon: MuonSettings | None = None  # optim=muon; None: AdamW on everything
    attention: str = "auto"  # attention
    compile_mask: bool = False  # compile_mask (auto: on CUDA)
    seed: int = 0  # seed
    val_max_anchors: int = 64  # val_max_anchors
    log_tree_budgets: tuple[int, ...] = ()  # log_tree_budgets
    max_nonfinite_in_row: int = 10  # max_nonfinite_in_row
    head_dtype: torch.dtype | None = None  # fused lm_head matmul dtype (trainer.precision)
    loss_chunk_rows: int = 2048  # loss_chunk_rows


class DFlashModule(L.LightningModule):
    """Trains one or more DFlash drafters against a frozen target."""

    def __init__(
        self,
        target: FrozenTarget,
        specs: list[DrafterSpec],
        settings: ModuleSettings,
        target_info: dict[str, Any] | None = None,
        train_vocab: Tensor | None = None,
    ) -> None:
        """``target_info``: the target's identity, recorded in checkpoints; ``train_vocab``:
        token ids of the reduced training softmax (None: the full vocab)."""
        super().__init__()
        seed, log_tree_budgets = settings.seed, settings.log_tree_budgets
        if not specs:
            raise ValueError("drafters: at least one drafter is required")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"drafters: duplicate names {names}")
        object.__setattr__(self, "_target", target)  # not a submodule: never saved or optimised
        self.specs = {s.name: s for s in specs}
        self.drafters = nn.ModuleDict({s.name: _init_drafter(s, seed) for s in specs})
        for s in specs:
            self._check_drafter_vs_target(s)
        self.losses = {s.name: build_loss(**s.loss) for s in specs}
        self.total_steps = int(settings.total_steps)
        self.warmup_frac, self.min_lr_ratio = settings.warmup_frac, settings.min_lr_ratio
        self.betas, self.eps = tuple(settings.betas), settings.eps
        self.muon = settings.muon  # None: AdamW on everything (optim=adamw)
        self.attention, self.compile_mask = settings.attention, settings.compile_mask
        self.seed = int(seed)
        self.val_max_anchors = settings.val_max_anchors
        self.max_nonfinite_in_row = settings.max_nonfinite_in_row
        self.target_info = dict(target_info or {})
        # The union of all drafters' context layers is captured once per target forward.
        self.capture_ids = capture_layer_ids(specs)
        if list(target.layer_ids) != self.capture_ids:
            raise ValueError(
                f"target captures layers {list(target.layer_ids)}, the drafters need "
                f"{self.capture_ids}; build the target with layer_ids=capture_layer_ids(specs)"
            )
        self._layer_index = {
            s.name: [self.capture_ids.index(i) for i in s.model.target_layer_ids] for s in specs
        }
        # online: the target computes its logits when a loss needs their argmax or the full
        # distribution; only the composite/distill losses keep the distribution past the argmax
        self.need_logits = any(loss.needs_target_logits for loss in self.losses.values())
        self.need_distribution = any(loss.needs_target_distribution
                                     for loss in self.losses.values())
        # every loss runs fused with the frozen lm_head (linear_ce.fused_head_loss): matmuls
        # in head_dtype (bf16 where the machine measures it faster), the loss in fp32,
        # chunk_rows slots at a time
        self.head_dtype = settings.head_dtype
        self.loss_chunk_rows = int(settings.loss_chunk_rows)
        # training softmax of the fused losses over these ids ∪ each batch's labels (None =
        # the full vocab); validation uses the full vocab, evaluation may draft over these ids
        # (recorded in checkpoint["dflash"]["train_vocab"])
        if train_vocab is not None:
            dist = [n for n, lo in self.losses.items()
                    if lo.needs_target_distribution or not lo.fused]
            if dist:
                raise ValueError(f"train_vocab: drafters {dist} use a loss that needs the full "
                                 "distribution (only hard-label losses such as hard_ce and "
                                 "dpace run on a reduced vocab); set train_vocab=null")
        # derived from the data at every start: follows the module's device, not a state_dict entry
        self.register_buffer("train_vocab", train_vocab, persistent=False)
        bs = {s.name: s.model.block_size for s in specs}
        self.train_metrics = nn.ModuleDict({n: DrafterMetrics(bs[n]) for n in names})
        self.val_metrics = nn.ModuleDict(
            {n: DrafterMetrics(bs[n], tree_budgets=log_tree_budgets) for n in names}
        )
        self.val_plateau = nn.ModuleDict({n: PlateauDiagnostics() for n in names})
        self.plateau_warnings: dict[str, str] = {}  # drafter -> last validation's warning
        # Non-finite bookkeeping is saved in checkpoints (on_save_checkpoint).
        self.nonfinite_total = 0
        self.tokens_seen = 0  # real target tokens trained on (the x-axis for run comparisons)
        self.nonfinite_in_row = 0
        self.last_batch_stats: dict[str, float] = {}
        self.current_noise = {n: 0.0 for n in names}
        self.current_anchors = {n: self.specs[n].anchors.max for n in names}

    # ------------------------------------------------------------------ helpers
    @property
    def target(self) -> FrozenTarget:
        return self._target

    def _check_drafter_vs_target(self, s: DrafterSpec) -> None:
        check_compatible(s.model, self._target, f"drafters.{s.name} and the target")

    def schedules_at(self, step: int) -> None:
        """Set every drafter's noise σ and anchor count for ``step`` (pure functions)."""
        for n, s in self.specs.items():
            self.current_noise[n] = noise_sigma(
                step, self.total_steps, s.noise.peak, s.noise.final, s.noise.warmup_frac
            )
            start = s.anchors.start if s.anchors.start is not None else s.anchors.max
            self.current_anchors[n] = max_anchors_at(
                step, self.total_steps, start, s.anchors.max, s.anchors.ramp_frac
            )

    def _drafter_context(self, name: str, hidden: Tensor) -> Tensor:
        b, s, _ = hidden.shape
        d = self._target.hidden_size
        idx = self._layer_index[name]
        if idx == list(range(len(self.capture_ids))):
            return hidden
        return hidden.view(b, s, len(self.capture_ids), d)[:, :, idx].reshape(b, s, -1)

    def attention_backend(self, layout) -> str:
        """``attention=auto``: flex on CUDA, the blockwise path elsewhere (on CPU it runs
        torch's fused flash kernel over the context only: faster than the dense mask at every
        anchor count measured, bench/attention_layout.py)."""
        if self.attention != "auto":
            return self.attention
        return "flex" if layout.anchors.device.type == "cuda" else "blockwise"

    def _add_noise(self, name: str, x: Tensor, sigma: float, step: int) -> Tensor:
        if sigma <= 0:
            return x
        g = torch.Generator(device=x.device)
        g.manual_seed(seed_from("noise", self.seed, step, self.global_rank, name))
        if self.specs[name].noise.kind == "uniform":
            z = torch.rand(x.shape, generator=g, device=x.device, dtype=x.dtype) * 2 - 1
        else:
            z = torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)
        return x + sigma * z

    def _forward_drafter(self, name, batch, out, step, train: bool, need_logits: bool = False):
        """(argmax ids [B, N, Bs] or logits [B, N, Bs, V], layout with resolved labels,
        LossOutput). The fused path never forms the logits; ``need_logits`` forces
        them (offline tree metrics at validation)."""
        layout, _, hidden = self._draft(name, batch, out, step, train)
        return self._head_loss(name, layout, hidden, out, need_logits)

    def _draft(self, name, batch, out, step, train: bool):
        """(layout with resolved labels, drafter context features, final-normed drafter
        hidden states [B, N, Bs, d]) for one drafter on one batch."""
        spec = self.specs[name]
        ids, lm, am = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        th = self._drafter_context(name, out.hidden)
        if train:
            th = self._add_noise(name, th, self.current_noise[name], step)
            gen = step_generator(self.seed, step, self.global_rank, salt=f"anchors:{name}")
            anchors, valid = sample_anchors(lm, self.current_anchors[name], gen, am)
        else:
            anchors, valid = fixed_anchors(lm * am, self.val_max_anchors, seed=self.seed)
        layout = build_layout(ids, lm, anchors, valid, spec.model.block_size,
                              spec.model.mask_token_id, am)
        if self.losses[name].label_source == "target_argmax":
            layout.labels = resolve_argmax_labels(gather_target_argmax(out.argmax, layout),
                                                  layout.labels)
        return layout, th, self._drafter_hidden(name, th, layout)

    def _drafter_hidden(self, name: str, th: Tensor, layout) -> Tensor:
        return draft_hidden(self.drafters[name], self._target.embed_tokens, th, layout,
                            backend=self.attention_backend(layout), compile_mask=self.compile_mask)

    def _head_loss(self, name, layout, hidden, out, need_logits: bool):
        """(argmax ids [B, N, Bs] from the fused path, or logits [B, N, Bs, V] when
        ``need_logits`` or the loss cannot run fused; layout; LossOutput)."""
        loss = self.losses[name]
        if loss.fused and not need_logits:
            weight, labels, ids = self._target.lm_head.weight, layout.labels, None
            if self.training and self.train_vocab is not None:
                weight, labels, ids = restrict_vocab(weight, labels, self.train_vocab)
            loss_out, pred = fused_head_loss(
                loss, hidden.to(weight.dtype), weight, labels, out.logits,
                layout.target_positions() if loss.needs_target_distribution else None,
                self.loss_chunk_rows, self.head_dtype)
            if ids is not None:  # argmax ids back from the reduced vocab's numbering
                pred = torch.where(pred == IGNORE, pred, ids[pred.clamp_min(0)])
            return pred, layout, loss_out
        logits = self._target.lm_head(hidden.to(self._target.dtype))
        tgt = gather_target_logits(out.logits, layout) if out.logits is not None else None
        return logits, layout, loss.with_labels(logits, layout.labels, tgt)

    def _target_forward(self, batch) -> TargetOutput:
        """The target's captured layers and greedy ids: from the batch when the features are
        cached (``features=cache``), else from one frozen forward."""
        if "target_hidden" in batch:
            logits = None
            if self.need_distribution:
                logits = topk_logits_dense(batch["target_topk_ids"],
                                           batch["target_topk_logits"], self._target.vocab_size)
            return TargetOutput(hidden=batch["target_hidden"], logits=logits, layers=[],
                                argmax=batch["target_argmax"])
        out = self._target(
            batch["input_ids"], attention_mask=batch["attention_mask"], need_logits=self.need_logits
        )
        if out.logits is not None:
            out.argmax = out.logits.argmax(-1)
            if not self.need_distribution and bool(torch.isfinite(out.logits).all()):
                out.logits = None  # [B, S, V]: only its argmax is used (non-finite: kept for
                # the step's finiteness check)
        return out

    # ------------------------------------------------------------------ one step, for benchmarks
    def target_features(self, batch: dict[str, Tensor]) -> TargetOutput:
        """The target's captured layers and greedy ids for ``batch``, as a training step gets
        them (from a feature cache, or one frozen forward)."""
        return self._target_forward(batch)

    def drafter_losses(self, batch: dict[str, Tensor], out: TargetOutput, step: int,
                       materialise: bool = False) -> dict[str, tuple[Any, Any]]:
        """Each drafter's (layout, ``LossOutput``) on ``batch`` as the training step at
        ``step`` computes them (noise, anchors; call ``schedules_at(step)`` first), without
        logging or an optimizer step. ``materialise``: through the [B, N, Bs, V] logits (the
        path validation takes for tree metrics) instead of the fused lm_head."""
        return {n: self._forward_drafter(n, batch, out, step, train=True,
                                         need_logits=materialise)[1:] for n in self.drafters}

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        self._target.to(self.device)

    def on_fit_start(self) -> None:
        self._target.to(self.device)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int):
        step = self.global_step
        self.schedules_at(step)
        out = self._target_forward(batch)
        finite = bool(torch.isfinite(out.hidden).all()) and (
            out.logits is None or bool(torch.isfinite(out.logits).all())
        )
        total = torch.zeros((), device=self.device)
        per = {}
        if finite:
            for name in self.drafters:
                pred, layout, lo = self._forward_drafter(name, batch, out, step, train=True)
                per[name] = (pred, layout, lo)
                total = total + lo.loss
            finite = bool(torch.isfinite(total))
        finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            return self._skip_nonfinite(step)
        self.nonfinite_in_row = 0
        am = batch["attention_mask"]
        real = float(am.sum())
        self.last_batch_stats = {
            "target_tokens": real,
            "padded_tokens": float(am.numel()),
            "block_tokens": float(sum(int(v[1].valid.sum()) * v[1].block_size
                                      for v in per.values())),
        }
        first = next(iter(self.drafters))
        for name, (pred, layout, lo) in per.items():  # pred: argmax ids (or logits)
            self.train_metrics[name].update(pred.detach(), layout.labels, lo)
            pre = f"train/{name}"
            vals = {
                f"{pre}/loss": lo.loss.detach(),
                f"{pre}/acc": accuracy(pred, layout.labels).float(),
                f"{pre}/streak": streak(pred, layout.labels).float(),
                f"{pre}/noise": torch.tensor(self.current_noise[name]),
                f"{pre}/anchors": torch.tensor(float(self.current_anchors[name])),
            }
            self.log_dict(vals, on_step=True, on_epoch=False, prog_bar=False,
                          batch_size=int(layout.valid.sum()))
            if name == first:
                self.log("loss", lo.loss.detach(), prog_bar=True, on_step=True, on_epoch=False)
        self.log("train/loss_total", total.detach(), on_step=True, on_epoch=False)
        self.log("train/padding_eff", real / max(am.numel(), 1), on_step=True, on_epoch=False)
        self.tokens_seen += int(real) * self.trainer.world_size  # equal-count shards per rank
        # per-batch context for log analysis: does high loss go with long sequences?
        self.log("train/seq_len", real / max(am.shape[0], 1), on_step=True, on_epoch=False)
        self.log("train/tokens_seen", float(self.tokens_seen), on_step=True, on_epoch=False)
        return total

    def _skip_nonfinite(self, step: int):
        self.nonfinite_total += 1
        self.nonfinite_in_row += 1
        self.log("train/nonfinite_skipped", float(self.nonfinite_total), on_step=True)
        # overwrite this step's per-step values, else the logger repeats the last good ones
        nan = float("nan")
        for name in self.drafters:
            self.log_dict({f"train/{name}/{k}": nan for k in ("loss", "acc", "streak")},
                          on_step=True, on_epoch=False)
        self.log("train/loss_total", nan, on_step=True, on_epoch=False)
        msg = (f"non-finite target hidden states or loss at step {step}: batch skipped "
               f"({self.nonfinite_in_row} in a row, {self.nonfinite_total} total)")
        rank_zero_print(msg)
        return None  # no backward, no optimizer update: weights and Adam moments stay as they were

    def _stop_after_nonfinite(self) -> None:
        """Save ``last.ckpt`` at this step boundary, then end the run with the reason.

        Skipped steps change neither the weights nor the Adam moments, so the checkpoint holds
        the last good state; its data position is past the bad batches (a resume does not
        replay them) and every earlier periodic checkpoint is kept.
        """
        from dflash_lit.train.checkpointing import checkpoint_dir

        path = checkpoint_dir(self.trainer) / "last.ckpt"
        self.trainer.save_checkpoint(str(path))
        raise FloatingPointError(
            f"{self.nonfinite_in_row} non-finite steps in a row (limit "
            f"max_nonfinite_in_row={self.max_nonfinite_in_row}), {self.nonfinite_total} in all; "
            f"stopped at step {self.global_step}. {path} holds the last good weights and optimizer "
            "state (skipped steps change neither). Check the data and the target, lower the LR "
            "or noise, then resume with ckpt_path=last (or an earlier step*.ckpt)."
        )

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.nonfinite_in_row >= self.max_nonfinite_in_row:
            self._stop_after_nonfinite()
        interval = max(int(self.trainer.log_every_n_steps), 1)
        if (self.global_step % interval) == 0:
            for name, m in self.train_metrics.items():
                # compute() on every rank (it is a collective under DDP); empty -> NaN, dropped
                vals = {f"train_window/{name}/{k}": v for k, v in m.compute().items()}
                self.log_dict({k: float(v) for k, v in vals.items() if not _isnan(v)},
                              on_step=True, on_epoch=False)
                m.reset()

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self._target_forward(batch)
        for name in self.drafters:
            trees = bool(self.val_metrics[name].tree_budgets)
            layout, th, hidden = self._draft(name, batch, out, self.global_step, False)
            scores, _, lo = self._head_loss(name, layout, hidden, out, need_logits=trees)
            self.val_metrics[name].update(scores, layout.labels, lo)  # logits with trees
            pred = scores if scores.dim() == 3 else scores.argmax(-1)
            self._update_plateau(name, th, layout, hidden, pred)

    @torch.no_grad()
    def _update_plateau(self, name: str, th: Tensor, layout, hidden: Tensor, pred: Tensor,
                        spread_blocks: int = 32) -> None:
        """Plateau diagnostics: the same blocks drafted with the mask token in slot 0, and
        the slots' log-probabilities of the first ``spread_blocks`` full valid blocks."""
        import dataclasses

        masked = dataclasses.replace(layout, block_ids=layout.block_ids.clone())
        masked.block_ids[:, :, 0] = self.specs[name].model.mask_token_id
        w = self._target.lm_head.weight
        h_m = self._drafter_hidden(name, th, masked)
        pred_m = torch.cat([(c.to(w.dtype) @ w.T).argmax(-1) for c in
                            h_m.flatten(0, 2).split(self.loss_chunk_rows)]).view(pred.shape)
        vb = layout.valid & (layout.labels[..., 1:] != -100).all(-1)  # full blocks only
        sel = hidden.detach()[vb][:spread_blocks, 1:]  # [M, Bs-1, d]
        lp = torch.log_softmax((sel.to(w.dtype) @ w.T).float(), dim=-1)
        self.val_plateau[name].update(pred, pred_m, layout.labels, lp)

    def on_validation_epoch_end(self) -> None:
        for name, m in self.val_metrics.items():
            vals = m.compute()  # collective under DDP: every rank calls it
            diag = self.val_plateau[name].compute()
            vals.update(diag)
            self.log_dict({f"val/{name}/{k}": float(v) for k, v in vals.items()
                           if not _isnan(v)}, on_step=False, on_epoch=True, sync_dist=False)
            m.reset()
            self.val_plateau[name].reset()
            msg = plateau_message(name, float(diag["const_block_share"]),
                                  float(diag["anchor_sensitivity"]), float(diag["slot_spread"]))
            if msg:
                self.plateau_warnings[name] = msg
                rank_zero_print(f"step {self.global_step}: {msg}")
            else:
                self.plateau_warnings.pop(name, None)

    def configure_optimizers(self):
        opt = build_optimizer(self.drafters, self.specs, self.betas, self.eps, self.muon)
        total, warm, floor = self.total_steps, self.warmup_frac, self.min_lr_ratio
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, total, warm, floor)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        """Per-drafter gradient clipping and norm logging (grads are unscaled here): one norm
        over all of a drafter's groups (with optim=muon, its Muon and its AdamW group)."""
        groups: dict[str, list[dict]] = {}
        for group in optimizer.param_groups:
            groups.setdefault(group_drafter(group), []).append(group)
        for name, gs in groups.items():
            clip = self.specs[name].grad_clip
            params = [p for g in gs for p in g["params"] if p.grad is not None]
            if not params:
                continue
            max_norm = clip if clip and clip > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            self.log(f"train/{name}/grad_norm", norm.detach().float(), on_step=True)
            for g in gs:  # the drafter's lr (AdamW group) and, with optim=muon, Muon's
                key = "muon_lr" if g["name"].endswith(MUON_SUFFIX) else "lr"
                self.log(f"train/{name}/{key}", float(g["lr"]), on_step=True)
            if clip and clip > 0:
                self.log(f"train/{name}/clipped", float(norm > clip), on_step=True)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self) -> dict[str, Any]:
        """This run's ``checkpoint["dflash"]`` entry (``dflash_lit/checkpoint.py``)."""
        return ckpt_contract.make_meta(
            {n: (s.model.to_dict(), s.loss) for n, s in self.specs.items()}, self.target_info,
            optimizer="adamw" if self.muon is None else "muon",
            train_vocab=None if self.train_vocab is None else self.train_vocab.tolist(),
            nonfinite_total=self.nonfinite_total, tokens_seen=self.tokens_seen,
            nonfinite_in_row=self.nonfinite_in_row,
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["dflash"] = self.checkpoint_meta()
        # Checkpoint callbacks run before this module's on_train_batch_end, which logs and
        # resets the train window at log-interval boundaries: a checkpoint taken there would
        # carry the window just logged, and a resume would count it twice. Save the state
        # the boundary leaves behind (empty) instead.
        interval = max(int(self.trainer.log_every_n_steps), 1) if self._trainer else 1
        if self.global_step % interval == 0:
            sd = checkpoint.get("state_dict", {})
            for k in [k for k in sd if k.startswith("train_metrics.")]:
                sd[k] = torch.zeros_like(sd[k])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        ckpt_contract.check_matches(checkpoint, self.checkpoint_meta(), source="checkpoint")
        meta = checkpoint["dflash"]
        self.nonfinite_total = int(meta.get("nonfinite_total", 0))
        self.tokens_seen = int(meta.get("tokens_seen", 0))
        self.nonfinite_in_row = int(meta.get("nonfinite_in_row", 0))


# The logit of a token outside a cached top-k: stands for -inf (exp underflows to exactly 0
# in a float32 softmax) while staying finite, so no inf - inf arithmetic can make a NaN.
OFF_TOPK_LOGIT = -1e4


def topk_logits_dense(ids: Tensor, values: Tensor, vocab: int) -> Tensor:
    """[B, S, V] logits from cached top-k: the k stored logits, ``OFF_TOPK_LOGIT`` elsewhere
    (probability exactly 0 after a softmax), i.e. the target's distribution renormalised over
    its top k."""
    out = torch.full((*ids.shape[:-1], vocab), OFF_TOPK_LOGIT, dtype=values.dtype,
                     device=values.device)
    return out.scatter_(-1, ids, values)


def _isnan(v) -> bool:
    try:
        return math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def rank_zero_print(msg: str) -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(msg)
