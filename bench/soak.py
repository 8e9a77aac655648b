"""Soak: the default experiment trained for thousands of steps while being killed and resumed at
random, next to the same run left alone. Reports whether both end in the same state (weights,
Adam moments, LR schedule, step), whether every logged loss agrees, resident memory and open
file descriptors over the steps, and any file or process a kill left behind.

    python bench/soak.py                                  # 2000 steps, ckpt every 100, a kill every 150-400 steps
    python bench/soak.py --steps 200 --every 50 --kill-every 40 90   # a few-minute check of the driver

Both runs are train.py subprocesses with one torch thread each, run side by side (the same
thread count keeps CPU kernels bit-reproducible). Kills are SIGKILL (half), SIGTERM or SIGUSR1,
sent at a random moment inside a step, so one can land mid-checkpoint-write or mid-validation.
After each kill the driver runs ``ckpt_path=last``, exactly as a user or SLURM requeue would.
Writes ``bench/results/soak.{json,md}`` and ``soak_rss.png``; run files stay in ``--workdir``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from common import REPO, RESULTS, fmt_table, write_result

from dflash_lit.analyze.logs import read_metrics_csv
from dflash_lit.paths import repo_relative

STEP_RE = re.compile(r"\bstep=(\d+) ")
KILLS = ("SIGKILL", "SIGKILL", "SIGTERM", "SIGUSR1")  # drawn uniformly: half are SIGKILL


def _proc_status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def descendants(pid: int) -> list[int]:
    """PIDs of every live process below ``pid`` (from /proc's PPid fields)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            pp = _proc_status(int(d.name)).get("PPid")
            if pp is not None:
                parent[int(d.name)] = int(pp.strip())
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def alive(pid: int) -> bool:
    st = _proc_status(pid).get("State", "")
    return bool(st) and not st.startswith("Z")


def rss_mb(pid: int) -> float:
    v = _proc_status(pid).get("VmRSS", "0 kB").split()[0]
    return int(v) / 1024


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


@dataclass
class Sample:
    arm: str          # "reference" or "soak"
    segment: int      # launch number within the arm
    t: float          # seconds since the driver started
    step: int         # last global step the process printed
    rss_mb: float     # resident memory of the train.py process
    child_rss_mb: float  # resident memory of its descendants (W&B service, ...)
    fds: int          # open file descriptors of the train.py process


class Watched:
    """A train.py subprocess whose stdout is parsed for ``step=N`` on one thread and whose
    RSS / fd count is sampled every ``interval`` seconds on another."""

    def __init__(self, arm: str, segment: int, args: list[str], cwd: Path, env: dict[str, str],
                 log: Path, samples: list[Sample], t0: float, interval: float,
                 kill: tuple[int, str, random.Random] | None = None) -> None:
        self.arm, self.segment, self.t0 = arm, segment, t0
        self.step, self.first_step = -1, -1
        # (gap, signal, rng): the reader thread sends ``signal`` once the launch has printed
        # ``gap`` steps past its first one, after a random share of one measured step, so the
        # signal lands inside the next step at any machine speed: how many kills a run gets
        # depends on the seed alone, never on timing.
        self.kill = kill
        self.sent: str | None = None
        self.kids: list[int] = []
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=cwd,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.started = time.time()
        self._samples, self._interval = samples, interval
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._reader.start()
        self._sampler.start()

    def _read(self) -> None:
        seen: list[float] = []  # arrival times of step lines: the launch's measured step time
        for line in self.proc.stdout:
            self.log.write(line)
            m = STEP_RE.search(line)
            if not m:
                continue
            self.step = int(m.group(1))
            seen.append(time.time())
            if self.first_step < 0:
                self.first_step = self.step
            if self.kill and self.sent is None and self.step >= self.first_step + self.kill[0]:
                step_s = (seen[-1] - seen[0]) / max(len(seen) - 1, 1) if len(seen) > 1 else 0.0
                time.sleep(self.kill[2].uniform(0.0, min(step_s, 1.0)))
                self.kids = descendants(self.proc.pid)
                if self.proc.poll() is None:
                    os.kill(self.proc.pid, getattr(signal, self.kill[1]))
                    self.sent = self.kill[1]
        self.log.flush()

    def _sample(self) -> None:
        pid = self.proc.pid
        while self.proc.poll() is None:
            kids = descendants(pid)
            s = Sample(self.arm, self.segment, round(time.time() - self.t0, 2), self.step,
                       round(rss_mb(pid), 1), round(sum(rss_mb(k) for k in kids), 1),
                       open_fds(pid))
            if s.rss_mb > 0:
                self._samples.append(s)
            time.sleep(self._interval)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        self.log.close()
        return rc


@dataclass
class Segment:
    index: int
    first_step: int       # first step printed by this launch
    last_step: int        # last step printed before it ended
    signal: str | None    # what the driver sent (None: ended by itself)
    returncode: int
    seconds: float
    resumed: bool
    orphans: list[int] = field(default_factory=list)  # descendants still alive 10 s after it ended


def redone_steps(segments: list[Segment]) -> int:
    """Steps trained twice: those a launch ran past its last checkpoint before a SIGKILL."""
    return sum(max(0, a.last_step - b.first_step + 1) for a, b in zip(segments, segments[1:]))


def newest_last_ckpt(root: Path) -> Path | None:
    found = sorted(root.glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def ckpt_step(path: Path | None) -> int:
    if path is None:
        return -1
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def _tensors(obj, prefix: str = ""):
    """(path, tensor-or-scalar) leaves of a nested checkpoint structure."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")
    elif isinstance(obj, torch.Tensor | int | float):
        yield prefix, obj


def compare_checkpoints(a: Path, b: Path) -> dict:
    """Leaf-by-leaf equality of weights, optimizer moments, LR schedulers and the step."""
    ca = torch.load(a, map_location="cpu", weights_only=True)
    cb = torch.load(b, map_location="cpu", weights_only=True)
    parts = {"state_dict": "weights", "optimizer_states": "optimizer", "lr_schedulers": "lr"}
    out: dict = {"global_step": [ca["global_step"], cb["global_step"]]}
    for key, name in parts.items():
        la, lb = dict(_tensors(ca[key])), dict(_tensors(cb[key]))
        differ, max_abs = [], 0.0
        for k in sorted(set(la) | set(lb)):
            x, y = la.get(k), lb.get(k)
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                same = x.shape == y.shape and torch.equal(x, y)
                if x.shape == y.shape and x.is_floating_point():
                    max_abs = max(max_abs, float((x - y).abs().max()) if x.numel() else 0.0)
            else:
                same = x == y
            if not same:
                differ.append(k)
        out[name] = {"leaves": len(la), "differ": len(differ), "first_differing": differ[:5],
                     "max_abs_diff": max_abs}
    out["identical"] = ca["global_step"] == cb["global_step"] and all(
        out[n]["differ"] == 0 for n in parts.values())
    return out


def logged_losses(run_dirs: list[Path], key: str = "train/main/loss") -> dict[int, str]:
    """step -> logged loss (as text, compared exactly); for steps logged by several launches
    the latest launch wins. Steps whose loss is missing or NaN are left out."""
    out: dict[int, str] = {}
    for d in sorted(run_dirs, key=lambda p: p.name):
        f = d / "csv" / "metrics.csv"
        if not f.is_file():
            continue
        df, _ = read_metrics_csv(f)
        if key in df:
            rows = df[["step", key]].dropna()
            out.update({int(st): repr(float(v)) for st, v in zip(rows["step"], rows[key])})
    return out


def leftovers(root: Path) -> dict:
    """Files a kill may leave: partial checkpoint temporaries and anything else unexpected."""
    tmp = sorted(str(p.relative_to(root)) for p in root.glob("**/.*.tmp-*"))
    ckpts = sorted(root.glob("**/checkpoints/*.ckpt"))
    return {"partial_temporaries": tmp, "checkpoint_files": len(ckpts),
            "checkpoint_MB": round(sum(p.stat().st_size for p in ckpts) / 1e6, 1),
            "run_dirs": len(list(root.glob("*/*/.hydra")))}


def rss_growth(samples: list[Sample]) -> dict:
    """Memory over a run's step span: median RSS early (10-30 % of the span, after warm-up) and
    late (the last 20 %), their difference, the least-squares slope after warm-up, the maximum,
    and the range of open fds. Per-batch RSS swings with sequence lengths; medians do not."""
    pts = sorted((s.step, s.rss_mb, s.fds) for s in samples if s.step >= 0)
    lo, hi = (pts[0][0], pts[-1][0]) if pts else (0, 0)
    span = hi - lo

    def window(a: float, b: float) -> list[float]:
        return sorted(y for x, y, _ in pts if lo + a * span <= x <= lo + b * span)

    early, late, warm = window(0.1, 0.3), window(0.8, 1.0), [p for p in pts if p[0] >= lo + 0.1 * span]
    if span <= 0 or not early or not late or len(warm) < 3:
        return {}
    n = len(warm)
    mx, my = sum(x for x, _, _ in warm) / n, sum(y for _, y, _ in warm) / n
    var = sum((x - mx) ** 2 for x, _, _ in warm)
    slope = sum((x - mx) * (y - my) for x, y, _ in warm) / var if var else 0.0
    med = lambda v: v[len(v) // 2]  # noqa: E731
    return {"steps": f"{lo}..{hi}", "rss_MB_median_early": med(early),
            "rss_MB_median_late": med(late), "rss_MB_late_minus_early": round(med(late) - med(early), 1),
            "rss_MB_max": max(y for _, y, _ in pts),
            "rss_slope_MB_per_1k_steps": round(slope * 1000, 2),
            "fds_min_max": [min(f for x, _, f in warm if 0 <= f and x < hi),
                            max(f for x, _, f in warm if x < hi)]}


def plot(samples: list[Sample], segments: list[Segment], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ref = [s for s in samples if s.arm == "reference" and s.step >= 0]
    ax1.plot([s.step for s in ref], [s.rss_mb for s in ref], color="black", lw=1.5,
             label="uninterrupted")
    ax2.plot([s.step for s in ref], [s.fds for s in ref], color="black", lw=1.5)
    for seg in segments:
        pts = [s for s in samples if s.arm == "soak" and s.segment == seg.index and s.step >= 0]
        if not pts:
            continue
        line, = ax1.plot([s.step for s in pts], [s.rss_mb for s in pts], lw=1,
                         label=f"launch {seg.index} ({seg.signal or 'end'})")
        ax2.plot([s.step for s in pts], [s.fds for s in pts], lw=1, color=line.get_color())
        if seg.signal:
            ax1.axvline(seg.last_step, color=line.get_color(), ls=":", lw=0.8)
    ax1.set_ylabel("train.py RSS (MB)")
    ax2.set_ylabel("open fds")
    ax2.set_xlabel("global step")
    ax1.legend(fontsize=7, ncol=3)
    ax1.set_title("soak: resident memory and open files over training (dotted: kills)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps of both runs")
    ap.add_argument("--every", type=int, default=100, help="checkpoint cadence (steps)")
    ap.add_argument("--kill-every", type=int, nargs=2, default=(150, 400), metavar=("LO", "HI"),
                    help="steps between a launch's first step and its kill, drawn uniformly")
    ap.add_argument("--seed", type=int, default=0, help="draws of kill steps, moments, signals")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--orphan-wait", type=float, default=10.0,
                    help="seconds a killed run's helper processes get to exit before they count")
    ap.add_argument("--workdir", default=None, help="run files (default outputs/soak/<time>)")
    ap.add_argument("--overrides", nargs="*",
                    default=["experiment=v5_hardce", "data.token_budget=1024",
                             "~callbacks.progress_bar", "trainer.enable_progress_bar=false"],
                    help="train.py overrides of both runs (default: the default experiment, "
                         "batches of 1024 padded tokens so 2000 steps take ~40 min)")
    ap.add_argument("--name", default="soak", help="result file name")
    ap.add_argument("--results", default=str(RESULTS), help="where the result files go")
    args = ap.parse_args()

    work = Path(args.workdir or REPO / "outputs" / "soak" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    work.mkdir(parents=True, exist_ok=True)
    common = [*args.overrides, f"trainer.max_steps={args.steps}", "trainer.max_epochs=-1",
              f"callbacks.model_checkpoint.every_n_train_steps={args.every}",
              "callbacks.status_line.every_n_steps=1"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    env.setdefault("WANDB_MODE", "offline")
    rng = random.Random(args.seed)
    samples: list[Sample] = []
    t0 = time.time()

    def launch(arm: str, seg: int, extra: list[str], kill=None) -> Watched:
        root = work / arm
        root.mkdir(exist_ok=True)
        return Watched(arm, seg, [*common, f"paths.log_dir={root}/outputs", *extra], root, env,
                       root / f"launch{seg}.log", samples, t0, args.interval, kill)

    ref = launch("reference", 0, [])
    soak_root = work / "soak" / "outputs"
    segments: list[Segment] = []
    while True:
        seg = len(segments)
        resume = newest_last_ckpt(work / "soak") is not None
        kill = (rng.randint(*args.kill_every), rng.choice(KILLS), random.Random(rng.random()))
        w = launch("soak", seg, ["ckpt_path=last"] if resume else [], kill)
        rc = w.wait(timeout=900)
        sent, kids = w.sent, w.kids
        time.sleep(args.orphan_wait)  # helpers (the W&B service) watch their parent's PID
        orphans = [k for k in kids if alive(k)]
        for k in orphans:
            os.kill(k, signal.SIGKILL)
        segments.append(Segment(seg, w.first_step, w.step, sent, rc,
                                round(time.time() - w.started, 1), resume, orphans))
        print(f"soak launch {seg}: steps {w.first_step}..{w.step}, {sent or 'ended'} rc={rc}"
              f"{', orphans ' + str(orphans) if orphans else ''}", flush=True)
        if sent is None and rc != 0:
            raise SystemExit(f"soak launch {seg} failed on its own (rc={rc}): see "
                             f"{work / 'soak' / f'launch{seg}.log'}")
        if ckpt_step(newest_last_ckpt(soak_root)) >= args.steps:
            break
    rc = ref.wait(timeout=24 * 3600)
    if rc != 0:
        raise SystemExit(f"reference run failed (rc={rc}): {work / 'reference' / 'launch0.log'}")
    wall = round(time.time() - t0, 1)

    ref_ckpt = newest_last_ckpt(work / "reference")
    cmp = compare_checkpoints(ref_ckpt, newest_last_ckpt(soak_root))
    ref_loss = logged_losses([p.parent for p in (work / "reference").glob("outputs/*/*/.hydra")])
    soak_loss = logged_losses([p.parent for p in soak_root.glob("*/*/.hydra")])
    common_steps = sorted(set(ref_loss) & set(soak_loss))
    loss_mismatch = [s for s in common_steps if ref_loss[s] != soak_loss[s]]
    kills = [s.signal for s in segments if s.signal]
    summary = {
        "steps": args.steps, "checkpoint_every": args.every, "launches": len(segments),
        "kills": {k: kills.count(k) for k in sorted(set(kills))},
        "identical_final_state": cmp["identical"],
        "loss_steps_compared": len(common_steps), "loss_steps_differing": len(loss_mismatch),
        "steps_redone": redone_steps(segments),
        "orphan_processes": sum(len(s.orphans) for s in segments),
        "wall_s": wall,
    }
    payload = {
        "summary": summary, "overrides": common, "threads": args.threads, "workdir": str(repo_relative(str(work.resolve()))),
        "segments": [asdict(s) for s in segments], "final_state": cmp,
        "memory_reference": rss_growth([x for x in samples if x.arm == "reference"]),
        "memory_soak_by_launch": [{"launch": s.index, **rss_growth(
            [x for x in samples if x.arm == "soak" and x.segment == s.index])}
            for s in segments],
        "leftovers": {"soak": leftovers(soak_root),
                      "reference": leftovers(work / "reference" / "outputs")},
        "loss_first_differing_steps": loss_mismatch[:10],
        "samples": [asdict(s) for s in samples],
    }
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    plot(samples, segments, results / f"{args.name}_rss.png")
    rows = [{"launch": s.index, "steps": f"{s.first_step}..{s.last_step}",
             "ended_by": s.signal or "finished", "rc": s.returncode, "seconds": s.seconds,
             "orphans": len(s.orphans)} for s in segments]
    mem = payload["memory_reference"]
    table = "\n\n".join([
        fmt_table([summary]),
        fmt_table(rows),
        fmt_table([{"run": "uninterrupted", **{k: v for k, v in mem.items()}}]),
        fmt_table([{"arm": k, **{kk: (len(vv) if isinstance(vv, list) else vv)
                                 for kk, vv in v.items()}}
                   for k, v in payload["leftovers"].items()]),
    ])
    write_result(args.name, payload, table, results)
    if not cmp["identical"] or loss_mismatch:
        raise SystemExit("soak: the interrupted run did NOT end identical to the uninterrupted one")


if __name__ == "__main__":
    main()
