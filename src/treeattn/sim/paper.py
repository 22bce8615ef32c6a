"""The Tree Attention paper's reported figures, and the cost model's predictions beside them.

Only numbers printed in the paper's text and tables are used (papers/tree-attention.txt):

- section 6.1: "close to 8x speedups when we use 128 GPUs on a sequence length of 5.12M"
  (16 heads x 128, bf16, DGX H100: 8 GPUs per node, NVLink 4, one 400 Gb/s NDR link per GPU);
  figures 4-5 themselves are images, their other points are not in the text;
- section 6.3: 640K tokens on 8 GPUs, hidden 2048, bf16: attention on one GPU O(1e-5) s, moving
  its K, V block to a neighbour O(1e-3) s;
- Table 1: prefill + 10 decoded tokens, Llama 3.1 8B, 8x H100 and 4x MI300X;
- Table 2: the same for Llama 3.2 1B on 2x RTX 4090 (PCIe).

`markdown_report()` renders the comparison tables of docs/scaling.md (`treeattn simulate --paper`).
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.sim.hardware import PRESETS, Cluster
from treeattn.sim.model import predict_decode, predict_generation
from treeattn.sim.workload import DecodeShape

PAPER_SPEEDUP_CLAIM = {"gpus": 128, "seq_len": 5_120_000, "speedup": 8.0}
FIGURE_GPUS = (8, 64, 128)
FIGURE_SEQ_LENS = (80_000, 160_000, 320_000, 640_000, 1_280_000, 2_560_000, 5_120_000)


@dataclass(frozen=True)
class Model:
    """Attention geometry of a Llama model (per layer)."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


LLAMA_31_8B = Model("Llama 3.1 8B", layers=32, heads=32, kv_heads=8, head_dim=128)
LLAMA_32_1B = Model("Llama 3.2 1B", layers=16, heads=32, kv_heads=8, head_dim=64)


@dataclass(frozen=True)
class TableRow:
    """One row of the paper's Table 1 or 2: seconds for prefill + 10 decoded tokens."""

    preset: str
    gpus: int
    model: Model
    seq_len: int
    tree_seconds: float
    ring_seconds: float


NEW_TOKENS = 10
TABLE_1 = [
    TableRow("dgx-h100", 8, LLAMA_31_8B, 32 * 1024, 0.60, 2.57),
    TableRow("dgx-h100", 8, LLAMA_31_8B, 64 * 1024, 1.08, 4.42),
    TableRow("dgx-h100", 8, LLAMA_31_8B, 128 * 1024, 2.68, 6.38),
    TableRow("dgx-h100", 8, LLAMA_31_8B, 256 * 1024, 2.89, 8.19),
    TableRow("mi300x", 4, LLAMA_31_8B, 32 * 1024, 1.05, 3.57),
    TableRow("mi300x", 4, LLAMA_31_8B, 64 * 1024, 2.36, 7.33),
    TableRow("mi300x", 4, LLAMA_31_8B, 128 * 1024, 6.43, 16.40),
    TableRow("mi300x", 4, LLAMA_31_8B, 256 * 1024, 15.30, 35.12),
]
TABLE_2 = [
    TableRow("rtx4090-pcie", 2, LLAMA_32_1B, 8000, 0.34, 1.38),
    TableRow("rtx4090-pcie", 2, LLAMA_32_1B, 16000, 0.58, 2.77),
    TableRow("rtx4090-pcie", 2, LLAMA_32_1B, 20000, 0.74, 3.47),
    TableRow("rtx4090-pcie", 2, LLAMA_32_1B, 32000, 1.01, 5.45),
]


def figure_shape(seq_len: int) -> DecodeShape:
    """The paper's section 6.1 block: 16 heads of dim 128, bf16, batch 1."""
    return DecodeShape(seq_len=seq_len, heads=16, head_dim=128, dtype="bf16")


def speedup_grid(cluster: Cluster, method: str = "allreduce") -> dict[tuple[int, int], float]:
    """(gpus, seq_len) -> predicted ring-kv time / `method` time, on the figure grid."""
    grid = {}
    for p in FIGURE_GPUS:
        for n in FIGURE_SEQ_LENS:
            ring = predict_decode(cluster, figure_shape(n), p, "ring-kv").predicted_seconds
            tree = predict_decode(cluster, figure_shape(n), p, method).predicted_seconds
            grid[(p, n)] = ring / tree
    return grid


def overhead_for_speedup(cluster: Cluster, gpus: int, seq_len: int, speedup: float, method: str = "allreduce") -> float:
    """The fixed per-step overhead O (paid by both methods) with (ring + O) / (tree + O) = speedup."""
    ring = predict_decode(cluster, figure_shape(seq_len), gpus, "ring-kv").predicted_seconds
    tree = predict_decode(cluster, figure_shape(seq_len), gpus, method).predicted_seconds
    return max(0.0, (ring - speedup * tree) / (speedup - 1))


def _n(n: int) -> str:
    if n % 1_000_000 == 0 or n >= 1_000_000:
        return f"{n / 1e6:g}M"
    return f"{n // 1000}K" if n % 1000 == 0 else f"{n // 1024}K"


def markdown_report() -> str:
    """Every comparison table of docs/scaling.md, in Markdown."""
    h100 = PRESETS["dgx-h100"]
    out = []
    grid = {m: speedup_grid(h100, m) for m in ("allreduce", "tree", "twolevel")}
    out.append("Predicted decode-step speedup of tree decoding over ring pass-KV, `dgx-h100` preset "
               "(allreduce / tree / twolevel):\n")
    out.append("| GPUs | " + " | ".join(_n(n) for n in FIGURE_SEQ_LENS) + " |")
    out.append("|---:|" + "---:|" * len(FIGURE_SEQ_LENS))
    for p in FIGURE_GPUS:
        cells = [
            f"{grid['allreduce'][(p, n)]:.0f} / {grid['tree'][(p, n)]:.0f} / {grid['twolevel'][(p, n)]:.0f}"
            for n in FIGURE_SEQ_LENS
        ]
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("Predicted decode-step latency (ms), ring pass-KV vs tree allreduce, `dgx-h100`:\n")
    out.append("| GPUs | " + " | ".join(_n(n) for n in FIGURE_SEQ_LENS) + " |")
    out.append("|---:|" + "---:|" * len(FIGURE_SEQ_LENS))
    for p in FIGURE_GPUS:
        cells = []
        for n in FIGURE_SEQ_LENS:
            ring = predict_decode(h100, figure_shape(n), p, "ring-kv").predicted_seconds
            tree = predict_decode(h100, figure_shape(n), p, "allreduce").predicted_seconds
            cells.append(f"{ring * 1e3:.3g} vs {tree * 1e3:.3g}")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    out.append("")
    claim = PAPER_SPEEDUP_CLAIM
    overhead = overhead_for_speedup(h100, claim["gpus"], claim["seq_len"], claim["speedup"])
    slow = h100.with_overrides(step_overhead=overhead)
    fitted = speedup_grid(slow)
    out.append(f"With a fixed software cost of {overhead * 1e3:.0f} ms per decode step added to both methods "
               f"(the value that makes the model give the paper's {claim['speedup']:.0f}x at {claim['gpus']} GPUs and "
               f"{_n(claim['seq_len'])}; `--step-overhead-us {overhead * 1e6:.0f}`), tree allreduce over ring pass-KV:\n")
    out.append("| GPUs | " + " | ".join(_n(n) for n in FIGURE_SEQ_LENS) + " |")
    out.append("|---:|" + "---:|" * len(FIGURE_SEQ_LENS))
    for p in FIGURE_GPUS:
        out.append(f"| {p} | " + " | ".join(f"{fitted[(p, n)]:.2f}" for n in FIGURE_SEQ_LENS) + " |")
    out.append("")
    out.append(f"Prefill + {NEW_TOKENS} decoded tokens, attention only (all layers), model vs the paper's Tables 1 and 2 "
               "(whole model). Seconds; speedup = ring / tree:\n")
    out.append(
        "| preset | GPUs | model | N | model tree | model ring | model speedup | paper tree | paper ring | paper speedup |"
    )
    out.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in TABLE_1 + TABLE_2:
        cluster = PRESETS[row.preset]
        shape = DecodeShape(seq_len=row.seq_len, heads=row.model.heads, head_dim=row.model.head_dim,
                            kv_heads=row.model.kv_heads, dtype="bf16")
        tree = predict_generation(cluster, shape, row.gpus, "allreduce", NEW_TOKENS, row.model.layers).predicted_seconds
        ring = predict_generation(cluster, shape, row.gpus, "ring-kv", NEW_TOKENS, row.model.layers).predicted_seconds
        out.append(
            f"| {row.preset} | {row.gpus} | {row.model.name} | {row.seq_len} | {tree:.3g} | {ring:.3g} | {ring / tree:.1f}x | "
            f"{row.tree_seconds:.2f} | {row.ring_seconds:.2f} | {row.ring_seconds / row.tree_seconds:.1f}x |"
        )
    out.append("")
    shape = DecodeShape(seq_len=640_000, heads=16, head_dim=128, dtype="bf16")  # hidden 2048
    tokens = shape.shard_tokens(8)
    from treeattn.sim.collectives import ring_pass
    from treeattn.sim.model import attention_seconds

    attn = attention_seconds(h100, shape, tokens)
    move = ring_pass(h100, 8, shape.kv_bytes(tokens)).seconds
    out.append(f"Section 6.3's example (640K tokens on 8 GPUs, hidden 2048, bf16): the model gives {attn * 1e6:.0f} us for one "
               f"GPU's "
               f"attention over its {tokens} tokens ({shape.kv_bytes(tokens) / 1e6:.0f} MB of K, V) and {move * 1e3:.2f} ms to "
               f"move "
               f"that block to a neighbour over NVLink; the paper says O(1e-5) s and O(1e-3) s.")
    return "\n".join(out)
