"""Right-padding collate: a list of token rows -> a batch dict of LongTensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


class PadCollator:
    """Right-pads a list of samples to the longest one (picklable, for loader workers).

    Each sample is a mapping with ``input_ids`` and ``loss_mask`` (sequences of ints, same
    length) and ``index`` (the dataset row index). The batch holds:

    - ``input_ids`` [B, S] int64, ``pad_token_id`` on padding;
    - ``loss_mask`` [B, S] int64, 0 on padding;
    - ``attention_mask`` [B, S] int64, 1 on real tokens;
    - ``lengths`` [B] int64 real lengths; ``index`` [B] int64 dataset row indices.

    ``S`` is the longest length, rounded up to ``pad_to_multiple_of``.
    """

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int = 1) -> None:
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = int(pad_to_multiple_of)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if len(samples) == 0:
            raise ValueError("cannot collate an empty batch")
        lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
        seq = int(lengths.max())
        m = self.pad_to_multiple_of
        seq = -(-seq // m) * m
        bsz = len(samples)
        ids = np.full((bsz, seq), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((bsz, seq), dtype=np.int64)
        for i, s in enumerate(samples):
            n = int(lengths[i])
            if len(s["loss_mask"]) != n:
                raise ValueError(
                    f"sample {s.get('index', i)}: loss_mask has {len(s['loss_mask'])} entries but "
                    f"input_ids has {n}"
                )
            ids[i, :n] = s["input_ids"]
            mask[i, :n] = s["loss_mask"]
        attn = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
        index = np.array([int(s.get("index", -1)) for s in samples], dtype=np.int64)
        return {
            "input_ids": torch.from_numpy(ids),
            "loss_mask": torch.from_numpy(mask),
            "attention_mask": torch.from_numpy(attn),
            "lengths": torch.from_numpy(lengths),
            "index": torch.from_numpy(index),
        }


def collate_batch(
    samples: Sequence[Mapping[str, Any]], pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """Functional form of :class:`PadCollator` (see there for the batch layout)."""
    return PadCollator(pad_token_id)(samples)
