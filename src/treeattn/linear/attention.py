"""linear_attention: the public entry point, on one device or across the ranks of a group."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from treeattn.linear.exchange import EXCHANGE_METHODS, exchange_states
from treeattn.linear.feature_maps import accumulation_dtype, resolve_feature_map
from treeattn.linear.kernel import DEFAULT_CHUNK, LinearAttentionState, apply_feature_maps, chunked_linear_attention, span_state
from treeattn.ops.validation import check_qkv
from treeattn.parallel import comm
from treeattn.parallel.metadata import UNKNOWN, Digest, device_code, dtype_code, tensor_digest, validate_and_agree

# Measured with benchmarks/parallel/linear_exchange.py (docs/linear.md): on gloo over loopback the single
# all-gather beat the log2(p)-round scan at every p measured, so it is the default.
DEFAULT_METHOD = "allgather"


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map="elu",
    causal: bool = True,
    group: dist.ProcessGroup | None = None,
    return_state: bool = False,
    initial_state: LinearAttentionState | None = None,
    method: str = DEFAULT_METHOD,
    chunk: int = DEFAULT_CHUNK,
    check_inputs: bool = True,
):
    """Linear (kernel) attention, exact, on one device or sequence-parallel across a group.

        out_t = phi(q_t) . S_t / (phi(q_t) . z_t),  S_t = sum_s phi(k_s) v_s^T,  z_t = sum_s phi(k_s)

    over the keys s query t may see: every key (causal=False) or s <= t (causal=True), plus the
    keys summarized by `initial_state`. Computed in chunks of `chunk` tokens with float32
    accumulation (float64 for float64 inputs); no S x S matrix is formed.

    Args:
        q: (B, S, Hq, D) float32, float16, bfloat16 or float64. B and S may be 0.
        k: (B, S, Hkv, D), same dtype and device; Hq % Hkv == 0 (GQA: query head h reads KV head
            h // (Hq // Hkv); Hkv == 1 is MQA).
        v: (B, S, Hkv, Dv).
        feature_map: "elu" (elu(x) + 1), "relu", a callable mapping (B, S, H, D) to (B, S, H, F)
            (e.g. a treeattn.linear.HedgehogFeatureMap), or a pair (phi_q, phi_k) of such callables.
        causal: query t sees keys s <= t of this call (and the initial state); else all of them.
        group: None: one process. A process group: this rank holds the r-th contiguous chunk of
            the sequence (rank order = sequence order; chunks may have any length, 0 too) and gets
            the outputs of its own chunk exactly, its incoming state coming from the ranks before
            it. Every rank must call with the same B, H, D, Dv, dtype, feature map and flags.
        return_state: also return the state after the whole sequence (all ranks' keys),
            identical on every rank: decoding continues from it with no communication.
        initial_state: a LinearAttentionState (kv (B, Hkv, F, Dv), k_sum (B, Hkv, F)) of keys before
            the sequence, e.g. the state a prefill returned; the same on every rank. None: empty.
        method: how ranks exchange states: "allgather" (one collective) or "scan" (ceil(log2 p)
            p2p rounds); see treeattn.linear.exchange. Results agree up to float32 rounding.
        chunk: tokens per block of the causal computation (memory O(chunk^2) per head).
        check_inputs: with a group, all-gather a few integers first so that ranks that disagree
            (shapes, dtype, flags, initial state) raise the same ValueError instead of hanging.

    Returns:
        out: (B, S, Hq, Dv) in q.dtype. A row whose denominator is 0 (it sees no key, or relu maps
            its query or keys to 0) is 0, never NaN.
        state (only with return_state=True): LinearAttentionState in float32 (float64 for float64
            inputs).

    Example:
        >>> import torch, treeattn as ta
        >>> q, k, v = torch.randn(1, 10, 4, 16), torch.randn(1, 10, 2, 16), torch.randn(1, 10, 2, 16)
        >>> out, state = ta.linear_attention(q[:, :9], k[:, :9], v[:, :9], return_state=True)
        >>> step = ta.linear_attention(q[:, 9:], k[:, 9:], v[:, 9:], initial_state=state)  # decode
        >>> full = ta.linear_attention(q, k, v)
        >>> torch.allclose(torch.cat([out, step], dim=1), full, atol=1e-5)
        True
    """
    distributed = group is not None and comm.group_size(group) > 1

    def validate():
        B, S, _, Hq, Hkv, D, Dv = check_qkv(q, k, v)
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"q and k must have the same sequence length S (self-attention), got q {tuple(q.shape)} and k "
                             f"{tuple(k.shape)}")
        for name, flag in (("causal", causal), ("return_state", return_state), ("check_inputs", check_inputs)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if method not in EXCHANGE_METHODS:
            raise ValueError(f"method must be one of {EXCHANGE_METHODS}, got {method!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        phi_q, phi_k, name = resolve_feature_map(feature_map)
        fq, fk, vv = apply_feature_maps(q, k, v, phi_q, phi_k)
        F = fq.shape[3]
        acc = accumulation_dtype(q.dtype)
        if initial_state is None:
            initial = LinearAttentionState.zeros(B, Hkv, F, Dv, dtype=acc, device=q.device)
        else:
            initial = _check_state(initial_state, B, Hkv, F, Dv, acc, q.device)
        return fq, fk, vv, initial, name

    def fields(validated):
        names = ("B (q.shape[0])", "Hq (q.shape[2])", "Hkv (k.shape[2])", "D (q.shape[3])", "Dv (v.shape[3])",
                 "F (feature dim)", "dtype", "device", "feature_map", "causal", "return_state", "method",
                 "initial_state given")
        if validated is None:
            return {**dict.fromkeys(names, UNKNOWN), "initial_state": Digest.unknown()}
        fq, _, _, initial, name = validated
        values = (q.shape[0], q.shape[2], k.shape[2], q.shape[3], v.shape[3], fq.shape[3], dtype_code(q.dtype),
                  device_code(q.device), zlib.crc32(name.encode()), int(causal), int(return_state),
                  EXCHANGE_METHODS.index(method), int(initial_state is not None))
        digest = Digest.unknown() if initial_state is None else tensor_digest(torch.cat((initial.kv.reshape(-1),
                                                                                         initial.k_sum.reshape(-1)))[None])
        return {**dict(zip(names, values)), "initial_state": digest}

    names_to_match = ("B (q.shape[0])", "Hq (q.shape[2])", "Hkv (k.shape[2])", "D (q.shape[3])", "Dv (v.shape[3])",
                      "F (feature dim)", "dtype", "device", "feature_map", "causal", "return_state", "method",
                      "initial_state given")
    (fq, fk, vv, initial, _), table = validate_and_agree(
        "linear_attention", group, validate, fields, gather=distributed and check_inputs,
        must_match=names_to_match + (("initial_state",) if initial_state is not None else ()),
    )
    if not distributed:
        out, state = chunked_linear_attention(fq, fk, vv, initial, causal=causal, chunk=chunk)
        return (out.to(q.dtype), state) if return_state else out.to(q.dtype)

    local = span_state(fk, vv)
    incoming, total = exchange_states(local, initial, group, method=method, need_incoming=causal,
                                      need_total=return_state or not causal)
    if causal:
        out, _ = chunked_linear_attention(fq, fk, vv, incoming, causal=True, chunk=chunk)
    else:  # every query sees every rank's keys: attend to the total, adding no key twice
        out, _ = chunked_linear_attention(fq, fk[:, :0], vv[:, :0], total, causal=False, chunk=chunk)
    out = out.to(q.dtype)
    return (out, total) if return_state else out


def _check_state(state, B: int, Hkv: int, F: int, Dv: int, dtype: torch.dtype, device: torch.device) -> LinearAttentionState:
    """initial_state: a LinearAttentionState (or (kv, k_sum) pair) of the expected shapes, as `dtype`."""
    if not (isinstance(state, tuple) and len(state) == 2 and all(isinstance(t, torch.Tensor) for t in state)):
        raise TypeError(f"initial_state must be a LinearAttentionState (kv, k_sum) of tensors, got {type(state).__name__}")
    kv, k_sum = state
    if tuple(kv.shape) != (B, Hkv, F, Dv):
        raise ValueError(f"initial_state.kv must have shape (B, Hkv, F, Dv) = {(B, Hkv, F, Dv)}, got {tuple(kv.shape)}")
    if tuple(k_sum.shape) != (B, Hkv, F):
        raise ValueError(f"initial_state.k_sum must have shape (B, Hkv, F) = {(B, Hkv, F)}, got {tuple(k_sum.shape)}")
    for name, t in (("kv", kv), ("k_sum", k_sum)):
        if not t.dtype.is_floating_point:
            raise TypeError(f"initial_state.{name} must be floating point, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"initial_state.{name} must be on q's device {device}, got {t.device}")
    return LinearAttentionState(kv.to(dtype), k_sum.to(dtype))
