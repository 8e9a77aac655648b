"""Where a speculative step's time goes on this machine: the target's verify forward against the
number of tokens it verifies, and the drafter's block forward with its full-vocab head against a
head restricted to a draft vocabulary.

    python bench/step_cost.py --ckpt outputs/smollm2_long/checkpoints/last.ckpt --target smollm2

On a CPU a verify forward is not free per token the way it nearly is on a GPU: its cost grows
with the tokens verified, so a draft of 16 that commits 2 pays for 14 rejected ones. Reported as
milliseconds and as ratios to one-token decoding (the plain target's step) measured in the same
run: the numbers a draft length / tree budget rule for this machine needs.
"""

from __future__ import annotations

import argparse

import torch
from common import fmt_table, median_time, write_result

from dflash_lit.eval.loading import load_drafter
from dflash_lit.eval.speculative import DFlashProposer
from dflash_lit.eval.target_runner import TargetRunner
from dflash_lit.eval.verify_cost import measure as measure_verify_cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="training .ckpt or z-lab drafter directory")
    ap.add_argument("--target", default="smollm2", help="target directory or 'smollm2'")
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    ap.add_argument("--sizes", default="1,2,4,8,16,32", help="verified tokens per forward")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="restricted head size (timing only: its ids are the first ones)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--name", default="step_cost_smollm2")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    path = args.target
    if path == "smollm2":
        from dflash_lit.targets.smollm2 import default_dir

        path = str(default_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    drafter, _ = load_drafter(args.ckpt, dtype=torch.float32)
    runner = TargetRunner(model, list(drafter.config.target_layer_ids))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ctx = torch.randint(100, vocab, (args.context,), generator=gen).tolist()
    prefill = runner.forward(ctx, torch.arange(len(ctx)))

    cost = measure_verify_cost(runner, ctx, [int(s) for s in args.sizes.split(",")],
                               repeats=args.repeats)
    base = cost.seconds[0]
    rows = [{"what": f"target verify, {q} tokens", "ms": round(t * 1e3, 2),
             "vs_decode_step": round(t / base, 3)} for q, t in zip(cost.sizes, cost.seconds)]

    ids = torch.arange(args.draft_vocab)
    for name, vids in [("full vocab", None), (f"draft vocab {args.draft_vocab}", ids)]:
        prop = DFlashProposer(drafter, runner.embed_tokens, runner.lm_head, draft_vocab=vids)

        prop.observe(prefill.hidden[:, :-1])
        prop.draft_logits(ctx)  # the drafter's cache now holds all but the last position
        keys, values = list(prop.cache.keys), list(prop.cache.values)

        def draft(prop=prop, keys=keys, values=values):
            prop.cache.keys, prop.cache.values = list(keys), list(values)
            prop.observe(prefill.hidden[:, -1:])  # one newly committed token, as in decoding
            prop.draft_logits(ctx + [ctx[-1]])
        t = median_time(draft, repeats=args.repeats, warmup=2)
        rows.append({"what": f"drafter block of {prop.block_size}, {name}",
                     "ms": round(t * 1e3, 2), "vs_decode_step": round(t / base, 3)})
    table = fmt_table(rows, ["what", "ms", "vs_decode_step"])
    table += (f"\n\nfloat32 target and drafter, {args.context} tokens of context in the cache, "
              f"median of {args.repeats}; a drafter step adds one committed position to its cache "
              "and drafts a block, as in steady-state decoding.\n")
    write_result(args.name, {"rows": rows, "context": args.context}, table)


if __name__ == "__main__":
    main()
