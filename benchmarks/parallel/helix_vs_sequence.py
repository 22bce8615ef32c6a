"""Time per decoded token on 2 ranks: the Helix layout (tp=2: heads, MLP and vocabulary split; tp=1: the
heads whole, o_proj, MLP and vocabulary split) against the sequence-only layout (tp=None: every rank
holds and streams all the weights), alternated.

    python benchmarks/parallel/helix_vs_sequence.py --context 1024 --new 32 --rounds 2 [--hidden 1024 --layers 8]

A random Llama-shaped model (float32, tied embeddings) built on each rank from one seed; one torch
thread per rank; the prompt is `--context` tokens, then `--new` greedy tokens. Each round runs both
layouts, one after the other (their order rotates between rounds), and prints one JSON line per
run: layout, time_per_token_s, weight_bytes_per_rank, the machine's load average when it ended.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import treeattn as ta
from treeattn.models.llama import random_model


def _run(rank: int, world_size: int, shape: dict, context: int, new: int, tp) -> dict:
    torch.set_num_threads(1)
    config = ta.LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=4 * shape["hidden"],
                            num_layers=shape["layers"], num_heads=shape["hidden"] // 64, num_kv_heads=shape["hidden"] // 128,
                            head_dim=64, tie_word_embeddings=True, max_position_embeddings=context + new + 64)
    model = random_model(config, seed=0)
    prompt = torch.randint(0, config.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    result = ta.generate(model, prompt, max_new_tokens=new, ignore_eos=True, block_size=256, tp=tp)
    return {"layout": f"helix tp={tp}" if tp else "sequence-only", "time_per_token_s": result.time_per_token_s,
            "weight_bytes_per_rank": result.weight_bytes_per_rank, "generated_ids": result.generated_ids[0],
            "loadavg": open("/proc/loadavg").read().split()[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    shape = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    print(json.dumps({"command": "python benchmarks/parallel/" + os.path.basename(__file__), "args": vars(args)}), flush=True)
    tokens = {}
    for i in range(args.rounds):
        layouts = [None, 1, 2]
        for tp in layouts[i % 3:] + layouts[: i % 3]:
            out = ta.spawn(_run, 2, shape, args.context, args.new, tp, timeout=3600)[0]
            tokens.setdefault(out["layout"], out.pop("generated_ids"))
            out.pop("generated_ids", None)
            print(json.dumps({"round": i, **out}), flush=True)
    print(json.dumps({"same_tokens": len({tuple(t) for t in tokens.values()}) == 1}), flush=True)


if __name__ == "__main__":
    main()
