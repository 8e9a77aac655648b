"""Engine timings over several rounds: medians per method, ratios paired within rounds."""

from __future__ import annotations

import pytest

from dflash_lit.eval.report import vs_best_text
from dflash_lit.eval.vllm_engine import paired_ratio, round_timings


def _run(tokens: int, wall: float) -> dict:
    return {"requests": [{"tokens": [0] * tokens}], "wall_time_s": wall}


def test_ratios_are_paired_within_rounds_and_medians_over_them():
    # round 2 ran on a machine twice as slow: every method's wall time doubled
    rounds = [
        {"baseline": _run(100, 1.0), "chain": _run(100, 0.25), "suffix": _run(100, 0.3)},
        {"baseline": _run(100, 2.0), "chain": _run(100, 0.5), "suffix": _run(100, 0.6)},
        {"baseline": _run(100, 1.0), "chain": _run(100, 0.3), "suffix": _run(100, 0.25)},
    ]
    t = round_timings(rounds)
    assert t["chain"]["tokens_per_s_rounds"] == pytest.approx([400, 200, 1000 / 3])
    assert t["chain"]["tokens_per_s"] == pytest.approx(1000 / 3)  # median of the three
    assert t["chain"]["speedup_rounds"] == pytest.approx([4, 4, 10 / 3])
    assert t["chain"]["speedup"] == pytest.approx(4)
    assert t["baseline"]["speedup"] == pytest.approx(1)
    r = paired_ratio(t["chain"], t["suffix"])
    # per round 1.2, 1.2, 0.8333: the median is 1.2 although the medians' ratio is 1.0
    assert r["median"] == pytest.approx(1.2) and r["min"] == pytest.approx(0.25 / 0.3)
    assert r["max"] == pytest.approx(1.2) and r["rounds"] == 3
    assert t["chain"]["tokens_per_s"] / t["suffix"]["tokens_per_s"] == pytest.approx(1.0)
    report = {"vs_best": {"chain": r}, "methods": t, "best_model_free": "suffix"}
    assert vs_best_text(report, "chain") == "1.20x [0.83-1.20]"


def test_one_round_reads_as_a_plain_ratio():
    t = round_timings([{"baseline": _run(10, 1.0), "chain": _run(30, 1.0), "suffix": _run(20, 1.0)}])
    r = paired_ratio(t["chain"], t["suffix"])
    assert r == {"median": pytest.approx(1.5), "min": pytest.approx(1.5), "max": pytest.approx(1.5),
                 "rounds": 1}
    assert vs_best_text({"vs_best": {"chain": r}, "methods": t}, "chain") == "1.50x"
    # an older report without paired ratios: the ratio of the two tokens/s
    assert vs_best_text({"methods": t, "best_model_free": "suffix"}, "chain") == "1.50x"
