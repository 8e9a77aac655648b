"""Recorded paths: relative to the repository, so shipped files name no build machine."""

from __future__ import annotations

from pathlib import Path

import yaml

from dflash_lit.paths import repo_relative

REPO = Path(__file__).resolve().parents[1]


def test_repo_relative_rewrites_paths_under_the_root_only(tmp_path):
    root = tmp_path / "repo"
    rec = {"paths": {"root_dir": str(root), "log_dir": f"{root}/outputs"},
           "sources": [{"path": f"{root}/artifacts/p.jsonl"}, {"path": "/elsewhere/q.jsonl"}],
           "seed": 0, "out": "rel/dir"}
    assert repo_relative(rec, root) == {
        "paths": {"root_dir": ".", "log_dir": "outputs"},
        "sources": [{"path": "artifacts/p.jsonl"}, {"path": "/elsewhere/q.jsonl"}],
        "seed": 0, "out": "rel/dir"}


def test_built_target_paths_are_recorded_against_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    rec = {"target": str(tmp_path / "cache" / "smollm2"), "other": "/elsewhere/x"}
    assert repo_relative(rec, tmp_path / "repo") == {"target": "$DFLASH_CACHE/smollm2",
                                                     "other": "/elsewhere/x"}


def _strings(v):
    """Every string leaf of a YAML document."""
    if isinstance(v, dict):
        return [s for x in v.values() for s in _strings(x)]
    if isinstance(v, list):
        return [s for x in v for s in _strings(x)]
    return [v] if isinstance(v, str) else []


def test_shipped_regenerate_configs_hold_no_absolute_path():
    files = sorted(REPO.glob("artifacts/*/data/*/regenerate_config.yaml"))
    files += sorted(REPO.glob("artifacts/*/data/*/summary.json"))  # JSON is YAML too
    assert files
    for f in files:
        absolute = [s for s in _strings(yaml.safe_load(f.read_text())) if s.startswith("/")]
        assert not absolute, f"{f}: {absolute}"
