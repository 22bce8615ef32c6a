"""The attention workload the cost model prices: one decode query against an N-token KV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}
STATE_ELEMENT_BYTES = 4  # lse, max and the packed numerator/denominator travel in float32


def canonical_dtype(dtype: str) -> str:
    """Map 'bfloat16'/'bf16', 'float16'/'fp16', 'float32'/'fp32' to the short name."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of bf16, fp16, fp32 (or their torch names), got {dtype!r}")
    return name


def _check_count(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class DecodeShape:
    """One decode step of one attention layer: q (B, 1, Hq, D) against k, v (B, N, Hkv, D|Dv).

    Attributes:
        seq_len: N, tokens in the KV cache (all ranks together).
        heads: Hq, query heads.
        head_dim: D.
        batch: B.
        kv_heads: Hkv (None: Hkv = Hq, multi-head attention as in the paper).
        value_dim: Dv (None: Dv = D).
        dtype: storage dtype of q, k, v: "bf16", "fp16" or "fp32".
    """

    seq_len: int
    heads: int
    head_dim: int
    batch: int = 1
    kv_heads: int | None = None
    value_dim: int | None = None
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        _check_count("seq_len", self.seq_len)
        _check_count("heads", self.heads)
        _check_count("head_dim", self.head_dim)
        _check_count("batch", self.batch)
        if self.kv_heads is not None:
            _check_count("kv_heads", self.kv_heads)
            if self.heads % self.kv_heads != 0:
                raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.value_dim is not None:
            _check_count("value_dim", self.value_dim)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def hkv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def dv(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def hidden(self) -> int:
        """The paper's d = d_h x n_h (of the output: Hq x Dv)."""
        return self.heads * self.dv

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def shard_tokens(self, ranks: int) -> int:
        """Tokens on the fullest rank when N is split as evenly as possible: ceil(N / p)."""
        return math.ceil(self.seq_len / ranks)

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of K and V for `tokens` tokens: B x tokens x Hkv x (D + Dv) x element size."""
        return self.batch * tokens * self.hkv * (self.head_dim + self.dv) * self.element_bytes

    def attention_flops(self, tokens: int) -> int:
        """FLOPs of one decode query row per head against `tokens` keys: 2 B Hq tokens (D + Dv)."""
        return 2 * self.batch * self.heads * tokens * (self.head_dim + self.dv)

    def state_bytes(self) -> int:
        """Bytes of one partial state as treeattn sends it: out (B, 1, Hq, Dv) and lse (B, Hq, 1)
        packed in one float32 buffer (states are combined in float32 whatever the input dtype)."""
        return self.batch * self.heads * (self.dv + 1) * STATE_ELEMENT_BYTES
