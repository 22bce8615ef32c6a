"""Cost-model prediction of one decode token for Llama-3.1-8B and -70B, two-round vs one-round
combine (docs/scaling.md, "One round per layer"). Prints Markdown tables.

    PYTHONPATH=src python3 benchmarks/parallel/one_round_scaling.py

Per token = layers x (attention over the rank's N/p keys + the combine), as `treeattn simulate`
prices one layer on the dgx-h100 preset (bf16, batch 1). The projections, MLPs and sampling are
not in the model; they are the same for both combines.
"""

from __future__ import annotations

from treeattn.sim import PRESETS, DecodeShape, predict_decode
from treeattn.sim.model import allgather_combine, allreduce_combine, onepass_combine

MODELS = {"Llama-3.1-8B": dict(layers=32, heads=32, kv_heads=8), "Llama-3.1-70B": dict(layers=80, heads=64, kv_heads=8)}
SEQ_LENS = (131072, 524288, 1048576)
GPUS = (8, 16, 32, 64)


def main() -> None:
    h100 = PRESETS["dgx-h100"]
    for name, m in MODELS.items():
        print(f"\n### {name}: {m['layers']} layers, {m['heads']} query heads, {m['kv_heads']} KV heads of 128, bf16, batch 1\n")
        print("| N | GPUs | attention/layer (us) | allreduce combine/layer (us, steps) | onepass combine/layer (us, steps) "
              "| all-gather combine/layer (us, steps) | per token, allreduce (ms) | per token, onepass (ms) | saved |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n in SEQ_LENS:
            shape = DecodeShape(seq_len=n, heads=m["heads"], kv_heads=m["kv_heads"], head_dim=128, dtype="bf16")
            for p in GPUS:
                two = predict_decode(h100, shape, p, "allreduce")
                one = predict_decode(h100, shape, p, "onepass")
                attn = two.compute_seconds - h100.merge_seconds
                ar, op, ag = allreduce_combine(h100, shape, p), onepass_combine(h100, shape, p), allgather_combine(h100, shape, p)
                layers = m["layers"]
                print(f"| {n // 1024}K | {p} | {attn * 1e6:.1f} | {ar.seconds * 1e6:.1f} ({ar.rounds}) "
                      f"| {op.seconds * 1e6:.1f} + {h100.host_read_seconds * 1e6:.0f} read ({op.rounds}) "
                      f"| {ag.seconds * 1e6:.1f} ({ag.rounds}) | {layers * two.predicted_seconds * 1e3:.2f} "
                      f"| {layers * one.predicted_seconds * 1e3:.2f} | {1 - one.predicted_seconds / two.predicted_seconds:.0%} |")


if __name__ == "__main__":
    main()
