"""Cluster cost model: predicted latency, communication and memory of every decoding method.

    from treeattn.sim import DecodeShape, load_cluster, predict_decode
    cluster = load_cluster("dgx-h100")
    p = predict_decode(cluster, DecodeShape(seq_len=5_120_000, heads=16, head_dim=128), 128, "tree")
"""

from treeattn.sim.hardware import PRESET_NAMES, PRESETS, Cluster, Link, load_cluster
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
    "METHODS",
    "PRESETS",
    "PRESET_NAMES",
    "Cluster",
    "DecodeShape",
    "GenerationPrediction",
    "Link",
    "Prediction",
    "load_cluster",
    "memory_shortfall",
    "predict_decode",
    "predict_generation",
    "speedup",
]
