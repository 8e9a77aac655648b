"""``drafters.<name>``: every key must be one the run reads, or it is an error.

A drafter entry overrides the ``drafter``, ``loss``, ``schedule`` and ``optim`` groups for
that drafter. Per drafter the run reads the whole drafter shape, loss and schedule, but only
``lr``, ``weight_decay`` and ``grad_clip`` of ``optim``: the optimizer (``name``), its
betas/eps and ``muon_*`` settings and the LR schedule (``warmup_frac``, ``min_lr_ratio``) are
one for the run.
"""

from __future__ import annotations

from typing import Any

from dflash_lit.config_types import check_values, hints_of
from dflash_lit.errors import UserError
from dflash_lit.model.config import DFlashConfig
from dflash_lit.train.losses import LOSSES
from dflash_lit.train.spec import AnchorSpec, NoiseSpec
from dflash_lit.train.validate import DRAFTER_OPTIM, GLOBAL_OPTIM

SECTIONS = ("drafter", "loss", "schedule", "optim")
# drafter.*: the DFlashConfig fields plus the layer-choice keys build_specs resolves itself.
DRAFTER_KEYS = {**hints_of(DFlashConfig), "hidden_size": int | None,
                "target_layer_ids": list[int] | None, "drop_last_context_layers": int,
                "init_from_target_layer": int | None}
for _k in ("vocab_size", "mask_token_id", "num_target_layers"):  # taken from the target
    DRAFTER_KEYS.pop(_k)
SCHEDULE_KEYS = {"noise": hints_of(NoiseSpec), "anchors": hints_of(AnchorSpec)}


def check_schedule(prefix: str, sched: dict[str, Any]) -> None:
    """``schedule`` = {noise: NoiseSpec fields, anchors: AnchorSpec fields}."""
    for key, value in sched.items():
        if key not in SCHEDULE_KEYS:
            raise UserError(f"{prefix}.{key}: unknown key; accepted: {sorted(SCHEDULE_KEYS)}")
        if not isinstance(value, dict):
            raise UserError(f"{prefix}.{key}={value!r}: expected a mapping")
        check_values(value, SCHEDULE_KEYS[key], f"{prefix}.{key}")


def check_loss(prefix: str, loss: dict[str, Any], name: str) -> None:
    """Keys and value types of loss ``name``'s settings under ``prefix``."""
    if name not in LOSSES:
        where = prefix if "name" in loss else "loss"  # the name came from the loss group
        raise UserError(f"{where}.name={name!r}: unknown loss; choose one of {sorted(LOSSES)}")
    check_values(loss, {"name": str, **hints_of(LOSSES[name])}, prefix)


def check_overrides(name: str, over: Any) -> None:
    """Reject unknown or per-drafter-meaningless keys under ``drafters.<name>``, by key path.

    ``loss`` keys depend on the loss the drafter ends up with: ``check_loss`` after merging.
    """
    where = f"drafters.{name}"
    if not isinstance(over, dict):
        raise UserError(f"{where}={over!r}: expected a mapping of {list(SECTIONS)} overrides")
    for key, value in over.items():
        if key not in SECTIONS:
            raise UserError(f"{where}.{key}: unknown key; per-drafter overrides go under "
                            f"{list(SECTIONS)}")
        if not isinstance(value, dict):
            raise UserError(f"{where}.{key}={value!r}: expected a mapping")
    optim = over.get("optim", {})
    for key in optim:
        if key in GLOBAL_OPTIM:
            raise UserError(
                f"{where}.optim.{key}: one value for the whole run, not per drafter (one optimizer "
                f"and one LR schedule); set optim.{key} instead, or drop it here")
    check_values(optim, DRAFTER_OPTIM, f"{where}.optim")
    check_values(over.get("drafter", {}), DRAFTER_KEYS, f"{where}.drafter")
    check_schedule(f"{where}.schedule", over.get("schedule", {}))
