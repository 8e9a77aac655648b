"""Checkpoint contract checks: a resume must match the run it continues, or fail loudly.

A Lightning checkpoint of dflash-lit holds ``state_dict`` (``drafters.<name>.<z-lab name>``
plus persistent metric states), optimizer/scheduler/loop/callback/datamodule states, and
``checkpoint["dflash"]``: drafter configs, loss settings and the target's identity.
"""

from __future__ import annotations

from typing import Any

from dflash_lit.errors import UserError

# Config fields whose change makes old weights or optimizer moments meaningless.
_SHAPE_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "num_hidden_layers", "block_size", "target_layer_ids",
    "mask_token_id", "num_target_layers",
)
_TARGET_FIELDS = ("hidden_size", "num_layers", "vocab_size")


def check_checkpoint_matches(ckpt: dict[str, Any], current: dict[str, Any], source: str) -> None:
    """Raise ValueError (one line) when ``ckpt`` was made by a different drafter/target setup."""
    meta = ckpt.get("dflash")
    if meta is None:
        raise UserError(f"{source}: not a dflash-lit training checkpoint (no 'dflash' entry)")
    old, new = meta.get("drafters", {}), current["drafters"]
    if set(old) != set(new):
        raise UserError(
            f"{source}: drafters {sorted(old)} in the checkpoint, {sorted(new)} in the config; "
            "resume with the same drafters: config"
        )
    for name in new:
        a, b = old[name]["config"], new[name]["config"]
        for f in _SHAPE_FIELDS:
            if a.get(f) != b.get(f):
                raise UserError(
                    f"{source}: drafter {name!r} has {f}={a.get(f)} in the checkpoint but "
                    f"{b.get(f)} in the config; resume with the same drafter shape"
                )
    ta, tb = meta.get("target", {}), current.get("target", {})
    for f in _TARGET_FIELDS:
        if f in ta and f in tb and ta[f] != tb[f]:
            raise UserError(
                f"{source}: target {f}={ta[f]} in the checkpoint but {tb[f]} now; this "
                "checkpoint was trained against another target"
            )

