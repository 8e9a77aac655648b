"""Training-log analysis (python -m dflash_lit.analyze): synthetic logs with known answers,
a real short training run with a resume, the W&B offline reader and the notebook."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_lit.analyze import (
    LogError,
    Options,
    analyze_run,
    compare_runs,
    load_run,
    loss_distribution,
    project,
    segment_velocity,
    steps_to_reach,
    write_compare_report,
)
from dflash_lit.analyze.__main__ import main

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- helpers
def write_run(d: Path, cols: dict[str, np.ndarray], steps: np.ndarray, config: str = "",
              resumed_from: str | None = None, extra_lines: str = "") -> Path:
    """A run dir like train.py writes: csv/metrics.csv (Lightning layout: sorted header,
    empty cells where not logged), config_resolved.yaml, optional resumed_from.txt."""
    (d / "csv").mkdir(parents=True, exist_ok=True)
    names = ["step"] + sorted(cols)
    lines = [",".join(names)]
    for i, s in enumerate(steps):
        cells = [str(int(s))]
        for n in names[1:]:
            v = cols[n][i]
            cells.append("" if v is None or (isinstance(v, float) and math.isnan(v)) else repr(float(v)))
        lines.append(",".join(cells))
    (d / "csv" / "metrics.csv").write_text("\n".join(lines) + "\n" + extra_lines)
    (d / "config_resolved.yaml").write_text(config or "run_name: synth\n")
    if resumed_from:
        (d / "resumed_from.txt").write_text(resumed_from + "\n")
    return d


def cfg(max_steps: int = -1, clip: float = 1.0, max_epochs: int = 1) -> str:
    return (f"run_name: synth\noptim:\n  grad_clip: {clip}\ntrainer:\n  max_steps: {max_steps}\n"
            f"  max_epochs: {max_epochs}\n")


# ---------------------------------------------------------------------------- velocity
def test_velocity_linear_then_saturating_is_exact(tmp_path):
    """acc rises 0.001/step to step 400, then stays at 0.5: with k=100 each segment mean moves
    by exactly 0.1 until the kink; the kink segment by 0.5 - mean(0.4..0.4995) = 0.0505."""
    s = np.arange(800)
    acc = np.where(s < 400, 0.1 + 0.001 * s, 0.5)
    loss = 4.0 - 2.0 * acc
    run = load_run(write_run(tmp_path / "r", {"train/main/acc": acc, "train/main/loss": loss},
                             s, cfg(max_steps=1600)))
    a = analyze_run(run, Options(segment=100))
    v = a.velocity["main"]["acc"]
    assert v.k == 100 and [sg.start for sg in v.segments] == list(range(0, 800, 100))
    np.testing.assert_allclose(v.velocities, [0.1, 0.1, 0.1, 0.0505, 0, 0, 0], atol=1e-12)
    np.testing.assert_allclose([sg.ratio for sg in v.segments[2:5]], [1.0, 1.0, 0.505],
                               atol=1e-12)
    np.testing.assert_allclose(a.velocity["main"]["loss"].velocities,
                               [-0.2, -0.2, -0.2, -0.101, 0, 0, 0], atol=1e-12)
    assert v.trend == "plateaued" and a.verdicts["main"].startswith("plateaued")
    # default k: the 800 steps split into 8 segments
    assert segment_velocity(s, acc, "acc").k == 100
    p = a.projection["main"]["acc"]
    assert p.final_step == 1600 and p.final_step_source == "trainer.max_steps"
    assert p.chosen is not None and len(p.fits) == 4


def test_velocity_decay_of_exponential_saturation():
    """acc = 0.8 - 0.6 exp(-s/200): successive segment velocities shrink by exp(-k/200)."""
    s = np.arange(1000)
    acc = 0.8 - 0.6 * np.exp(-s / 200.0)
    v = segment_velocity(s, acc, "train/main/acc", k=100)
    assert v.decay_per_k == pytest.approx(math.exp(-0.5), rel=1e-9)
    assert v.half_life_steps == pytest.approx(200 * math.log(2), rel=1e-9)
    np.testing.assert_allclose([sg.ratio for sg in v.segments[2:]], math.exp(-0.5), rtol=1e-9)
    assert v.trend == "slowing"  # still improving (noise-free) but at < 25 % of the peak rate


def test_projection_picks_power_law_and_brackets_truth():
    rng = np.random.default_rng(0)
    s = np.arange(2000)
    truth = lambda x: 0.8 - 0.5 * (x + 1.0) ** -0.5  # noqa: E731
    acc = truth(s) + rng.normal(0, 0.01, len(s))
    p = project(s, acc, 8000, "train/main/acc", n_boot=200)
    assert p.chosen.name == "power"
    assert p.chosen.params["a"] == pytest.approx(0.8, abs=0.01)
    assert p.chosen.params["c"] == pytest.approx(0.5, rel=0.15)
    assert abs(p.value - truth(8000)) < 0.005 and p.lo < p.value < p.hi
    assert p.hi - p.lo < 0.02
    # a log curve is told apart from the power law on held-out points
    lg = 0.2 + 0.05 * np.log(s + 1.0) + rng.normal(0, 0.002, len(s))
    q = project(s, lg, 8000, "train/main/acc")
    assert q.chosen.name in ("log", "power")
    assert q.value == pytest.approx(0.2 + 0.05 * math.log(8001), abs=0.01)
    ex = 0.8 - 0.6 * np.exp(-s / 300.0) + rng.normal(0, 0.005, len(s))
    e = project(s, ex, 8000, "train/main/acc")
    assert e.chosen.name == "exp" and e.chosen.params["tau"] == pytest.approx(300, rel=0.1)
    assert e.value == pytest.approx(0.8, abs=0.005) and e.lo <= 0.8 + 0.002
    few = project(s[:5], acc[:5], 100, "train/main/acc")
    assert few.chosen is None and few.value is None and "too few points" in few.note


def test_steps_to_reach_inverts_the_fit_with_a_band():
    rng = np.random.default_rng(2)
    s = np.arange(0, 10_000, 100)
    tau = 1.0 + 0.1 * np.log(s + 1.0)  # reaches 2.0 at x = e^10, step ~22025
    p = project(s, tau + rng.normal(0, 0.01, len(s)), 20_000, "tau_chain")
    r = steps_to_reach(p, 2.0, start=s[-1], horizon=1e7)
    assert p.chosen.name in ("log", "power")
    assert r.step == pytest.approx(math.exp(10.0) - 1, rel=0.15)
    assert r.lo <= r.step <= r.hi and r.never == 0.0
    # a goal above the saturating truth is never reached; one already passed is at the start
    sat = project(s, 2.0 - np.exp(-(s + 1.0) / 2000.0) + rng.normal(0, 0.005, len(s)), 20_000,
                  "tau_chain")
    no = steps_to_reach(sat, 3.0, start=s[-1], horizon=1e7)
    assert no.step is None and no.hi is None and no.never > 0.9
    assert steps_to_reach(p, 1.5, start=s[-1], horizon=1e7).step == pytest.approx(s[-1])
    assert steps_to_reach(project(s[:5], tau[:5], 100), 2.0, 4, 1e7).step is None


# ---------------------------------------------------------------------------- distribution
def _mixture(n, rng):
    major = rng.random(n) < 0.7
    return np.where(major, rng.normal(2.0, 0.1, n), rng.normal(4.0, 0.1, n))


def test_bimodal_loss_mixture_recovered(tmp_path):
    rng = np.random.default_rng(1)
    n = 2000
    s = np.arange(n)
    loss = _mixture(n, rng)
    run = load_run(write_run(tmp_path / "bi", {"train/main/loss": loss}, s))
    a = analyze_run(run, Options(thresholds=(2.5, 3.5)))
    dist = a.distribution["main"]
    assert dist.skipped_warmup == 200 and dist.n == 1800
    b = dist.bimodality
    assert b.verdict == "bimodal" and b.delta_bic > 1000
    np.testing.assert_allclose(b.two.means, [2.0, 4.0], atol=0.05)
    np.testing.assert_allclose(b.two.weights, [0.7, 0.3], atol=0.03)
    np.testing.assert_allclose(b.two.stds, [0.1, 0.1], atol=0.03)
    kept = loss[200:]
    assert dist.share_above == pytest.approx(float(np.mean(kept > 3.5)), abs=0.01)
    assert dist.share_below == pytest.approx(float(np.mean(kept < 2.5)), abs=0.01)
    assert any("bimodal" in f for f in a.flags)


def test_unimodal_loss_not_called_bimodal():
    rng = np.random.default_rng(2)
    s = np.arange(2000)
    loss = 3.0 - 0.0005 * s + rng.normal(0, 0.1, len(s))  # trend + Gaussian scatter
    dist = loss_distribution(s, loss)
    assert dist.bimodality.verdict == "unimodal" and dist.bimodality.delta_bic < 10
    # default thresholds: median ± 2 robust σ of the detrended loss → ~2.3 % each side
    assert 0.005 < dist.share_above < 0.05 and 0.005 < dist.share_below < 0.05
    assert dist.quantiles["p95"] - dist.quantiles["p5"] == pytest.approx(2 * 1.645 * 0.1,
                                                                          rel=0.1)


def test_loss_correlates_with_seq_len(tmp_path):
    rng = np.random.default_rng(3)
    s = np.arange(1500)
    seq = rng.uniform(100, 500, len(s))
    loss = 3.0 * np.exp(-s / 800) + 1.0 + 0.001 * (seq - 300) + rng.normal(0, 0.05, len(s))
    other = rng.normal(0, 1, len(s))
    run = load_run(write_run(tmp_path / "c", {"train/main/loss": loss, "train/seq_len": seq,
                                              "train/other": other}, s))
    a = analyze_run(run)
    (c,) = [c for c in a.distribution["main"].correlations if c.against == "train/seq_len"]
    assert c.n == 1350 and c.pearson > 0.8 and c.spearman > 0.8 and c.p_pearson < 1e-10
    assert any("data source per batch: not logged" in n for n in a.notes)
    # a source column is picked up; a random one correlates ~0
    run2 = load_run(write_run(tmp_path / "c2", {"train/main/loss": loss,
                                                "train/source/noise": other}, s))
    (c2,) = analyze_run(run2).distribution["main"].correlations
    assert c2.against == "train/source/noise" and abs(c2.pearson) < 0.1


# ---------------------------------------------------------------------------- grads, epochs
def test_grad_stats_and_epoch_boundary_jump(tmp_path):
    rng = np.random.default_rng(4)
    s = np.arange(1000)
    epoch = (s >= 500).astype(float)
    loss = 3.0 - 0.001 * s - 0.3 * epoch + rng.normal(0, 0.02, len(s))  # -0.3 at the epoch
    gn = rng.lognormal(0.0, 0.5, len(s))
    run = load_run(write_run(tmp_path / "g", {"epoch": epoch, "train/main/loss": loss,
                                              "train/main/grad_norm": gn}, s, cfg(clip=1.5, max_epochs=2)))
    a = analyze_run(run, Options(window=50))
    g = a.grads["main"]
    assert g.clip == 1.5 and g.clipped_source == "grad_norm > clip"
    assert g.clipped_share == pytest.approx(float(np.mean(gn > 1.5)))
    assert g.p90 == pytest.approx(float(np.quantile(gn, 0.9)))
    assert g.max == pytest.approx(float(gn.max())) and g.max_step == int(np.argmax(gn))
    (ev,) = a.epochs
    assert ev.step == 500 and ev.label == "epoch 0 -> 1"
    (j,) = [j for j in ev.jumps if j.metric == "train/main/loss"]
    assert j.excess == pytest.approx(-0.3, abs=0.03) and j.z < -5 and j.flagged
    # no max_steps: 2 epochs x the 500 steps of the first one
    assert a.final_step == 1000 and "max_epochs=2" in a.final_step_source


# ---------------------------------------------------------------------------- resume chains
def _chain(tmp_path: Path, jump: float, lr_restart: bool = False) -> Path:
    """Run A logs steps 0..249 (crashed after its step-200 checkpoint); run B resumes from it
    and logs 200..399 with ``jump`` added to the loss."""
    rng = np.random.default_rng(5)
    sa, sb = np.arange(250), np.arange(200, 400)
    base = lambda x: 3.0 - 0.002 * x  # noqa: E731
    lr = lambda x: 1e-3 * (1 - x / 400)  # noqa: E731
    a = write_run(tmp_path / "A", {"train/main/loss": base(sa) + rng.normal(0, 0.02, len(sa)),
                                   "train/main/lr": lr(sa), "epoch": 0 * sa}, sa,
                  cfg(max_steps=400))
    (a / "checkpoints").mkdir()
    lr_b = np.full(len(sb), 1e-3) if lr_restart else lr(sb)
    return write_run(tmp_path / "B",
                     {"train/main/loss": base(sb) + jump + rng.normal(0, 0.02, len(sb)),
                      "train/main/lr": lr_b, "epoch": 0 * sb}, sb, cfg(max_steps=400),
                     resumed_from=str(a / "checkpoints" / "step0000200.ckpt"))


def test_resume_chain_with_jump_is_flagged(tmp_path):
    b = _chain(tmp_path, jump=0.5)
    run = load_run(b)
    assert [d.name for d in run.dirs] == ["A", "B"]
    (ev,) = run.resumes
    assert ev.step == 200 and ev.checkpoint_step == 200 and Path(ev.from_dir).name == "A"
    assert run.df["step"].tolist() == list(range(400))
    # steps 200..249 exist in both: the resumed run's rows win
    s, v = run.series("train/main/loss")
    assert np.all(v[200:250] > 3.0 - 0.002 * s[200:250] + 0.4)
    a = analyze_run(run, Options(window=50))
    (chk,) = a.resumes
    (j,) = [j for j in chk.jumps if j.metric == "train/main/loss"]
    assert j.excess == pytest.approx(0.5, abs=0.03) and j.z > 10 and j.flagged
    assert chk.flagged and any("REGRESSION train/main/loss" in f for f in a.flags)
    assert not any(c.flagged for c in chk.continuity)  # lr continued: only the loss jumped


def test_resume_chain_without_jump_not_flagged(tmp_path):
    a = analyze_run(load_run(_chain(tmp_path, jump=0.0)), Options(window=50))
    (chk,) = a.resumes
    (j,) = [j for j in chk.jumps if j.metric == "train/main/loss"]
    assert abs(j.excess) < 0.02 and abs(j.z) < 3 and not chk.flagged
    assert not any("REGRESSION" in f for f in a.flags)


def test_resume_with_restarted_lr_schedule_is_flagged(tmp_path):
    a = analyze_run(load_run(_chain(tmp_path, jump=0.0, lr_restart=True)), Options(window=50))
    (chk,) = a.resumes
    (c,) = [c for c in chk.continuity if c.metric == "train/main/lr"]
    assert c.flagged and c.after == pytest.approx(1e-3) and c.predicted == pytest.approx(5e-4)


# ---------------------------------------------------------------------------- robustness
def test_truncated_and_malformed_lines_are_skipped_with_line_numbers(tmp_path):
    s = np.arange(20)
    # header = line 1, steps 0..19 = lines 2..21; a crash cut line 22 after its first field
    d = write_run(tmp_path / "t", {"train/main/loss": 3 - 0.01 * s}, s, extra_lines="20")
    text = (d / "csv" / "metrics.csv").read_text().split("\n")
    text[5] = "4,not_a_number"  # line 6 (step 4)
    (d / "csv" / "metrics.csv").write_text("\n".join(text))
    run = load_run(d)
    assert len(run.skipped) == 2
    assert run.skipped[0].startswith(f"{d / 'csv' / 'metrics.csv'}:6: unparseable number")
    assert run.skipped[1].startswith(f"{d / 'csv' / 'metrics.csv'}:22: 1 fields, the header has 2")
    assert run.df["step"].tolist() == [i for i in range(20) if i != 4]
    a = analyze_run(run)
    assert a.skipped_lines == run.skipped and any("malformed" in f for f in a.flags)


def test_dir_without_metrics_gives_clear_error(tmp_path, capsys):
    empty = tmp_path / "nothing_here"
    empty.mkdir()
    with pytest.raises(LogError) as e:
        load_run(empty)
    msg = str(e.value)
    assert str(empty) in msg and "csv/metrics.csv" in msg and "wandb/offline-run-*" in msg
    assert "python train.py" in msg
    assert main([str(empty)]) == 2
    assert "no training logs found" in capsys.readouterr().err


def test_outputs_run_name_dir_picks_newest_run(tmp_path):
    s = np.arange(10)
    write_run(tmp_path / "v5" / "2026-01-01_00-00-00", {"train/main/loss": 0 * s + 1.0}, s)
    newest = write_run(tmp_path / "v5" / "2026-01-02_00-00-00", {"train/main/loss": 0 * s + 2}, s)
    os.utime(newest / "csv" / "metrics.csv", (2e9, 2e9))
    run = load_run(tmp_path / "v5")
    assert run.path == newest and run.series("train/main/loss")[1][0] == 2.0
    assert "newest run" in run.notes[0]


# ---------------------------------------------------------------------------- comparison
def test_compare_runs_with_different_metrics(tmp_path):
    s = np.arange(100)
    ra = write_run(tmp_path / "a", {"train/main/loss": 3 - 0.01 * s, "train/loss_total": 3 - 0.01 * s,
                                    "train/tokens_seen": 500.0 * (s + 1)}, s)
    rb = write_run(tmp_path / "b", {"train/gamma4/loss": 3 - 0.02 * s,
                                    "train/loss_total": 3 - 0.02 * s,
                                    "perf/target_tok_s": 0 * s + 100.0}, s)
    comp = compare_runs([load_run(ra), load_run(rb)])
    assert comp.shared == ["train/loss_total"]
    assert comp.missing[comp.runs[0]] == ["perf/target_tok_s", "train/gamma4/loss"]
    assert comp.missing[comp.runs[1]] == ["train/main/loss", "train/tokens_seen"]
    assert comp.x_tokens == {comp.runs[0]: True, comp.runs[1]: False}
    finals = {f["drafter"]: f for f in comp.finals}
    assert finals["main"]["tokens_seen"] == 50000.0 and finals["gamma4"]["tokens_seen"] is None
    out = tmp_path / "cmp"
    assert main([str(ra), str(rb), "--out", str(out), "--bootstrap", "20", "--no-plots"]) == 0
    md = (out / "compare" / "report.md").read_text()
    assert "## Shared metrics (1)" in md and "- train/loss_total" in md
    assert "**" + comp.runs[1] + "** (2)\n\n- train/main/loss\n- train/tokens_seen" in md
    assert "step (no train/tokens_seen)" in md
    assert (out / comp.runs[0].replace("/", "_") / "report.md").is_file()
    assert json.loads((out / "compare" / "summary.json").read_text())["shared"] == \
        ["train/loss_total"]
    write_compare_report([load_run(ra), load_run(rb)], comp, out / "figs")
    for f in ("compare_step.png", "compare_tokens.png"):
        assert (out / "figs" / f).stat().st_size > 1000


# ---------------------------------------------------------------------------- W&B offline
def test_wandb_offline_history_matches_logged_values(tmp_path):
    """A real offline W&B run (wandb-core writes the .wandb file) reads back step by step."""
    code = f"""
import os
os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
for v in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    os.environ[v] = {str(tmp_path / 'run' / 'wandb')!r}
import wandb
wandb.init(project="t", dir={str(tmp_path / 'run')!r}, mode="offline")
for s in range(40):
    wandb.log({{"train/main/loss": 3 - 0.01 * s, "trainer/global_step": s, "epoch": s // 20}})
    if s % 20 == 19:
        wandb.log({{"val/main/loss": 2.0 + s / 100, "trainer/global_step": s, "epoch": s // 20}})
wandb.finish()
"""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120,
                   capture_output=True)
    run = load_run(tmp_path / "run")
    assert run.source == "wandb-offline"
    assert run.df["step"].tolist() == list(range(40))
    np.testing.assert_allclose(run.series("train/main/loss")[1], 3 - 0.01 * np.arange(40))
    vs, vv = run.series("val/main/loss")
    assert vs.tolist() == [19, 39] and vv.tolist() == pytest.approx([2.19, 2.39])
    assert [e.step for e in analyze_run(run).epochs] == [20]


def test_wandb_api_without_key_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key, no network attempt
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(LogError, match=r"wandb:ent/proj/abc: could not read .* API key"):
        load_run("wandb:ent/proj/abc")
    with pytest.raises(LogError, match="expected wandb:entity/project/run_id"):
        load_run("wandb:just-a-name")


# ---------------------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
def real_chain(tmp_path_factory):
    """A tiny real training (14 steps, val each epoch), resumed once from its step-6 ckpt."""
    from train_utils import base_overrides, make_shards, run_train

    root = tmp_path_factory.mktemp("real")
    tr, va = make_shards(root / "train", n=40), make_shards(root / "val", n=6, seed=1)
    ov = base_overrides(root, tr, va) + ["trainer.max_steps=14",
                                         "callbacks.model_checkpoint.every_n_train_steps=6"]
    run_train(ov, root / "first")
    run_train(ov + [f"ckpt_path={root / 'first' / 'checkpoints' / 'step0000006.ckpt'}"],
              root / "resumed")
    return root


def test_cli_on_real_resumed_run(real_chain, capsys):
    out = real_chain / "analysis_out"
    assert main([str(real_chain / "resumed"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"report: {out / 'report.md'}" in printed
    for f in ("report.md", "summary.json", "metrics.png", "velocity.png", "loss_hist.png",
              "grad_norm.png", "schedules.png"):
        assert (out / f).stat().st_size > 1000 or f == "summary.json", f
    summ = json.loads((out / "summary.json").read_text())
    assert summ["drafters"] == ["main"] and summ["first_step"] == 0 and summ["last_step"] == 13
    assert summ["final_step"] == 14 and summ["final_step_source"].startswith("total_steps")
    (res,) = summ["resumes"]
    assert res["step"] == 6 and res["label"] == f"from {real_chain / 'first'}"
    assert [e["step"] for e in summ["epochs"]] == [7]  # 7 batches per epoch
    md = (out / "report.md").read_text()
    assert f"resumed at step 6 from `{real_chain / 'first'}`" in md
    assert "![metrics](metrics.png)" in md
    # stitched: the resumed run re-logged step 6 with the exact same loss (exact resume)
    run = load_run(real_chain / "resumed")
    assert run.df["step"].tolist() == list(range(14))
    cont = {c["metric"]: c for c in res["continuity"]}
    assert not cont["train/tokens_seen"]["flagged"] and not cont["train/main/lr"]["flagged"]


def test_notebook_runs_top_to_bottom(real_chain):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(REPO / "notebooks" / "analyze_run.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    os.environ["DFLASH_RUN_DIR"] = str(real_chain / "resumed")
    try:
        nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        os.environ.pop("DFLASH_RUN_DIR")
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outs if o.get("output_type") == "error"]
    pngs = [o for o in outs if "image/png" in o.get("data", {})]
    assert len(pngs) >= 5
    text = "".join(o.get("text", "") for o in outs)
    assert "resumed at step 6" in text
