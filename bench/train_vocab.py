"""The drafter step on SmolLM2-135M's shapes with the full-vocab softmax vs ``train_vocab=K``.

On a 49k-vocab target with a one-layer drafter the frozen lm_head over every drafted slot is
most of the step. ``train_vocab=K`` trains the fused hard CE over the K most frequent
completion tokens plus each batch's labels (``restrict_vocab``); this measures what that buys,
in one run, against the full softmax.

Shape (``budget=smollm2_cpu``): vocab 49152, hidden 576, 9 query / 3 KV heads of 64, MLP
1536, 1 layer, 4 context layers; a batch of 7 rows x 220 tokens (~1536 padded tokens), 16
anchors per row, block 16; labels = the target's argmax (random here: the cost does not
depend on them). Each case: median of ``--repeats`` steps after a warm-up (layout + drafter
forward + head + loss + backward), fp32.

    python bench/train_vocab.py [--vocab 4096 8192 16384] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from common import REPO, drafter_step_parts, fmt_table, median_time, peaks, write_result

from dflash_lit import DFlashConfig
from dflash_lit.data.frequent_tokens import frequent_tokens
from dflash_lit.model.block_forward import draft_hidden
from dflash_lit.model.layout import build_layout, gather_target_argmax
from dflash_lit.train.anchors import sample_anchors, step_generator
from dflash_lit.train.linear_ce import fused_hard_ce, restrict_vocab
from dflash_lit.train.losses import resolve_argmax_labels

V, D, B, S, BS, K, ANCHORS = 49152, 576, 7, 220, 16, 4, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = DFlashConfig(hidden_size=D, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       intermediate_size=1536, num_hidden_layers=1, block_size=BS,
                       mask_token_id=7, num_target_layers=30, target_layer_ids=[1, 8, 14, 21],
                       vocab_size=V, rope_theta=1e5)
    # a chat prompt (half of each row), then the completion
    drafter, embed, lm_head, ids, lm, am = drafter_step_parts(cfg, B, S, S // 2, min_id=20)
    th = torch.randn(B, S, K * D)
    argmax = torch.randint(20, V, (B, S))
    anchors, valid = sample_anchors(lm, ANCHORS, step_generator(0, 0, 0, "bench"), am)
    layout = build_layout(ids, lm, anchors, valid, BS, 7, am)
    labels = resolve_argmax_labels(gather_target_argmax(argmax, layout), layout.labels)
    n_slots = int((labels[..., 1:] >= 0).sum())

    def step_for(k: int | None):
        vocab = None if k is None else torch.arange(k)  # which ids does not change the cost

        def step() -> float:
            drafter.zero_grad(set_to_none=True)
            h = draft_hidden(drafter, embed, th, layout, backend="dense")
            w, y = lm_head.weight, labels
            if vocab is not None:
                w, y, _ = restrict_vocab(w, y, vocab)
            out, _ = fused_hard_ce(h, w, y, 7.0)
            out.loss.backward()
            return float(out.loss)

        return step

    rows, base = [], None
    for k in [None, *args.vocab]:
        step = step_for(k)
        t = median_time(step, repeats=args.repeats, warmup=1)
        base = base or t
        head_rows = V if k is None else k
        rows.append({"softmax over": "full vocab" if k is None else f"train_vocab={k}",
                     "rows": head_rows, "step_s": t, "speedup": base / t,
                     "ms_per_slot": 1e3 * t / n_slots})
        print(rows[-1], flush=True)
    pk = peaks()
    cover = data_coverage(args.vocab)
    table = fmt_table(rows, ["softmax over", "rows", "step_s", "speedup", "ms_per_slot"])
    table += (f"\n\n{n_slots} drafted slots a step (7 rows x 16 anchors x 15 slots, valid ones); "
              f"threads {args.threads}; fp32 matmul peak (same run) {pk['fp32_gflops']:.1f} GFLOP/s")
    if cover:
        table += (f"\n\nshipped SmolLM2 data: {cover['distinct']} distinct train completion tokens; "
                  "share of val completion tokens inside the train top-K: "
                  + ", ".join(f"K={k}: {c:.3f}" for k, c in cover["val_in_top_k"].items()))
    write_result("train_vocab", {"peaks": pk, "threads": args.threads, "slots": n_slots,
                                 "rows": rows, "coverage": cover}, table)


class _Rows(list):
    """Shard rows as the dataset interface ``frequent_tokens`` reads."""

    def __getitems__(self, idx):
        return [self[i] for i in idx]


def _completions(split: str) -> _Rows:
    import pyarrow.parquet as pq

    rows = _Rows()
    for f in sorted((REPO / "artifacts" / "smollm2" / "data" / split).glob("*.parquet")):
        t = pq.read_table(f, columns=["input_ids", "loss_mask"]).to_pylist()
        rows.extend(t)
    return rows


def data_coverage(ks: list[int]) -> dict | None:
    """Distinct completion tokens of the shipped train split, and how much of the val split's
    completions the train top-K (``frequent_tokens``, as training ranks them) covers."""
    train, val = _completions("train"), _completions("val")
    if not train or not val:
        return None
    def completion_ids(rows: _Rows) -> np.ndarray:
        return np.concatenate([np.asarray(r["input_ids"])[np.asarray(r["loss_mask"]) > 0]
                               for r in rows])

    ids = completion_ids(val)
    distinct = int(np.unique(completion_ids(train)).size)
    cover = {k: float(np.isin(ids, frequent_tokens(train, k, V).numpy()).mean()) for k in ks}
    return {"distinct": distinct, "val_in_top_k": cover}


if __name__ == "__main__":
    main()
