"""Cluster cost model: predicted latency, communication and memory of every decoding method.

    from treeattn.sim import DecodeShape, load_cluster, predict_decode
    cluster = load_cluster("dgx-h100")
    p = predict_decode(cluster, DecodeShape(seq_len=5_120_000, heads=16, head_dim=128), 128, "tree")

    # a whole model's decode step in the 2-D (Helix) layout: 64 GPUs = 8 TP x 8 KV ranks
    from treeattn.sim import MODELS, Layout, predict_step
    step = predict_step(load_cluster("gb200-nvl72"), MODELS["llama-3.1-405b"], Layout.of("helix", 64, tp=8), 1_000_000)
"""

from treeattn.sim.hardware import PRESET_NAMES, PRESETS, Cluster, Link, load_cluster
from treeattn.sim.helix import LAYOUTS, MODELS, Layout, ModelShape, StepPrediction, predict_step
from treeattn.sim.model import (
    METHODS,
    GenerationPrediction,
    Prediction,
    memory_shortfall,
    predict_decode,
    predict_generation,
    speedup,
)
from treeattn.sim.workload import DecodeShape

__all__ = [
    "LAYOUTS",
    "METHODS",
    "MODELS",
    "PRESETS",
    "PRESET_NAMES",
    "Cluster",
    "DecodeShape",
    "GenerationPrediction",
    "Layout",
    "Link",
    "ModelShape",
    "Prediction",
    "StepPrediction",
    "load_cluster",
    "memory_shortfall",
    "predict_decode",
    "predict_generation",
    "predict_step",
    "speedup",
]
