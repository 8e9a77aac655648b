"""The streak: how many drafted slots a greedy chain verification accepts."""

from __future__ import annotations

from torch import Tensor


def streak_of(ok: Tensor) -> Tensor:
    """int64 [...]: leading True entries along the last dim of ``ok`` [..., slots].

    With ``ok`` = "slot k's draft is right (and valid)" for slots 1..Bs-1 of a block, this is
    the number of drafts a chain verification accepts: offline τ − 1. Training metrics,
    the offline evaluation and the tests all count it here.
    """
    return ok.long().cumprod(dim=-1).sum(dim=-1)
