"""Plateau diagnostics: a copy-the-anchor drafter is flagged, one that uses its inputs is not,
by the metric, by the warning and by the log analysis."""

from __future__ import annotations

import torch

from dflash_lit.model.layout import IGNORE
from dflash_lit.train.plateau import PlateauDiagnostics, plateau_message


def _labels(b=2, n=4, bs=6):
    labels = torch.randint(0, 50, (b, n, bs))
    labels[..., 0] = IGNORE
    labels[1, 3] = IGNORE  # an invalid block
    return labels


def test_copy_the_anchor_drafter_is_flagged():
    labels = _labels()
    anchor = torch.randint(0, 50, labels.shape[:2])
    pred = anchor[..., None].expand(labels.shape).clone()  # the anchor token in every slot
    m = PlateauDiagnostics()
    same = torch.zeros(3, 5, 50).log_softmax(-1)  # identical slots
    m.update(pred, pred.clone(), labels, same)  # masking the anchor changes nothing
    d = m.compute()
    assert float(d["const_block_share"]) == 1.0
    assert float(d["anchor_sensitivity"]) == 0.0
    assert float(d["slot_spread"]) == 0.0
    msg = plateau_message("main", float(d["const_block_share"]), float(d["anchor_sensitivity"]))
    assert msg and "copy-the-anchor plateau" in msg and "100% of blocks" in msg


def test_a_drafter_that_uses_its_inputs_is_not_flagged():
    labels = _labels()
    pred = torch.where(labels == IGNORE, torch.zeros_like(labels), labels)  # overfit: = labels
    masked = (pred + 1) % 50  # every draft changes without the anchor
    m = PlateauDiagnostics()
    m.update(pred, masked, labels, torch.randn(3, 5, 50).log_softmax(-1))
    d = m.compute()
    assert float(d["const_block_share"]) < 0.5
    assert float(d["anchor_sensitivity"]) == 1.0
    assert float(d["slot_spread"]) > 0.1
    assert plateau_message("main", float(d["const_block_share"]),
                           float(d["anchor_sensitivity"])) is None


def test_analysis_flags_a_logged_plateau(tmp_path):
    import pandas as pd

    from dflash_lit.analyze.analysis import plateau_flags
    from dflash_lit.analyze.logs import Run

    df = pd.DataFrame({"step": [10, 20], "train/main/loss": [2.0, 1.9],
                       "val/main/const_block_share": [0.9, 0.8],
                       "val/main/anchor_sensitivity": [0.0, 0.01],
                       "val/main/slot_spread": [0.01, 0.02],
                       "val/main/tau_chain_vs_ngram": [0.7, 0.8]})
    run = Run(path=tmp_path, name="r", df=df)
    flags = plateau_flags(run)
    assert any("copy-the-anchor plateau" in f and "step 20" in f for f in flags)
    assert any("0.80x the model-free baseline" in f for f in flags)  # an older log: n-gram only
    df.loc[1, "val/main/const_block_share"] = 0.1
    df.loc[1, "val/main/tau_chain_vs_ngram"] = 1.6
    assert plateau_flags(Run(path=tmp_path, name="r", df=df)) == []
    df["val/main/tau_chain_vs_model_free"] = [0.9, 0.95]  # the strongest baseline wins the check
    assert any("0.95x the model-free baseline at step 20" in f
               for f in plateau_flags(Run(path=tmp_path, name="r", df=df)))
