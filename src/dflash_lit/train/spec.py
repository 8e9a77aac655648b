"""Per-drafter training specs: model shape, loss, noise and anchor schedules, optimiser knobs.

``conf/train.yaml`` holds the defaults in the ``drafter``, ``loss`` and ``schedule`` groups;
``drafters:`` maps names to per-drafter overrides merged on top, so a sweep of ``loss.gamma``
moves every drafter that does not pin its own value. ``MuonSettings`` (``optim=muon``) is one
for the run; it lives here, free of torch, so the config checks can read its fields.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash_lit.errors import UserError
from dflash_lit.model.config import DFlashConfig

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class NoiseSpec:
    """σ(step): warm-up 0 -> peak over warmup_frac of training, cosine to final."""

    peak: float = 0.0
    final: float = 0.0
    warmup_frac: float = 0.04
    kind: str = "gaussian"  # gaussian: σ·N(0,1); uniform: U(-σ, σ)


@dataclass
class AnchorSpec:
    """Anchors per sequence, ramped linearly from ``start`` to ``max`` over ``ramp_frac``."""

    max: int = 512
    start: int | None = None
    ramp_frac: float = 0.0


OPTIMIZERS = ("adamw", "muon")  # optim.name
ADJUST_LR_FNS = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn values


@dataclass(frozen=True)
class MuonSettings:
    """``optim=muon``'s run-wide Muon knobs: conf/optim/muon.yaml's ``muon_<field>`` keys."""

    lr_scale: float = 1.0  # Muon lr = the drafter's lr x this
    weight_decay: float = 0.1  # decoupled weight decay of the Muon matrices
    momentum: float = 0.95  # momentum of the orthogonalised update
    nesterov: bool = True  # Nesterov momentum
    ns_steps: int = 5  # Newton-Schulz iterations
    adjust_lr_fn: str = "match_rms_adamw"  # per-shape lr scaling (torch.optim.Muon)


def muon_settings(optim: Mapping[str, Any]) -> MuonSettings | None:
    """The ``optim`` group's ``muon_*`` keys as MuonSettings; None unless ``optim.name=muon``."""
    if optim.get("name", "adamw") != "muon":
        return None
    return MuonSettings(**{k.removeprefix("muon_"): v for k, v in optim.items()
                           if k.startswith("muon_")})


@dataclass
class DrafterSpec:
    """Everything that distinguishes one drafter of a (multi-drafter) run."""

    name: str
    model: DFlashConfig
    loss: dict[str, Any] = field(default_factory=lambda: {"name": "hard_ce", "gamma": 7.0})
    noise: NoiseSpec = field(default_factory=NoiseSpec)
    anchors: AnchorSpec = field(default_factory=AnchorSpec)
    lr: float = 6e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    init_from_target_layer: int | None = None  # copy this target decoder layer into the drafter

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise UserError(
                f"drafters.{self.name}: drafter names must be identifiers (letters, digits, _)"
            )
        if self.anchors.max < 1:
            raise UserError(f"drafters.{self.name}.anchors.max={self.anchors.max}: must be >= 1")
        if self.noise.kind not in ("gaussian", "uniform"):
            raise UserError(
                f"drafters.{self.name}.noise.kind={self.noise.kind!r}: use gaussian or uniform"
            )
        if min(self.noise.peak, self.noise.final) < 0:
            raise UserError(f"drafters.{self.name}.noise: peak/final must be >= 0")
        if self.lr <= 0:
            raise UserError(f"drafters.{self.name}.optim.lr={self.lr}: must be > 0")


def capture_layer_ids(specs: list[DrafterSpec]) -> list[int]:
    """Union of all drafters' context layers: what one target forward must capture."""
    return sorted({i for s in specs for i in s.model.target_layer_ids})
