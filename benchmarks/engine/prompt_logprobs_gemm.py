"""The LM head's float32 product for prompt logprobs: MKL (F.linear) against oneDNN's matmul, alternated, one thread.

    python3 benchmarks/engine/prompt_logprobs_gemm.py SmolLM2.gguf --repeats 3

The model's output projection in float32 (a packed GGUF head dequantized, as prompt_logprobs.dense_head keeps it)
times ROWS random rows (the scale of real final hidden states does not matter to the speed), a vocabulary chunk at
a time as _score_block takes it, by: F.linear (MKL's sgemm: what model.logits(weight=...) called before session
19), torch.mm with the head's transpose made contiguous once (the other operand layout), and oneDNN's matmul
(treeattn.ops.dense_linear.linear_float32), for several (rows, columns) shapes of one call; with --prepacked also
oneDNN's matmul of a weight held in oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight once per chunk)
and MKL's packed sgemm (torch.ops.mkl._mkl_reorder_linear_weight once per chunk, torch.ops.mkl._mkl_linear: what
torch.compile's inductor uses for float32 linears on x86), each packing made before the timed sweeps. One torch thread,
time.thread_time, the variants alternated in every repeat, so that a loaded machine moves all of them alike.
Prints one JSON object: each variant's GFLOPS per repeat, their median, the largest difference of the oneDNN
logits from MKL's and of both from float64 (one chunk), the load average at the start and the end.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from treeattn.bench import harness
from treeattn.ops.dense_linear import linear_float32, onednn_float32


def main() -> None:
    parser = harness.parser(__doc__, model="required", output=True, repeats=3)
    parser.add_argument("--shapes", nargs="+", default=["512x2048", "512x4096", "1024x1024", "2048x512"],
                        help="ROWSxCOLUMNS of one product call (rows of hidden states x vocabulary columns)")
    parser.add_argument("--prepacked", action="store_true", help="also time the two prepacked weights (see above)")
    args = harness.parse_args(parser)
    from treeattn.models.loader import load_model

    torch.set_num_threads(1)
    load_start = open("/proc/loadavg").read().split()[:3]
    model = load_model(args.model, weight_format="auto")
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    weight = head.dequantized() if hasattr(head, "dequantized") else head.weight.detach().float()
    vocab, width = weight.shape
    transposed = weight.T.contiguous()
    g = torch.Generator().manual_seed(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    hidden = {rows: torch.randn(rows, width, generator=g) for rows, _ in shapes}

    def sweep(product, rows, columns):
        for first in range(0, vocab, columns):
            product(hidden[rows], first, min(vocab, first + columns))

    variants = {"mkl F.linear": lambda h, a, b: F.linear(h, weight[a:b]),
                "mkl mm, head transposed": lambda h, a, b: torch.mm(h, transposed[:, a:b]),
                "onednn linear_float32": lambda h, a, b: linear_float32(h, weight[a:b])}
    if args.prepacked:
        packed = {}
        for rows, columns in shapes:
            for first in range(0, vocab, columns):
                part = weight[first:first + columns]
                packed[rows, first, first + part.shape[0]] = (torch.ops.mkldnn._reorder_linear_weight(part, rows),
                                                              torch.ops.mkl._mkl_reorder_linear_weight(part, rows))
        variants["onednn prepacked"] = lambda h, a, b: torch.ops.mkldnn._linear_pointwise(
            h, packed[h.shape[0], a, b][0], None, "none", [], "")
        variants["mkl packed sgemm"] = lambda h, a, b: torch.ops.mkl._mkl_linear(
            h, packed[h.shape[0], a, b][1], weight[a:b], None, h.shape[0])
    gflops = {f"{name} {rows}x{columns}": [] for rows, columns in shapes for name in variants}
    for _ in range(args.repeats):
        for rows, columns in shapes:
            for name, product in variants.items():
                start = time.thread_time()
                sweep(product, rows, columns)
                seconds = time.thread_time() - start
                gflops[f"{name} {rows}x{columns}"].append(round(2 * rows * vocab * width / seconds / 1e9, 1))
    h, w = hidden[shapes[0][0]], weight[: shapes[0][1]]
    exact = h.double() @ w.double().T
    mkl, onednn = F.linear(h, w), linear_float32(h, w)
    result = {"model": args.model, "vocab_size": vocab, "hidden_size": width, "onednn_float32": onednn_float32(),
              "gflops": gflops, "median_gflops": {k: statistics.median(v) for k, v in gflops.items()},
              "max_abs_logit": exact.abs().max().item(), "onednn_minus_mkl_max": (onednn - mkl).abs().max().item(),
              "mkl_minus_float64_max": (mkl.double() - exact).abs().max().item(),
              "onednn_minus_float64_max": (onednn.double() - exact).abs().max().item(),
              "loadavg_start": load_start, "loadavg_end": open("/proc/loadavg").read().split()[:3]}
    print(json.dumps(result, indent=1))
    harness.write_output(args.output, [result])


if __name__ == "__main__":
    main()
