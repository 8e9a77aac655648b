"""Loading a run's logs into one DataFrame: Lightning CSV, W&B offline/online history, resumes.

A :class:`Run` holds one row per logged global step (``step`` column, sorted, unique); a
metric not logged at a step is NaN. Lightning's CSVLogger writes several rows per step (e.g.
the LR monitor's row and the validation row); they are merged, last non-empty value wins.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from dflash_lit.analyze.steps import LogError, merge_steps
from dflash_lit.analyze.wandb_io import load_wandb_api, load_wandb_offline

CSV_REL = Path("csv") / "metrics.csv"
WANDB_GLOB = "wandb/offline-run-*"
RESUME_FILE = "resumed_from.txt"
_DRAFTER_RE = re.compile(r"^train/([^/]+)/loss$")
_NOT_DRAFTERS = {"source"}


@dataclass
class ResumeEvent:
    """One ``ckpt_path=`` resume: the newer run's logs replace the older's from ``step`` on."""

    step: int  # first global step logged by the resumed run
    from_dir: str  # the earlier run dir (the parent of its checkpoints/)
    into_dir: str  # the resumed run dir (holds resumed_from.txt)
    checkpoint: str  # the path written in resumed_from.txt
    checkpoint_step: int | None = None  # parsed from a step<N>.ckpt name, when it has one
    found: bool = True  # False: the earlier run dir is gone; its logs are missing


@dataclass
class Run:
    """A run's merged per-step logs plus where they came from."""

    path: Path  # the directory given (the newest of a resume chain)
    name: str  # short label for reports and legends
    df: pd.DataFrame  # one row per step, ``step`` column (int), sorted ascending
    config: dict = field(default_factory=dict)  # config_resolved.yaml of the newest run
    source: str = "csv"  # csv | wandb-offline | wandb-api
    dirs: list[Path] = field(default_factory=list)  # the chain, oldest first
    resumes: list[ResumeEvent] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "file:line: why" for dropped lines
    notes: list[str] = field(default_factory=list)  # anything else the reader should know

    @property
    def drafters(self) -> list[str]:
        """Drafter names, from the ``train/<name>/loss`` columns."""
        return drafters_of(self.df.columns)

    @property
    def metrics(self) -> list[str]:
        """Metric columns (everything but step/epoch) that hold at least one value."""
        return [c for c in self.df.columns
                if c not in ("step", "epoch") and self.df[c].notna().any()]

    def series(self, column: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) where ``column`` was logged and finite; empty arrays if absent."""
        if column not in self.df.columns:
            return np.array([], dtype=np.int64), np.array([], dtype=float)
        v = self.df[column].to_numpy(dtype=float)
        ok = np.isfinite(v)
        return self.df["step"].to_numpy()[ok].astype(np.int64), v[ok]

    @property
    def last_step(self) -> int:
        return int(self.df["step"].max()) if len(self.df) else 0


def drafters_of(columns) -> list[str]:
    """Drafter names in the order their ``train/<name>/loss`` columns appear."""
    out = []
    for c in columns:
        m = _DRAFTER_RE.match(str(c))
        if m and m.group(1) not in _NOT_DRAFTERS and m.group(1) not in out:
            out.append(m.group(1))
    return out


# ---------------------------------------------------------------------------------- CSV
def read_metrics_csv(path: str | Path) -> tuple[pd.DataFrame, list[str]]:
    """Read a Lightning ``metrics.csv``; malformed lines are skipped, not fatal.

    Returns the raw rows (several per step possible) and one ``"file:line: why"`` message per
    skipped line: a wrong number of fields (typically the last line cut off by a crash) or a
    cell that is not a number.
    """
    path = Path(path)
    skipped: list[tuple[int, str]] = []  # (line, message), sorted by line at the end
    lines: list[int] = []
    rows: list[list[str]] = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise LogError(f"{path}: empty file, no header row; the run logged nothing yet")
        for fields in reader:
            if not fields or fields == [""]:
                continue
            if len(fields) != len(header):
                skipped.append((reader.line_num, f"{path}:{reader.line_num}: {len(fields)} "
                                f"fields, the header has {len(header)} (line cut off or "
                                "corrupt); skipped"))
                continue
            rows.append(fields)
            lines.append(reader.line_num)
    raw = pd.DataFrame(rows, columns=header, dtype=str)
    out = pd.DataFrame(index=raw.index)
    bad = np.zeros(len(raw), dtype=bool)
    first_bad: dict[int, str] = {}
    for col in header:
        s = raw[col].str.strip()
        num = pd.to_numeric(s, errors="coerce")
        wrong = (s != "") & num.isna() & ~s.str.lower().isin(["nan", "-nan", "+nan"])
        for i in np.flatnonzero(wrong.to_numpy() & ~bad):
            first_bad[i] = f"unparseable number {s.iloc[i]!r} in column {col!r}"
        bad |= wrong.to_numpy()
        out[col] = num.astype(float)
    skipped += [(lines[i], f"{path}:{lines[i]}: {first_bad[i]}; skipped") for i in first_bad]
    out = out[~bad].reset_index(drop=True)
    if "step" not in out.columns:
        raise LogError(f"{path}: no 'step' column in the header {header[:8]}...; "
                       "is this a Lightning CSVLogger metrics.csv?")
    return out, [msg for _, msg in sorted(skipped)]


# ---------------------------------------------------------------------------------- config
def read_config(run_dir: Path) -> dict:
    """``config_resolved.yaml`` of a run dir (``{}`` when absent or unreadable)."""
    p = Path(run_dir) / "config_resolved.yaml"
    if not p.is_file():
        return {}
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError:
        return {}


def cfg_get(cfg: dict, dotted: str, default=None):
    """``cfg['a']['b']`` for ``'a.b'``; ``default`` when any level is missing."""
    cur = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return default if cur is None else cur


def grad_clip_of(cfg: dict, drafter: str) -> float | None:
    """Clip norm of one drafter: ``drafters.<name>.optim.grad_clip`` over ``optim.grad_clip``."""
    v = cfg_get(cfg, f"drafters.{drafter}.optim.grad_clip", cfg_get(cfg, "optim.grad_clip"))
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None


# ---------------------------------------------------------------------------------- loading
def _no_logs_error(d: Path) -> LogError:
    return LogError(
        f"{d}: no training logs found. Looked for {d / CSV_REL} (Lightning CSVLogger) and "
        f"{d}/{WANDB_GLOB}/run-*.wandb (W&B offline). Pass a run directory written by "
        "`python train.py` (outputs/<run_name>/<timestamp>/), a W&B offline run dir or its "
        ".wandb file, or wandb:entity/project/run_id; if the run was started with logger=null "
        "there is nothing to analyse (use logger=csv)."
    )


def _single_dir(d: Path, prefer: str) -> tuple[pd.DataFrame, str, list[str]]:
    """(merged per-step logs, source, skipped lines) of one run dir (no resume following)."""
    csv_path = d / CSV_REL
    wb = sorted(d.glob(WANDB_GLOB))
    if csv_path.is_file() and (prefer != "wandb" or not wb):
        raw, skipped = read_metrics_csv(csv_path)
        return merge_steps(raw), "csv", skipped
    if wb:
        return load_wandb_offline(wb), "wandb-offline", []
    raise _no_logs_error(d)


def _newest_child_run(d: Path) -> Path | None:
    """The newest run dir below ``d`` (``outputs/<run_name>`` → its latest timestamp)."""
    cands = [p.parent.parent for p in d.glob("*/" + str(CSV_REL))]
    cands += [p.parent.parent for p in d.glob("*/*/" + str(CSV_REL))]
    cands += [p.parent.parent for p in d.glob("*/" + WANDB_GLOB)]
    if not cands:
        return None
    return max(set(cands), key=lambda p: (p.stat().st_mtime, str(p)))


def _checkpoint_step(ckpt: str) -> int | None:
    m = re.search(r"step[=_-]?(\d+)", Path(ckpt).name)
    return int(m.group(1)) if m else None


def _resume_event(d: Path, df: pd.DataFrame, notes: list[str]) -> ResumeEvent | None:
    """The resume recorded in ``d/resumed_from.txt`` (None when the run was not resumed)."""
    rf = d / RESUME_FILE
    if not rf.is_file():
        return None
    text = rf.read_text().strip()
    if not text:
        notes.append(f"{rf}: empty; not following the resume")
        return None
    ckpt = text.splitlines()[0].strip()
    ck = Path(ckpt)
    prev = (ck if ck.is_absolute() else d / ck).parent.parent
    ck_step = _checkpoint_step(ckpt)
    if len(df):
        first = int(df["step"].min())
    else:
        first = ck_step if ck_step is not None else 0
        notes.append(f"{d}: resumed from {ckpt} but logged no rows yet")
    return ResumeEvent(step=first, from_dir=str(prev), into_dir=str(d), checkpoint=ckpt,
                       checkpoint_step=ck_step)


def _label(d: Path, cfg: dict) -> str:
    name = cfg_get(cfg, "run_name")
    return f"{name}/{d.name}" if name and name != d.name else f"{d.parent.name}/{d.name}"


def _resolve_path(path: Path, notes: list[str]) -> tuple[Path, list[Path] | None]:
    """Map a user path to (run dir, explicit W&B offline dirs or None)."""
    if path.is_file():
        if path.suffix == ".wandb":  # .../<run_dir>/wandb/offline-run-*/run-*.wandb
            return path.parent.parent.parent, [path.parent]
        if path.name == "metrics.csv":
            return path.parent.parent, None
        raise LogError(f"{path}: not a run directory, metrics.csv or .wandb file")
    if not path.is_dir():
        raise LogError(f"{path}: no such directory")
    if path.name.startswith(("offline-run-", "run-")) and list(path.glob("run-*.wandb")):
        return path.parent.parent, [path]
    if not (path / CSV_REL).is_file() and not list(path.glob(WANDB_GLOB)):
        child = _newest_child_run(path)
        if child is None:
            raise _no_logs_error(path)
        notes.append(f"{path} holds no logs itself; analysing its newest run {child}")
        return child, None
    return path, None


def load_run(path: str | Path, prefer: str = "csv") -> Run:
    """Load a run dir (or W&B offline run dir / ``.wandb`` file / ``outputs/<run_name>``).

    Follows ``resumed_from.txt`` chains: the earlier run (the parent of the checkpoint's
    ``checkpoints/`` dir) is loaded first and the logs are stitched in step order; from each
    resume step on, the resumed run's rows win. ``prefer="wandb"`` reads W&B offline history
    even when a CSV exists.
    """
    if isinstance(path, str) and path.startswith("wandb:"):
        df, cfg, label = load_wandb_api(path[len("wandb:"):])
        return Run(path=Path(label.replace("/", "_")), name=label, df=df, config=cfg,
                   source="wandb-api", dirs=[])
    notes: list[str] = []
    run_dir, wb_dirs = _resolve_path(Path(path).expanduser(), notes)
    if wb_dirs is not None:
        df = load_wandb_offline(wb_dirs)
        cfg = read_config(run_dir)
        return Run(path=run_dir, name=_label(run_dir, cfg), df=df, config=cfg,
                   source="wandb-offline", dirs=[run_dir], notes=notes)

    chain: list[tuple[Path, pd.DataFrame, str, list[str]]] = []
    events: list[ResumeEvent] = []  # newest first while walking back
    d, seen = run_dir.resolve(), set()
    while True:
        seen.add(d)
        df, source, skipped = _single_dir(d, prefer)
        chain.append((d, df, source, skipped))
        ev = _resume_event(d, df, notes)
        if ev is None:
            break
        events.append(ev)
        prev = Path(ev.from_dir)
        if prev.resolve() in seen:
            ev.found = False
            notes.append(f"{d / RESUME_FILE}: the resume chain loops back to {prev}; "
                         "stopped following it")
            break
        if not (prev / CSV_REL).is_file() and not list(prev.glob(WANDB_GLOB)):
            ev.found = False
            notes.append(f"{d / RESUME_FILE}: resumed from {ev.checkpoint}, but {prev} holds "
                         f"no logs (moved or deleted?); steps before {ev.step} are missing")
            break
        d = prev.resolve()
    chain.reverse()
    events.reverse()
    # stitch oldest -> newest: each later run wins from its resume step on
    followed = [e for e in events if e.found]
    frames, sources, skipped_all = [chain[0][1]], {chain[0][2]}, list(chain[0][3])
    for (_, df, source, skipped), ev in zip(chain[1:], followed):
        if len(df):  # a resumed run that logged nothing yet replaces nothing
            cut = ev.step if ev.checkpoint_step is None else min(ev.step, ev.checkpoint_step)
            frames = [f[f["step"] < cut] for f in frames] + [df]
        sources.add(source)
        skipped_all += skipped
    merged = pd.concat(frames, ignore_index=True, sort=False) if frames else pd.DataFrame()
    merged = merged.sort_values("step", kind="stable").reset_index(drop=True)
    cols = ["step"] + (["epoch"] if "epoch" in merged.columns else [])
    merged = merged[cols + sorted(c for c in merged.columns if c not in cols)]
    if merged.empty:
        notes.append("the logs hold no rows yet")
    cfg = read_config(run_dir)
    return Run(path=run_dir, name=_label(run_dir, cfg), df=merged, config=cfg,
               source="+".join(sorted(sources)), dirs=[c[0] for c in chain], resumes=events,
               skipped=skipped_all, notes=notes)
