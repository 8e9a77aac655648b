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
    - ``lengths`` [B] int64 real lengths; ``index`` [B] int64 dataset row indices (which rows
      a step saw: what the exact-resume checks compare);
    - with cached target features (``data.features=cache``): ``target_hidden`` [B, S, F]
      float32 and ``target_argmax`` [B, S] int64 (0 on padding), and with a top-k cache
      ``target_topk_ids`` [B, S, k] int64 / ``target_topk_logits`` [B, S, k] float32.

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
        batch = {
            "input_ids": torch.from_numpy(ids),
            "loss_mask": torch.from_numpy(mask),
            "attention_mask": torch.from_numpy(attn),
            "lengths": torch.from_numpy(lengths),
            "index": torch.from_numpy(index),
        }
        if "target_hidden" in samples[0]:
            batch.update(_collate_features(samples, lengths, seq))
        return batch


def _collate_features(samples: Sequence[Mapping[str, Any]], lengths: np.ndarray,
                      seq: int) -> dict[str, torch.Tensor]:
    """Right-pad cached target features (zeros on padding, like an unused position)."""
    from dflash_lit.data.features import to_tensor

    bsz, dim = len(samples), samples[0]["target_hidden"].shape[1]
    hidden = torch.zeros(bsz, seq, dim, dtype=torch.float32)
    argmax = torch.zeros(bsz, seq, dtype=torch.long)
    topk = "target_topk" in samples[0]
    if topk:
        k = samples[0]["target_topk"][0].shape[1]
        tk_ids = torch.zeros(bsz, seq, k, dtype=torch.long)
        tk_val = torch.zeros(bsz, seq, k, dtype=torch.float32)
    for i, s in enumerate(samples):
        n = int(lengths[i])
        hidden[i, :n] = to_tensor(s["target_hidden"])
        argmax[i, :n] = torch.from_numpy(s["target_argmax"].astype(np.int64))
        if topk:
            ids_i, val_i = s["target_topk"]
            tk_ids[i, :n] = torch.from_numpy(ids_i.astype(np.int64))
            tk_val[i, :n] = torch.from_numpy(np.array(val_i))
    out = {"target_hidden": hidden, "target_argmax": argmax}
    if topk:
        out.update(target_topk_ids=tk_ids, target_topk_logits=tk_val)
    return out
