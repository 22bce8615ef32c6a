"""2 ranks of one thread at --tp 1 (the MLP split over both ranks) against the sequence-only layout (the MLP whole on
each rank), alternated step by step inside one engine run.

    python benchmarks/parallel/mlp_split_ab.py MODEL --context 4096 --max-new-tokens 64

Since session 22 the two layouts differ, in a decode step, only in the MLP: at --tp 1 each rank multiplies half of
gate/up/down and one all-reduce (sum) a layer adds the halves; in the sequence-only layout each rank multiplies the
whole MLP, no collective. Attention (its projections whole, the KV cache split by sequence, one combine a layer), the
LM head (split by vocabulary on CPU ranks) and sampling are the same. The embedding is not (the sequence-only layout
holds the whole table; here both variants use --tp 1's split table and its one all-reduce a token).

Both run in the same pair of ranks (ta.spawn, the engine built inside the group with tp=1, packed weights): each rank
also loads the whole checkpoint and takes its layers' MLPs (fused, in the engine's activation format, in their own
huge-page arena). Decode step k runs `split` (--tp 1) when k is even and `whole` (the sequence-only layout's MLP) when
odd, on both ranks, so the host's drift falls on both alike. One prompt of --context random ids (prefilled with
`split`), --max-new-tokens greedy tokens, the first --warmup decode steps left out. Per rank and variant: thread CPU
ms a step, wall ms a step and rank 0's step start to the next, mean and median.
"""

from __future__ import annotations

import random

import torch

from treeattn.bench import harness


def _whole_mlps(path: str, activation_format: str) -> list:
    from torch import nn

    from treeattn.engine.worker.rank import load_model
    from treeattn.models.packed import fuse_projections, pack_arena, set_activation_format

    whole = load_model(path, None, None, "packed", None)
    mlps = nn.ModuleList(layer.mlp for layer in whole.layers)
    fuse_projections(mlps)
    set_activation_format(mlps, activation_format)
    pack_arena(mlps)
    return list(mlps)


def _rank(rank: int, world_size: int, model: str, prompt: list[int], new_tokens: int, warmup: int,
          activation_format: str, kv_cache_dtype: str) -> dict:
    import treeattn as ta
    from treeattn.engine.worker.runner import RankRunner

    torch.set_num_threads(1)
    variants: dict[str, list] = {}
    make = RankRunner._groups

    def groups(self, *args, **kwargs):
        out = make(self, *args, **kwargs)
        variants["split"] = [layer.mlp for layer in self.model.layers]
        variants["whole"] = _whole_mlps(model, activation_format)
        return out

    RankRunner._groups = groups
    def install(runner, name):
        for layer, mlp in zip(runner.model.layers, variants[name]):
            layer.mlp = mlp

    times = harness.alternate_decode_steps(("split", "whole"), install, warmup)
    engine = ta.Engine(model, tp=1, block_size=256, cache_tokens=len(prompt) + new_tokens + 256, weight_format="packed",
                       activation_format=activation_format, kv_cache_dtype=kv_cache_dtype)
    tokens = None
    if engine.is_driver:
        with engine:
            tokens = engine.generate([prompt], max_new_tokens=new_tokens, ignore_eos=True)[0].token_ids
    return {"rank": rank, "tokens": tokens, **harness.alternation_summary(times)}


def main() -> None:
    import treeattn as ta

    p = harness.parser(__doc__, model="required", context=4096, max_new_tokens=64)
    p.add_argument("--warmup", type=int, default=4, help="decode steps left out (both variants)")
    p.add_argument("--activation-format", default="int8", choices=["float32", "int8"])
    p.add_argument("--kv-cache-dtype", default="float16")
    args = harness.parse_args(p)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(args.context - args.max_new_tokens)]
    load = open("/proc/loadavg").read().split()[0]
    rows = ta.spawn(_rank, 2, args.model, prompt, args.max_new_tokens, args.warmup, args.activation_format,
                    args.kv_cache_dtype, timeout=3600)
    after = open("/proc/loadavg").read().split()[0]
    for r in rows:
        r.update(load_before=load, load_after=after)
    lines = harness.alternation_table(rows, ("split", "whole"))
    lines.append(f"load average before / after: {load} / {after}")
    print("\n".join(lines))
    harness.write_output(args.output, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
