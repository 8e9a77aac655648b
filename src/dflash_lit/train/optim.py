"""The drafters' optimizer: AdamW (``optim=adamw``) or Muon + AdamW (``optim=muon``).

Either way it is ONE ``torch.optim.Optimizer`` with param groups per drafter, so Lightning's
automatic optimization steps it once per batch (``global_step`` counts batches), one LR
scheduler drives every group, and the checkpoint holds one optimizer state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_lit.errors import UserError
from dflash_lit.train.spec import DrafterSpec, MuonSettings

MUON_SUFFIX = "/muon"  # Muon groups are "<drafter>/muon": LearningRateMonitor wants unique names


def group_drafter(group: dict[str, Any]) -> str:
    """The drafter a param group belongs to (its ``name`` less the Muon suffix)."""
    return group["name"].removesuffix(MUON_SUFFIX)


def is_muon_param(p: nn.Parameter) -> bool:
    """Muon takes the 2-D matrices (q/k/v/o, MLP and fc projections); AdamW the rest (norm
    weights, biases: Muon orthogonalises matrices and torch's Muon rejects any other shape)."""
    return p.ndim == 2


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the matrix groups and ``torch.optim.AdamW`` on the others, as one
    optimizer.

    Why one object: Lightning steps several optimizers only under manual optimization, where
    ``global_step`` counts every optimizer step (K per batch) and this project's schedules,
    resume and logging assume it counts batches. The two inner optimizers work on *this*
    object's group dicts and its ``state`` (shared, never copied), so

    - the LR scheduler, per-drafter gradient clipping and ``zero_grad`` see every group;
    - ``state_dict`` is torch's standard format: groups (Muon's first, each tagged
      ``kind``) and per-parameter state (Muon's ``momentum_buffer``, AdamW's moments), and
      ``load_state_dict`` restores it exactly, then re-links the inner optimizers to the new
      groups.
    """

    def __init__(self, muon_groups: list[dict[str, Any]], adamw_groups: list[dict[str, Any]],
                 muon: MuonSettings, betas: tuple[float, float], eps: float) -> None:
        for g in muon_groups:
            g["kind"] = "muon"
        for g in adamw_groups:
            g["kind"] = "adamw"
        self.muon = torch.optim.Muon(
            muon_groups, momentum=muon.momentum, nesterov=muon.nesterov,
            ns_steps=muon.ns_steps, adjust_lr_fn=muon.adjust_lr_fn,
        )
        self.adamw = torch.optim.AdamW(adamw_groups, betas=betas, eps=eps)
        # add_param_group keeps the dicts it is given: ours are the inner optimizers' own.
        super().__init__(self.muon.param_groups + self.adamw.param_groups, defaults={})
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this object's groups and state."""
        n = sum(g["kind"] == "muon" for g in self.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Run ``closure`` (forward + backward) once, then step Muon and AdamW."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's exact restore, after checking the state is an ``optim=muon`` one."""
        saved = [g.get("kind") for g in state_dict.get("param_groups", [])]
        if saved != [g["kind"] for g in self.param_groups]:
            raise UserError(
                "optim=muon: the checkpoint's optimizer state is not a Muon + AdamW state for "
                "these drafters; resume with the optimizer it was trained with"
            )
        super().load_state_dict(state_dict)
        self._link()


def drafter_groups(name: str, drafter: nn.Module, spec: DrafterSpec,
                   muon: MuonSettings | None) -> tuple[list[dict], list[dict]]:
    """(Muon groups, AdamW groups) of one drafter; without ``muon`` everything is AdamW."""
    params = list(drafter.parameters())
    if muon is None:
        return [], [{"params": params, "lr": spec.lr, "weight_decay": spec.weight_decay,
                     "name": name}]
    mats = [p for p in params if is_muon_param(p)]
    rest = [p for p in params if not is_muon_param(p)]
    return ([{"params": mats, "lr": spec.lr * muon.lr_scale, "weight_decay": muon.weight_decay,
              "name": name + MUON_SUFFIX}],
            [{"params": rest, "lr": spec.lr, "weight_decay": spec.weight_decay, "name": name}])


def build_optimizer(drafters: nn.ModuleDict, specs: dict[str, DrafterSpec],
                    betas: tuple[float, float], eps: float,
                    muon: MuonSettings | None = None) -> torch.optim.Optimizer:
    """AdamW with one group per drafter, or (``muon`` given) ``MuonAdamW`` with a Muon and
    an AdamW group per drafter; groups are named ``<drafter>`` and ``<drafter>/muon``."""
    muon_groups, adamw_groups = [], []
    for name, spec in specs.items():
        m, a = drafter_groups(name, drafters[name], spec, muon)
        muon_groups += m
        adamw_groups += a
    if muon is None:
        return torch.optim.AdamW(adamw_groups, betas=betas, eps=eps)
    return MuonAdamW(muon_groups, adamw_groups, muon, betas, eps)

