"""The paper's closed forms for peak memory and communication volume (Tree Attention, section 6).

All in tensor elements per device, with b the batch, d = Hq x Dv the hidden size, n_h = Hq the
number of heads, p the number of devices and t = N / p the tokens each device holds:

    eq. 8   peak memory, ring:        4 b t d + 2 b d
    eq. 9   peak memory, tree:        2 b t d + 2 b d + 2 b n_h
    eq. 10  volume, ring pass-KV:     V_ring = 2 b t d x p
    eq. 13  numel(n, d, m)          = b d + 2 b n_h
    eq. 12  Allreduce volume        = 2 (p - 1) / p x numel
    eq. 14  volume, tree allreduce:   V_tree = 2 (p - 1) / p x (b d + 2 b n_h)

They assume multi-head attention (Hkv = Hq, D = Dv). t may be fractional (N / p exactly), so the
results are floats.
"""

from __future__ import annotations

from treeattn.sim.workload import DecodeShape


def _tokens_per_device(shape: DecodeShape, devices: int) -> float:
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return shape.seq_len / devices


def ring_peak_memory_elements(shape: DecodeShape, devices: int) -> float:
    """Eq. 8: 4 b t d + 2 b d."""
    b, d, t = shape.batch, shape.hidden, _tokens_per_device(shape, devices)
    return 4 * b * t * d + 2 * b * d


def tree_peak_memory_elements(shape: DecodeShape, devices: int) -> float:
    """Eq. 9: 2 b t d + 2 b d + 2 b n_h."""
    b, d, t = shape.batch, shape.hidden, _tokens_per_device(shape, devices)
    return 2 * b * t * d + 2 * b * d + 2 * b * shape.heads


def ring_volume_elements(shape: DecodeShape, devices: int) -> float:
    """Eq. 10: V_ring = 2 b t d x p (the K, V block counted once per device per step, p steps)."""
    b, d, t = shape.batch, shape.hidden, _tokens_per_device(shape, devices)
    return 2 * b * t * d * devices


def allreduce_volume_elements(numel: float, devices: int) -> float:
    """Eq. 12: a ring allreduce sends 2 (p - 1) / p x numel elements per device."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return 2 * (devices - 1) / devices * numel


def tree_volume_elements(shape: DecodeShape, devices: int) -> float:
    """Eq. 14: V_tree = 2 (p - 1) / p x (b d + 2 b n_h)."""
    numel = shape.batch * shape.hidden + 2 * shape.batch * shape.heads  # eq. 13
    return allreduce_volume_elements(numel, devices)
