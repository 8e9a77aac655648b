"""The most frequent completion tokens of a training set (a reduced training vocabulary).

The frozen lm_head over every drafted slot dominates a DFlash step when the target's vocab is
large and the drafter small (49k x 576 for SmolLM2: ~80% of a CPU step). A softmax over the
tokens the target actually writes -- ranked by frequency in the regenerated completions, as
FR-Spec (arXiv:2502.14856) and EAGLE-3's draft vocabulary rank them -- costs a fraction of
it. Drafting still uses the full vocab; validation measures it.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_ROWS = 20_000  # rows counted (the first ones in dataset order): enough to rank the head


def frequent_tokens(dataset, k: int, vocab_size: int, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """Sorted ids of the ``k`` most frequent completion tokens (``loss_mask == 1``) of
    ``dataset`` (its first ``max_rows`` rows); ties and unseen ids rank by lower id."""
    if not 1 <= k <= vocab_size:
        raise ValueError(f"train_vocab={k} must be in [1, {vocab_size}] (the target's vocab) or null")
    counts = np.zeros(vocab_size, dtype=np.int64)
    n = min(len(dataset), max_rows)
    for s in range(0, n, 256):
        rows = dataset.__getitems__(list(range(s, min(s + 256, n))))
        ids = np.concatenate([np.asarray(r["input_ids"])[np.asarray(r["loss_mask"]) > 0]
                              for r in rows])
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # count desc, then id asc
    return torch.from_numpy(np.sort(order[:k]))
