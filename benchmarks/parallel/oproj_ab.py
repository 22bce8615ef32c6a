"""The Helix layout's o_proj at --tp 1 on 2 ranks, two ways, alternated step by step inside one engine run.

    python benchmarks/parallel/oproj_ab.py MODEL --context 4096 --max-new-tokens 64

    whole  (since session 22) o_proj whole on both ranks, no collective: every rank of the KV group holds the
           heads' whole output after the combine
    split  (before) o_proj row-parallel over both ranks: rank r multiplies its half of the columns (the input
           narrowed by a pre-hook), then an all-reduce (sum) over the 2 ranks

Both run in the same pair of ranks (ta.spawn, the engine built inside the group, `tp=1`, packed weights): each rank
loads the model as the engine does (o_proj whole), then makes the split variant's half of every o_proj from it
(models.shards' packed column share: the file's blocks, the engine's activation format, its own huge-page arena)
and hooks it as the layout did before. Decode step k runs `whole` when k is even and `split` when odd, on both ranks
(every rank gets every plan), so the two alternate within seconds and the host's drift falls on both alike. One
prompt of --context random ids (prefilled once, with `whole`), --max-new-tokens greedy tokens; the first --warmup
decode steps are left out. Per rank and variant: thread CPU ms a step (time.thread_time_ns: preemption by other
processes does not count), wall ms a step (RankRunner.step's, waiting included) and the wall from one step's start
to the next (the driver and the plan included; rank 0), mean and median. The two variants' tokens can part where
float32 sums in another order round differently; the engine's own tests check the tokens.
"""

from __future__ import annotations

import random

import torch

from treeattn.bench import harness


def _split_variant(model, layout, group, activation_format: str) -> list:
    """Per layer, the split variant's o_proj: this rank's half of the columns, hooked as the layout did before."""
    from torch import nn

    from treeattn.engine.worker.tensor_parallel import ALIGN, split_bounds
    from treeattn.models.packed import pack_arena, set_activation_format
    from treeattn.models.shards import Cut, _packed_share
    from treeattn.parallel import comm

    width = model.config.num_heads * model.config.head_dim
    bounds = split_bounds(width, layout.kv, ALIGN)
    lo, hi = bounds[layout.kv_index], bounds[layout.kv_index + 1]
    halves = nn.ModuleList(_packed_share(layer.self_attn.o_proj, Cut(1, lo, hi), f"layers.{i}.self_attn.o_proj.weight")
                           for i, layer in enumerate(model.layers))
    set_activation_format(halves, activation_format)
    pack_arena(halves)
    for half in halves:
        half.register_forward_pre_hook(lambda m, args: (args[0][..., lo:hi],))
        half.register_forward_hook(lambda m, args, out: comm.all_reduce(out.contiguous(), torch.distributed.ReduceOp.SUM,
                                                                        group))
    return list(halves)


def _rank(rank: int, world_size: int, model: str, prompt: list[int], new_tokens: int, warmup: int,
          activation_format: str, kv_cache_dtype: str) -> dict:
    import treeattn as ta
    from treeattn.engine.worker.runner import RankRunner

    torch.set_num_threads(1)
    variants: dict[str, list] = {}
    make = RankRunner._groups

    def groups(self, *args, **kwargs):
        out = make(self, *args, **kwargs)
        variants["whole"] = [layer.self_attn.o_proj for layer in self.model.layers]
        variants["split"] = _split_variant(self.model, self.helix.layout, out[0], activation_format)
        return out

    RankRunner._groups = groups
    def install(runner, name):
        for layer, o_proj in zip(runner.model.layers, variants[name]):
            layer.self_attn.o_proj = o_proj

    times = harness.alternate_decode_steps(("whole", "split"), install, warmup)
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
    lines = harness.alternation_table(rows, ("whole", "split"))
    lines.append(f"load average before / after: {load} / {after}")
    print("\n".join(lines))
    harness.write_output(args.output, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
