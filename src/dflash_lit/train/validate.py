"""Cheap checks of a training config (types, ranges, unknown keys) before anything loads.

Everything here reads only the composed config, so a typo fails in well under a second with
the key's name instead of after the target's weights load.
"""

from __future__ import annotations

from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from dflash_lit.config_types import check_values, hints_of
from dflash_lit.errors import UserError
from dflash_lit.train.spec import ADJUST_LR_FNS, OPTIMIZERS, MuonSettings, muon_settings

# optim.muon_<field>: the MuonSettings fields (read only with optim=muon)
MUON_OPTIM = {f"muon_{k}": v for k, v in hints_of(MuonSettings).items()}
# optim: keys read once for the whole run (one optimizer, one LR schedule) ...
GLOBAL_OPTIM = {"name": str, "betas": list, "eps": float, "warmup_frac": float,
                "min_lr_ratio": float, **MUON_OPTIM}
# ... and keys each drafter may override (its own param group and clip).
DRAFTER_OPTIM = {"lr": float, "weight_decay": float, "grad_clip": float}
# Keys the datamodule receives from build_run, not from data.*.
_DATA_FROM_RUN = {"vocab_size", "block_size", "seed"}


def _container(cfg: DictConfig, key: str) -> dict[str, Any]:
    node = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}  # type: ignore[return-value]


def _range(key: str, value: float, lo: float, hi: float | None = None,
           lo_open: bool = False) -> None:
    """``lo <= value`` (``<`` when ``lo_open``) and ``value <= hi``, else a UserError."""
    if (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
        want = (f"{'>' if lo_open else '>='} {lo}" if hi is None
                else f"in {'(' if lo_open else '['}{lo}, {hi}]")
        raise UserError(f"{key}={value!r}: must be {want}")


def check_optim(cfg: DictConfig) -> None:
    """``optim.*``: known keys, types, ranges."""
    optim = _container(cfg, "optim")
    check_values(optim, {**GLOBAL_OPTIM, **DRAFTER_OPTIM}, "optim")
    check_muon(cfg, optim)
    if "lr" in optim:
        _range("optim.lr", optim["lr"], 0, lo_open=True)
    for key in ("weight_decay", "grad_clip", "eps"):
        if key in optim:
            _range(f"optim.{key}", optim[key], 0)
    for key in ("warmup_frac", "min_lr_ratio"):
        if key in optim:
            _range(f"optim.{key}", optim[key], 0, 1)
    betas = optim.get("betas")
    if betas is not None and (len(betas) != 2 or not all(
            isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
        raise UserError(f"optim.betas={betas!r}: give two numbers in [0, 1), e.g. [0.9, 0.95]")


def check_muon(cfg: DictConfig, optim: dict[str, Any]) -> None:
    """``optim.name`` and, for ``optim=muon``, the ``muon_*`` ranges and the strategy."""
    name = optim.get("name", "adamw")
    if name not in OPTIMIZERS:
        raise UserError(f"optim.name={name!r}: use one of {list(OPTIMIZERS)} (optim=adamw | optim=muon)")
    if name != "muon":
        extra = [k for k in optim if k in MUON_OPTIM]
        if extra:
            raise UserError(f"optim.{extra[0]}: read only with optim=muon (optim.name={name})")
        return
    muon = muon_settings(optim)
    _range("optim.muon_lr_scale", muon.lr_scale, 0, lo_open=True)
    _range("optim.muon_weight_decay", muon.weight_decay, 0)
    _range("optim.muon_ns_steps", muon.ns_steps, 1, 99)  # torch's Muon: fewer than 100
    if not 0 <= muon.momentum < 1:  # 1 would keep the momentum buffer at zero: no update
        raise UserError(f"optim.muon_momentum={muon.momentum!r}: must be in [0, 1)")
    fn = muon.adjust_lr_fn
    if fn not in ADJUST_LR_FNS:
        raise UserError(f"optim.muon_adjust_lr_fn={fn!r}: use one of {list(ADJUST_LR_FNS)}")
    if "fsdp" in str(OmegaConf.select(cfg, "trainer.strategy")).lower():
        # FSDP flattens and shards the matrices; Muon orthogonalises whole 2-D matrices
        raise UserError("optim=muon: not with an FSDP trainer.strategy (it shards each matrix; "
                        "Muon needs whole 2-D matrices); use trainer=ddp or trainer=gpu")


def check_data(cfg: DictConfig) -> None:
    """``data.*`` against the datamodule's constructor (unknown keys, value types)."""
    data = _container(cfg, "data")
    target = data.pop("_target_", None)
    if not target:
        raise UserError("data._target_: missing; use data=tiny_code or data=shards")
    try:
        cls = get_class(target)
    except Exception as e:
        raise UserError(f"data._target_={target!r}: cannot import it ({e})") from None
    hints = {k: v for k, v in hints_of(cls).items() if k not in _DATA_FROM_RUN}
    check_values(data, hints, "data")  # ranges: the datamodule's own checks


def check_run(cfg: DictConfig) -> None:
    """Top-level run keys with a type the run relies on."""
    ints = {"seed": 0, "val_max_anchors": 1, "max_nonfinite_in_row": 1}
    for key, lo in ints.items():
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{key}={value!r}: expected an integer")
        _range(key, value, lo)
    for key in ("max_steps", "max_epochs"):
        value = OmegaConf.select(cfg, f"trainer.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise UserError(f"trainer.{key}={value!r}: expected an integer")
    if not isinstance(cfg.get("resume_strict", False), bool):
        raise UserError(f"resume_strict={cfg.resume_strict!r}: expected true or false")


def check_config(cfg: DictConfig) -> None:
    """Every cheap check of a training config; drafter sections are checked by build_specs."""
    check_run(cfg)
    check_optim(cfg)
    check_data(cfg)
