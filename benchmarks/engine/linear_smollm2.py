"""SmolLM2-135M with linear layers (Hedgehog maps from `treeattn linearize`) against the original.

    treeattn linearize SmolLM2.gguf --layers odd --text papers/tree-attention.txt --tokens 1024 --out maps/
    python benchmarks/engine/linear_smollm2.py SmolLM2.gguf maps/ --heldout papers/bifurcated-attention.txt [--parts ...]

Parts:
  errors      per linear layer, the relative L2 error of its attention output against the layer's
              softmax output on held-out text: identity (untrained) maps vs the trained maps.
  perplexity  held-out perplexity with 0, ~25 % ("every:4+1") and 50 % ("odd") of the layers linear.
  decode      KV bytes per token and the time of one decode step at --context tokens, all-softmax vs
              50 % linear, on 1 and 2 ranks (softmax layers' cache sharded, tree-decoded). The cache
              is filled with random keys/values and the linear states with random sums: a decode
              step's time does not depend on their values, and an 8K-token prefill of a 135M model
              takes minutes on this machine.
  needle      a needle-in-a-haystack question (treeattn.eval.haystack, --needle-tokens of context),
              greedy, for 0, 25 and 50 % linear layers: the reply and whether it has the answer.
Prints one JSON object per line.
"""

from __future__ import annotations

import json
import math
import statistics
import time

import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.bench import harness
from treeattn.cache import ShardedKVCache
from treeattn.commands.linearize import _layers
from treeattn.linear.hybrid import HybridStore, LinearStates, linear_layers, linearize_layers, load_hybrid, softmax_index
from treeattn.linear.kernel import LinearAttentionState
from treeattn.linear.linearize import attention_errors, record_attention, sequences
from treeattn.models.attention import LocalAttention, TreeAttention

FRACTIONS = {"0%": None, "25%": "every:4+1", "50%": "odd"}


def model_with(path, maps, spec):
    if spec is None:
        return ta.load_model(path)
    base = ta.load_model(path)
    return load_hybrid(path, maps, _layers(spec, base.config.num_layers))


def forward(model, ids, attend=None, *, rank=0, world=1, pieces=None):
    """Logits (1, S, V) of ids (1, S) on one rank of `world` (every rank runs every token)."""
    index = softmax_index(model)
    cfg = model.config
    cache = ShardedKVCache(num_layers=max(len(index), 1), num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           capacity=ids.shape[1], rank=rank, world_size=world, dtype=model.dtype)
    states, out, start = LinearStates(), [], 0
    attend = attend or LocalAttention()
    for n in pieces or [ids.shape[1]]:
        positions = torch.arange(start, start + n).unsqueeze(0)
        slots = cache.extend(positions)
        store = HybridStore(cache.update(slots, slots.owned if world > 1 else None), states, index)
        out.append(model.logits(model(ids[:, start:start + n], positions, store, attend)))
        start += n
    return torch.cat(out, dim=1)


@torch.inference_mode()
def perplexity(model, data: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for row in data:
        logits = forward(model, row[None])[0, :-1]
        nll += torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum").item()
        count += row.numel() - 1
    return math.exp(nll / count)


def part_errors(args, held):
    base = ta.load_model(args.model)
    trained = model_with(args.model, args.maps, "odd")
    layers = linear_layers(trained)
    records = record_attention(base, sequences(held, args.seq_len, args.heldout_tokens), layers)
    untrained = ta.load_model(args.model)
    linearize_layers(untrained, layers, trained.layers[layers[0]].self_attn.feature_map_q.feature_dim)
    before, after = attention_errors(untrained, layers, records), attention_errors(trained, layers, records)
    for i in layers:
        print(json.dumps({"part": "errors", "layer": i, "identity_maps": round(before[i], 4), "trained": round(after[i], 4)}),
              flush=True)
    print(json.dumps({"part": "errors", "mean_identity": round(statistics.mean(before.values()), 4),
                      "mean_trained": round(statistics.mean(after.values()), 4)}), flush=True)


def part_perplexity(args, held):
    data = sequences(held, args.seq_len, args.heldout_tokens)
    for name, spec in FRACTIONS.items():
        model = model_with(args.model, args.maps, spec)
        ppl = perplexity(model, data)
        print(json.dumps({"part": "perplexity", "linear": name, "layers": list(linear_layers(model)),
                          "tokens": data.numel(), "perplexity": round(ppl, 3)}), flush=True)


def decode_worker(rank, world, path, maps, spec, context, steps):
    torch.set_num_threads(max(1, 2 // world))
    model = model_with(path, maps, spec)
    cfg = model.config
    index = softmax_index(model)
    group = dist.group.WORLD if world > 1 else None
    cache = ShardedKVCache(num_layers=len(index), num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           capacity=context + steps + 2, rank=rank, world_size=world, dtype=model.dtype)
    g = torch.Generator().manual_seed(rank)
    positions = torch.arange(context).unsqueeze(0)
    slots = cache.extend(positions)
    for layer in range(len(index)):  # a filled cache: random keys/values at `context` positions
        shape = (1, slots.num_owned, cfg.num_kv_heads, cfg.head_dim)
        cache.write(layer, slots, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    states = LinearStates()
    for i in linear_layers(model):
        F = model.layers[i].self_attn.feature_map_q.out_features
        states.states[i] = LinearAttentionState(torch.randn(1, cfg.num_kv_heads, F, cfg.head_dim,
                                                            generator=torch.Generator().manual_seed(i)),
                                                torch.rand(1, cfg.num_kv_heads, F,
                                                           generator=torch.Generator().manual_seed(i)) * context)
    attend = TreeAttention(method="onepass", group=group) if world > 1 else LocalAttention()
    times = []
    token = torch.tensor([[1]])
    with torch.inference_mode():
        for step in range(steps + 2):
            pos = torch.tensor([[context + step]])
            if group is not None:
                dist.barrier()
            start = time.perf_counter()
            s = cache.extend(pos)
            model.logits(model(token, pos, HybridStore(cache.update(s, s.owned if world > 1 else None), states, index), attend))
            elapsed = torch.tensor([time.perf_counter() - start])
            if group is not None:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= 2:
                times.append(elapsed.item())
    return {"step_ms": statistics.median(times) * 1e3, "kv_bytes_per_token": cache.bytes_per_token,
            "cache_bytes_this_rank": cache.nbytes(), "linear_state_bytes": states.nbytes()}


def part_decode(args):
    rows = {}
    for world in (1, 2):
        for name in ("0%", "50%"):
            r = ta.spawn(decode_worker, world, args.model, args.maps, FRACTIONS[name], args.context, args.steps)[0]
            rows[(world, name)] = r
            print(json.dumps({"part": "decode", "ranks": world, "linear": name, "context": args.context,
                              "step_ms": round(r["step_ms"], 2), "kv_bytes_per_token": r["kv_bytes_per_token"],
                              "linear_state_bytes": r["linear_state_bytes"],
                              "cache_bytes_rank0": r["cache_bytes_this_rank"]}), flush=True)
        print(json.dumps({"part": "decode", "ranks": world, "hybrid/softmax step time":
                          round(rows[(world, "50%")]["step_ms"] / rows[(world, "0%")]["step_ms"], 3),
                          "hybrid/softmax kv bytes per token":
                          round(rows[(world, "50%")]["kv_bytes_per_token"] / rows[(world, "0%")]["kv_bytes_per_token"], 3)}),
              flush=True)


@torch.inference_mode()
def part_needle(args):
    from treeattn.eval.haystack import is_correct, needle_case

    for name, spec in FRACTIONS.items():
        model = model_with(args.model, args.maps, spec)
        case = needle_case(model.tokenizer, model.chat_template, context_tokens=args.needle_tokens, depth=0.5, seed=0)
        ids = torch.tensor([case.prompt_ids])
        generated = []
        index = softmax_index(model)
        cfg = model.config
        cache = ShardedKVCache(num_layers=max(len(index), 1), num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                               capacity=ids.shape[1] + args.max_new_tokens)
        states, attend = LinearStates(), LocalAttention()
        tokens, start = ids, 0
        for _ in range(args.max_new_tokens):
            positions = torch.arange(start, start + tokens.shape[1]).unsqueeze(0)
            logits = model.logits(model(tokens, positions, HybridStore(cache.update(cache.extend(positions)), states, index),
                                        attend)[:, -1])
            start += tokens.shape[1]
            nxt = int(logits.argmax(-1))
            if nxt in cfg.eos_token_ids:
                break
            generated.append(nxt)
            tokens = torch.tensor([[nxt]])
        reply = model.tokenizer.decode(generated)
        print(json.dumps({"part": "needle", "linear": name, "context_tokens": ids.shape[1], "answer": case.answer,
                          "reply": reply, "correct": is_correct(reply, case)}), flush=True)


def main() -> None:
    parser = harness.parser(__doc__, model="required", context=8192, max_new_tokens=16, threads=2, output=False)
    parser.add_argument("maps")
    parser.add_argument("--heldout", required=True)
    parser.add_argument("--heldout-tokens", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--needle-tokens", type=int, default=1024)
    parser.add_argument("--parts", nargs="+", default=["errors", "perplexity", "decode", "needle"])
    args = harness.parse_args(parser)
    torch.set_num_threads(args.threads)
    model = ta.load_model(args.model)
    held = model.tokenizer.encode(open(args.heldout, encoding="utf-8").read()).ids
    for part in args.parts:
        {"errors": lambda: part_errors(args, held), "perplexity": lambda: part_perplexity(args, held),
         "decode": lambda: part_decode(args), "needle": lambda: part_needle(args)}[part]()


if __name__ == "__main__":
    main()
