"""Attention transfer (LoLCATs' first stage): train Hedgehog maps to reproduce softmax attention.

For each chosen layer, the original model is run over text once and the layer's rotated q, k, v
and its softmax attention output are recorded. The layer's two Hedgehog maps (phi_q, phi_k) are
then trained, with Adam on the CPU, so that linear attention over the same q, k, v reproduces that
output (mean squared error, relative to the output's mean square). No other weight changes: the
projections, MLPs and norms are the checkpoint's.

    model = ta.load_model(path)
    ids = model.tokenizer.encode(text).ids
    report = linearize(model, layers=[1, 3], token_ids=ids, seq_len=256)  # trains and installs the maps
    save_feature_maps(model, "maps/")

The errors before (identity maps) and after training are measured on held-out text with
attention_errors().
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from treeattn.linear.attention import linear_attention
from treeattn.linear.hybrid import LinearizedAttention, linearize_layers
from treeattn.ops import attention


@dataclass
class LayerRecord:
    """One layer's recorded softmax attention on text: q (N, L, Hq, D), k, v (N, L, Hkv, D), out (N, L, Hq, D), float32."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


@dataclass
class LinearizeReport:
    layers: list[int]
    loss_before: dict[int, float] = field(default_factory=dict)   # training loss (relative MSE) at identity maps
    loss_after: dict[int, float] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)


def sequences(token_ids: Sequence[int], seq_len: int, num_tokens: int | None = None) -> torch.Tensor:
    """int64 (N, seq_len): the first num_tokens ids (all by default) cut into whole sequences."""
    ids = list(token_ids)[:num_tokens]
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"token_ids: need at least seq_len={seq_len} tokens, got {len(ids)}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)


@torch.no_grad()
def record_attention(model, batch: torch.Tensor, layers: Sequence[int]) -> dict[int, LayerRecord]:
    """Run the model (softmax everywhere it is softmax; linear layers must not be among `layers`)
    over batch (N, L) and record q, k, v and the softmax output of `layers`."""
    wanted, recorded, current = set(layers), {}, {}
    N, L = batch.shape
    positions = torch.arange(L).expand(N, L)

    def kv_store(layer, k, v):
        current["layer"] = layer
        return k, v, positions

    def attend(q, k, v, *, q_pos, kv_pos, window):
        out = attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos, window=window)[0]
        if current["layer"] in wanted:
            recorded[current["layer"]] = LayerRecord(q.float(), k.float(), v.float(), out.float())
        return out

    for i in layers:
        if isinstance(model.layers[i].self_attn, LinearizedAttention):
            raise ValueError(f"layers: layer {i} is already linear; record from the original model")
    model(batch, positions, kv_store, attend)
    return recorded


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| over all elements."""
    return (torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact)).item()


def linear_output(attn: LinearizedAttention, record: LayerRecord) -> torch.Tensor:
    return linear_attention(record.q, record.k, record.v, feature_map=(attn.feature_map_q, attn.feature_map_k), causal=True)


def quadratic_linear_attention(attn: LinearizedAttention, record: LayerRecord) -> torch.Tensor:
    """The same outputs as linear_output, by the masked L x L kernel matrix: for training on short
    sequences only (seq_len of a few hundred), where it runs ~2x faster than the chunked form
    under autograd. Never used for inference."""
    G = attn.num_heads // attn.num_kv_heads
    fq = attn.feature_map_q(record.q)                                        # (N, L, Hq, F)
    fk = attn.feature_map_k(record.k).repeat_interleave(G, dim=2)
    scores = torch.einsum("nthf,nshf->nhts", fq, fk).tril()
    num = torch.einsum("nhts,nshd->nthd", scores, record.v.repeat_interleave(G, dim=2))
    return num / scores.sum(-1).transpose(1, 2).unsqueeze(-1)                # Hedgehog maps are > 0: no zero row


def train_layer(attn: LinearizedAttention, record: LayerRecord, *, steps: int, lr: float, batch: int) -> tuple[float, float]:
    """Adam on the layer's two maps; loss = mean((linear - softmax)^2) / mean(softmax^2). Returns (first, last) loss."""
    params = list(attn.feature_map_q.parameters()) + list(attn.feature_map_k.parameters())
    optimizer = torch.optim.Adam(params, lr=lr)
    scale = record.out.square().mean()
    generator = torch.Generator().manual_seed(attn.layer)
    N = record.q.shape[0]
    first = last = float("nan")
    for step in range(steps):
        rows = torch.randperm(N, generator=generator)[:batch]
        part = LayerRecord(record.q[rows], record.k[rows], record.v[rows], record.out[rows])
        loss = (quadratic_linear_attention(attn, part) - part.out).square().mean() / scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    return first, last


def linearize(model, layers: Sequence[int], token_ids: Sequence[int], *, seq_len: int = 256, num_tokens: int | None = None,
              feature_dim: int | None = None, steps: int = 100, lr: float = 1e-2, batch: int = 4, log=None) -> LinearizeReport:
    """Record the softmax attention of `layers` on token_ids, linearize those layers and train their maps.

    Args:
        model: a LlamaModel (float32 is best for training; the maps are float32 whatever the model).
        layers: layer indices to linearize.
        token_ids: training text, as token ids; the first num_tokens are cut into sequences of seq_len.
        feature_dim: Hedgehog features per map (default head_dim).
        steps, lr, batch: Adam steps per layer, learning rate, sequences per step.
        log: optional callable(str) for progress lines.

    Returns:
        LinearizeReport with each layer's training loss before and after, and seconds spent.
    """
    layers = sorted(layers)
    data = sequences(token_ids, seq_len, num_tokens)
    records = record_attention(model, data, layers)
    linearize_layers(model, layers, feature_dim)
    report = LinearizeReport(layers=list(layers))
    for i in layers:
        start = time.perf_counter()
        attn = model.layers[i].self_attn
        with torch.enable_grad():
            first, last = train_layer(attn, records[i], steps=steps, lr=lr, batch=batch)
        report.loss_before[i], report.loss_after[i] = first, last
        report.seconds[i] = time.perf_counter() - start
        if log is not None:
            log(f"layer {i}: relative MSE {first:.4f} -> {last:.4f} in {report.seconds[i]:.1f} s")
        for p in attn.parameters():
            p.grad = None
    return report


@torch.no_grad()
def attention_errors(model, layers: Sequence[int], records: dict[int, LayerRecord]) -> dict[int, float]:
    """Relative L2 error of each linear layer's output against the recorded softmax output."""
    return {i: relative_error(linear_output(model.layers[i].self_attn, records[i]), records[i].out) for i in layers}
