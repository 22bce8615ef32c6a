"""What a decode benchmark sweep runs: methods x world sizes x sequence lengths, and how.

`SweepConfig` is plain data (JSON round-trip), validated when built so that nonsense fails before
any process starts: unknown methods, world sizes that nodes of `ranks_per_node` ranks cannot
fill, sequences shorter than the world where a method needs a token on every rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

METHODS: tuple[str, ...] = ("allreduce", "onepass", "tree", "twolevel", "ring-kv", "ring-q", "local")
TREE_METHODS: tuple[str, ...] = ("allreduce", "onepass", "tree", "twolevel")
RING_METHODS: tuple[str, ...] = ("ring-kv", "ring-q")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _positive_ints(name: str, values: tuple[int, ...]) -> None:
    if not values:
        raise ValueError(f"{name} must not be empty")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must hold integers >= 1, got {v!r}")


@dataclass(frozen=True)
class SweepConfig:
    """A decode benchmark sweep.

    Attributes:
        methods: subset of METHODS.
        world_sizes: ranks p; one process group per world size.
        seq_lens: total KV cache lengths N (split as evenly as possible over the p ranks).
        heads: Hq. kv_heads: Hkv (None = Hq). head_dim: D (= Dv). batch: B.
        dtype: "fp32", "bf16" or "fp16".
        warmup: untimed calls per case before timing.
        repeats: timed calls per case (each barrier-aligned).
        ranks_per_node: ranks per (emulated) node, for "twolevel" and the topology; None = all
            ranks on one node. Must divide every world size.
        threads_per_rank: torch intra-op threads in each rank.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        seed: inputs are drawn from torch.Generator(seed) (K, V per rank from seed + 1 + rank).
        timeout: seconds for the process group (no collective can hang longer).
    """

    methods: tuple[str, ...] = ("allreduce", "tree", "ring-kv", "ring-q")
    world_sizes: tuple[int, ...] = (2,)
    seq_lens: tuple[int, ...] = (16384,)
    heads: int = 16
    kv_heads: int | None = None
    head_dim: int = 128
    batch: int = 1
    dtype: str = "fp32"
    warmup: int = 2
    repeats: int = 10
    ranks_per_node: int | None = None
    threads_per_rank: int = 1
    backend: str = "gloo"
    seed: int = 0
    timeout: float = 120.0
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("methods", "world_sizes", "seq_lens"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.methods:
            raise ValueError("methods must not be empty")
        for m in self.methods:
            if m not in METHODS:
                raise ValueError(f"method must be one of {', '.join(METHODS)}, got {m!r}")
        _positive_ints("world_sizes", self.world_sizes)
        _positive_ints("seq_lens", self.seq_lens)
        _positive_ints("heads/head_dim/batch/threads_per_rank", (self.heads, self.head_dim, self.batch, self.threads_per_rank))
        if self.kv_heads is not None:
            _positive_ints("kv_heads", (self.kv_heads,))
            if self.heads % self.kv_heads:
                raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        _positive_ints("repeats", (self.repeats,))
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.ranks_per_node is not None:
            _positive_ints("ranks_per_node", (self.ranks_per_node,))
            for p in self.world_sizes:
                if p % self.ranks_per_node:
                    raise ValueError(
                        f"world size {p} is not divisible by ranks_per_node {self.ranks_per_node}: "
                        f"nodes must hold the same number of ranks"
                    )
        for p in self.world_sizes:
            for n in self.seq_lens:
                for m in self.methods:
                    if m in RING_METHODS and n < p:
                        raise ValueError(
                            f"seq_len {n} is shorter than world size {p}: method {m!r} needs at least one "
                            f"token on every rank of the ring"
                        )
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def for_world(self, world_size: int) -> SweepConfig:
        """This sweep restricted to one world size (what one process group runs)."""
        return SweepConfig(**{**asdict(self), "world_sizes": (world_size,)})

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SweepConfig:
        return cls(**json.loads(text))


def shard_bounds(seq_len: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's tokens when seq_len is split as evenly as possible (the first
    seq_len % world_size ranks get one more)."""
    base, extra = divmod(seq_len, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
