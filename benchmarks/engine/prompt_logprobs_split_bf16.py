"""The LM head's product for prompt logprobs as float32 (MKL) against bfloat16 products on AMX, plain and split.

    python3 benchmarks/engine/prompt_logprobs_split_bf16.py SmolLM2.gguf --context 1200 --repeats 3

Split products: x = x0 + x1 + x2 and W = W0 + W1 + W2, each part bfloat16-exact (x0 = bf16(x), x1 = bf16(x - x0), ...),
logits = the sum of the terms xi @ Wj.T with i + j < order ("split3": order 2, x0W0 + x0W1 + x1W0; "split6": order 3,
six terms), computed as ONE product of the parts concatenated along k (x' = [xi ...], W' = [Wj ...]) by oneDNN with
torch.backends.mkldnn.matmul.fp32_precision = "bf16": float32 tensors in and out, their values (bfloat16-exact here)
multiplied on AMX and accumulated in float32. "bf16x1" is the plain head in that mode (x and W rounded to bfloat16).

Accuracy: one engine prefills `context` random prompt tokens (1 rank, prompt_logprobs=0); the final hidden states that
the scoring receives are kept; each variant's logits of those rows over the whole vocabulary against float64
(x.double() @ W.double().T, W the head's float32 dequantization): max and mean abs error of the logits, of the
log-softmax values (computed in float64 from each variant's float32 logits: the product's error alone) and of the
targets' logprobs.

Speed: thread CPU seconds (1 torch thread) and process CPU + wall seconds (2 torch threads) of the product alone, for
one 512 x 576 x 2048 chunk (median of 9 calls) and for the whole 8000-row pass (16 blocks x 24 chunks, as
score_rows multiplies), variants alternated in a rotated order each repeat. Prints JSON; --output keeps it.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from treeattn.bench import harness
from treeattn.engine.worker import prompt_logprobs as pl

TERMS = {"split3": ((0, 0), (0, 1), (1, 0)),
         "split6": ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0))}
VARIANTS = ("fp32", "bf16x1", "split3", "split6")
TIMED = VARIANTS + ("split6_packed", "split6_bf16out")


def parts(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n bfloat16-exact float32 tensors summing to t within bfloat16's 8 bits to the n-th power."""
    out, rest = [], t.float()
    for _ in range(n):
        out.append(rest.bfloat16().float())
        rest = rest - out[-1]
    return out


def concat_x(x: torch.Tensor, name: str) -> torch.Tensor:
    if name not in TERMS:
        return x
    p = parts(x, 3)
    return torch.cat([p[i] for i, _ in TERMS[name]], dim=1)


def concat_w(w: torch.Tensor, name: str) -> torch.Tensor:
    if name not in TERMS:
        return w
    p = parts(w, 3)
    return torch.cat([p[j] for _, j in TERMS[name]], dim=1).contiguous()


def product(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The logits of x (concat_x's for a split variant) against w (concat_w's, or prepare's)."""
    if name == "split6_bf16out":  # speed only: bfloat16 in and OUT (the outputs rounded: not a usable product)
        return F.linear(x, w)
    if name == "split6_packed":
        name = "split6"
    mode = torch.backends.mkldnn.matmul
    mode.fp32_precision = "none" if name == "fp32" else "bf16"
    try:
        if w.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return F.linear(x, w)
    finally:
        mode.fp32_precision = "none"


def prepare(name: str, chunk: torch.Tensor) -> torch.Tensor:
    """A chunk of the head as variant `name` multiplies it (timing only)."""
    if name == "split6_bf16out":
        return concat_w(chunk, "split6").bfloat16()
    if name == "split6_packed":
        mode = torch.backends.mkldnn.matmul
        mode.fp32_precision = "bf16"
        try:
            return torch.ops.mkldnn._reorder_linear_weight(concat_w(chunk, "split6"), pl.ROWS_PER_BLOCK)
        finally:
            mode.fp32_precision = "none"
    return concat_w(chunk, name)


def prepare_x(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "split6_bf16out":
        return concat_x(x, "split6").bfloat16()
    return concat_x(x, "split6" if name == "split6_packed" else name)


def accuracy(hidden: torch.Tensor, targets: torch.Tensor, head: torch.Tensor) -> dict:
    heads = {name: concat_w(head, name) for name in VARIANTS}
    exact_w = head.double()
    stats = {name: {"max_logit": 0.0, "sum_logit": 0.0, "max_logsoftmax": 0.0, "sum_logsoftmax": 0.0,
                    "max_target_logprob": 0.0, "sum_target_logprob": 0.0} for name in VARIANTS}
    n = 0
    for lo in range(0, hidden.shape[0], 256):
        x, t = hidden[lo : lo + 256], targets[lo : lo + 256]
        exact = x.double() @ exact_w.T
        exact_ls = torch.log_softmax(exact, dim=-1)
        rows = torch.arange(len(t))
        for name in VARIANTS:
            logits = product(name, concat_x(x, name), heads[name]).double()
            ls = torch.log_softmax(logits, dim=-1)
            s = stats[name]
            err, lerr = (logits - exact).abs(), (ls - exact_ls).abs()
            terr = lerr[rows, t]
            s["max_logit"] = max(s["max_logit"], err.max().item())
            s["sum_logit"] += err.mean().item() * len(t)
            s["max_logsoftmax"] = max(s["max_logsoftmax"], lerr.max().item())
            s["sum_logsoftmax"] += lerr.mean().item() * len(t)
            s["max_target_logprob"] = max(s["max_target_logprob"], terr.max().item())
            s["sum_target_logprob"] += terr.mean().item() * len(t)
        n += len(t)
    out = {}
    for name, s in stats.items():
        out[name] = {k.replace("sum_", "mean_"): (v / n if k.startswith("sum_") else v) for k, v in s.items()}
    for name in VARIANTS[1:]:
        out[name]["max_target_logprob_vs_fp32"] = out[name]["max_target_logprob"] / out["fp32"]["max_target_logprob"]
        out[name]["max_logsoftmax_vs_fp32"] = out[name]["max_logsoftmax"] / out["fp32"]["max_logsoftmax"]
    w_parts = parts(head, 3)
    out["head_exact_in"] = {f"{k}_parts": bool(torch.equal(sum(w_parts[:k]).double(), head.double())) for k in (1, 2, 3)}
    return out


def timing(head: torch.Tensor, rows: int, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, head.shape[1], generator=g)
    columns = pl.vocab_columns(pl.ROWS_PER_BLOCK, head.shape[0], threads=1)
    chunks = {name: [prepare(name, head[c : c + columns]) for c in range(0, head.shape[0], columns)] for name in TIMED}
    clock = time.thread_time if threads == 1 else time.process_time
    one = {name: [] for name in TIMED}
    full = {name: {"cpu_s": [], "wall_s": []} for name in TIMED}
    block = {name: prepare_x(name, x[: pl.ROWS_PER_BLOCK]) for name in TIMED}
    for name in TIMED:  # warm: oneDNN's primitives made before any timed call
        product(name, block[name], chunks[name][0])
    for r in range(repeats):
        order = TIMED[r % len(TIMED):] + TIMED[: r % len(TIMED)]
        for name in order:
            calls = []
            for _ in range(9):
                c = clock()
                product(name, block[name], chunks[name][0])
                calls.append(clock() - c)
            one[name].append(statistics.median(calls))
        for name in order:  # the whole pass: x split once per block (inside the timing), as score_rows would
            c, w = clock(), time.perf_counter()
            for lo in range(0, rows, pl.ROWS_PER_BLOCK):
                xb = prepare_x(name, x[lo : lo + pl.ROWS_PER_BLOCK])
                for chunk in chunks[name]:
                    product(name, xb, chunk)
            full[name]["cpu_s"].append(round(clock() - c, 3))
            full[name]["wall_s"].append(round(time.perf_counter() - w, 3))
    flop = 2 * pl.ROWS_PER_BLOCK * head.shape[1] * columns
    chunk_s = {n: statistics.median(v) for n, v in one.items()}
    return {"threads": threads, "clock": clock.__name__, "chunk": [pl.ROWS_PER_BLOCK, head.shape[1], columns],
            "chunk_s_per_repeat": one, "chunk_s_median": chunk_s,
            "chunk_fp32_gflops_equiv": {n: round(flop / v / 1e9, 1) for n, v in chunk_s.items()},
            "chunk_ratio_vs_fp32": {n: round(chunk_s[n] / chunk_s["fp32"], 3) for n in TIMED},
            "full_pass": full,
            "full_cpu_ratio_vs_fp32_median": {n: round(statistics.median(
                a / b for a, b in zip(full[n]["cpu_s"], full["fp32"]["cpu_s"])), 3) for n in TIMED}}


def main() -> None:
    parser = harness.parser(__doc__, model="required", output=True, repeats=3, context=1200)
    parser.add_argument("--rows", type=int, default=8000, help="rows of the timed full pass")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    args = harness.parse_args(parser)
    result = {"model": args.model, "cpu": harness.cpu_model(), "loadavg_start": open("/proc/loadavg").read().split()[:3]}
    threads = torch.get_num_threads()
    if args.skip_accuracy:
        from treeattn.models.loader import load_model
        head = pl.dense_head(load_model(args.model, weight_format="auto"))
    else:
        hidden, targets, head = harness.scored_rows(args.model, args.context)
        result["rows"] = hidden.shape[0]
        result["accuracy"] = accuracy(hidden, targets, head)
        print(json.dumps(result, indent=1), flush=True)
    result["timing"] = [] if args.skip_timing else [timing(head, args.rows, args.repeats, t) for t in (1, 2)]
    torch.set_num_threads(threads)
    result["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(result, indent=1))
    harness.write_output(args.output, [result])


if __name__ == "__main__":
    main()
