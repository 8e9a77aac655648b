"""One drafter against suffix decoding, pooled over the rounds of several head-to-head runs.

Each ``bench/engine_drafters.py`` run pairs its contestants within a round; a drafter that
ran in several of them (on the same prompts) has more paired rounds than any one run shows.
This reads their stored results and pools every round of ``--drafter`` against ``suffix``:
the tokens/s ratio, the ratio of the times per verify step, and the τ a drafter with that step
cost needs for ``--goal`` × suffix decoding's tokens/s, each as median [min-max] over rounds.

    python bench/engine_pooled.py engine_drafters_tiny200 engine_async_tiny200 \\
        engine_layers_tiny200 engine_iomp2_tiny200 --drafter shipped

Writes ``bench/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json

from common import RESULTS, fmt_table, write_result
from engine_drafters import spread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="names of engine_drafters.py results")
    ap.add_argument("--drafter", default="shipped", help="the contestant to pool")
    ap.add_argument("--goal", type=float, default=1.2)
    ap.add_argument("--name", default="engine_pooled_tiny200")
    args = ap.parse_args()
    tps, step, taus = [], [], set()
    for name in args.results:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            raise SystemExit(f"{name}: no {path.name} in bench/results (run bench/engine_drafters.py "
                             f"--name {name} first)")
        res = json.loads(path.read_text())
        if args.drafter not in res["tokens_per_s"] or "step_ms" not in res:
            raise SystemExit(f"{name}: no contestant {args.drafter!r} with step times "
                             f"(re-render it with this revision of bench/engine_drafters.py)")
        tps += [a / b for a, b in zip(res["tokens_per_s"][args.drafter], res["tokens_per_s"]["suffix"])]
        step += [a / b for a, b in zip(res["step_ms"][args.drafter], res["step_ms"]["suffix"])]
        taus |= {r["tau"] for r in res["rows"] if r["method"] == "suffix"}
    if len(taus) != 1:
        raise SystemExit(f"suffix decoding's τ differs between the results ({sorted(taus)}): "
                         "pool only runs over the same prompts")
    tau_suffix = taus.pop()
    row = {"drafter": args.drafter, "rounds": len(tps), "vs suffix (tokens/s)": spread(tps),
           "step / suffix step": spread(step),
           f"tau for {args.goal:g}x suffix": spread([args.goal * tau_suffix * r for r in step]),
           "suffix tau": tau_suffix}
    table = fmt_table([row]) + (
        f"\n\nPooled over the rounds of {', '.join(args.results)} (vLLM, each ratio within one "
        "round); median [min-max].")
    write_result(args.name, {"results": args.results, "tokens_per_s_ratio": tps,
                             "step_ratio": step, "row": row}, table)


if __name__ == "__main__":
    main()
