"""What every log reader of the analysis shares: its error type and the per-step merge."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dflash_lit.errors import UserError


class LogError(UserError):
    """A run directory (or log file) that cannot be analysed; the message says what to do."""


def merge_steps(raw: pd.DataFrame) -> pd.DataFrame:
    """One row per step: the last non-empty value of each column among that step's rows."""
    raw = raw[raw["step"].notna()]
    if raw.empty:
        return pd.DataFrame(columns=list(raw.columns))
    df = raw.groupby("step", sort=True).last().reset_index()
    df["step"] = df["step"].astype(np.int64)
    return df
