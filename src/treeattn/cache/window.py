"""The sliding-window layers' part of a hybrid KV cache: per sequence, only what a window still sees.

A hybrid model (Gemma 3: five sliding-window layers of W = 512 per global layer) has two kinds of
layers. A global layer's query sees every earlier position, so its keys and values grow with the
sequence: they are sharded along the sequence across the ranks (the paged cache,
treeattn.cache.paged) and attended with tree attention. A window layer's query at position t sees
only positions (t - W, t], so between steps a sequence needs just its last W - 1 positions of
each window layer, whatever its length. This module holds those.

Where they live: on every rank, the same copy (replicated). Every rank has every new key and value
of a step anyway -- a replicated step runs all its tokens on every rank, and a token-parallel step
all-gathers each layer's new keys and values before storing them -- so keeping the window costs no
communication, and a window layer's attention is then a local call on every rank with no combine
across the ranks: in a decode step of Gemma 3, 15 of its 18 layers need no collective at all. What
replication costs is W - 1 positions of every window layer per sequence on every rank (Gemma 3
270M in float32: 15 layers x 511 x 2 x 256 x 4 bytes = 15.7 MB per sequence), against the global
layers' cache that grows with the sequence and is split p ways. Keeping the window on the rank
that holds the sequence's tail instead would save that replication but need one broadcast of the
window layer's output (or the query) per layer per step, from a rank that changes as the sequence
grows.

Per sequence and window layer the cache keeps a ring of W - 1 + SPARE_ROWS rows (position t in
row t mod size): a decode step writes its token (and drafts) in place and attends to the ring as
it is, with the rows its window cannot see masked by their positions, so no row is copied per
step. A step that starts at `start` finds positions [start - W + 1, start) kept, and a rollback
over rejected drafts (speculative decoding restarts at the first rejected one) needs nothing
recomputed: the rejected rows lie after every later query until they are overwritten. A sequence that starts at position 0 starts
afresh; one
that starts later without those positions kept is refused (RuntimeError), never attended wrongly.

Cached prefixes (the engine's prefix cache) keep their window state as checkpoints: a
checkpoint is the window layers' rows of positions [b - W + 1, b) of one sequence at a block
boundary b, copied out of its ring (`save`) and copied into a new sequence's ring that starts at b
(`restore`). The scheduler decides which boundaries get one (the end of every prefill chunk and of
every sequence, at most a fixed number kept: treeattn.cache.prefix); the ranks hold the rows, the
same copy on every rank, under the id the scheduler gave.

Stored dtype: the engine's kv_cache_dtype, as for the global layers (a 16-bit dtype, or fp8 e4m3
codes with one power-of-two float32 scale per row and KV head, treeattn.ops.fp8). Reads give the
model's dtype (`compute_dtype`): the ring widened, and a prompt chunk's own new rows rounded
through the stored dtype first, so that every query attends to the values the cache holds. A
16-bit ring read in float32 is held in float32 (held_dtype: every row rounded through the 16-bit
dtype as it is written, so the same values), and a decode step attends to the ring itself. A
checkpoint keeps the stored rows (codes and scales), so a restored sequence holds the same bits.
"""

from __future__ import annotations

import math

import torch

from treeattn.cache.positions import INVISIBLE_POSITION
from treeattn.ops.fp8 import FP8, dequantize_fp8, quantize_fp8


def hybrid_windows(layer_windows: tuple[int | None, ...]) -> dict[int, int]:
    """{layer: window} of the layers a hybrid KV cache keeps per sequence: the window layers of a
    model that has both window and global layers; {} for a model of one kind (all global, or all
    windowed like Mistral: its window layers keep every token in the paged cache, as global ones)."""
    windows = {i: w for i, w in enumerate(layer_windows) if w is not None}
    return windows if windows and len(windows) < len(layer_windows) else {}


def paged_layers(layer_windows: tuple[int | None, ...]) -> list[int]:
    """The layers whose keys and values the paged (sequence-sharded) cache holds, in order."""
    windows = hybrid_windows(layer_windows)
    return [i for i in range(len(layer_windows)) if i not in windows]


def held_dtype(dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype a window ring's keys and values are held in: float32 for a 16-bit `dtype` read in float32 (each row
    rounded through `dtype` once, when written: the same values, and a decode step reads the ring itself instead of
    widening every row of every window layer, about 15% of a Gemma 3 270M step at 4K in py-spy under load), else `dtype`.

    >>> held_dtype(torch.float16, torch.float32), held_dtype(torch.bfloat16), held_dtype(torch.float32, torch.float32)
    (torch.float32, torch.bfloat16, torch.float32)
    """
    return torch.float32 if compute_dtype == torch.float32 and dtype in (torch.float16, torch.bfloat16) else dtype


def window_bytes_per_sequence(model_config, dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> int:
    """Bytes a hybrid cache keeps per sequence for the window layers (a ring of W - 1 + SPARE_ROWS
    positions of keys and values of each, held in held_dtype(dtype, compute_dtype); 0 for a model
    that is not hybrid). Every rank keeps them."""
    itemsize = torch.empty((), dtype=held_dtype(dtype, compute_dtype)).element_size()
    scale = 4 if dtype == FP8 else 0  # an fp8 row's float32 scale
    per_position = 2 * model_config.num_kv_heads * (model_config.head_dim * itemsize + scale)
    return sum((w - 1 + SPARE_ROWS) * per_position for w in hybrid_windows(tuple(model_config.layer_windows)).values())


class WindowKVCache:
    """One rank's copy of the window layers' keys and values, per sequence (see the module docstring).

    Each (sequence, layer) has a ring of W - 1 + SPARE_ROWS rows: position t lives in row t mod
    size, beside its position (kv_pos). A step of n <= SPARE_ROWS new rows (a decode step, with
    its drafts) writes them in place and attends to the ring as it is: the rows its window cannot
    see (older positions, rows never written, rejected drafts beyond the query) are masked by
    their positions, so nothing is copied. A longer step (a prompt chunk) gets the kept rows and
    its own concatenated, and its last positions go to the ring.

    Args:
        windows: {layer: window W} of the layers kept here (hybrid_windows).
        num_kv_heads, head_dim: of the model (values share head_dim).
        dtype, device: of the kept keys and values (dtype: a float dtype, or float8_e4m3fn codes with
            their scales).
        compute_dtype: of what `extend` returns (the model's; default: dtype).
    """

    def __init__(self, windows: dict[int, int], *, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", compute_dtype: torch.dtype | None = None) -> None:
        for layer, w in windows.items():
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"the window of layer {layer} must be an int >= 1, got {w!r}")
        self.windows = dict(windows)
        if compute_dtype == FP8:
            raise ValueError("compute_dtype must be a float dtype the model computes in, got float8_e4m3fn")
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, torch.device(device)
        self.compute_dtype = compute_dtype or dtype
        # seq_id -> layer -> _Ring
        self._kept: dict[int, dict[int, _Ring]] = {}
        # checkpoint id -> (b, layer -> stored rows (k, v, scales or None) of positions [max(0, b - W + 1), b))
        self._checkpoints: dict[int, tuple[int, dict[int, tuple[torch.Tensor, ...] | None]]] = {}

    def __contains__(self, layer: int) -> bool:
        return layer in self.windows

    def extend(self, layer: int, seq_id: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Add n new positions [start, start + n) of one sequence to window layer `layer`; return
        what their queries attend to.

        Args:
            layer: a window layer.
            seq_id: the sequence.
            start: position of the first new row; 0 starts the sequence afresh.
            k_new, v_new: (n, Hkv, D) the new rows' keys (RoPE applied) and values.
        Returns:
            k, v (L, Hkv, D) and kv_pos int64 (L,): rows holding every position of
            [start - m, start + n) (m = min(start, W - 1)) once, with their positions; other rows
            hold positions the new queries cannot see (before their windows, or after them) or
            INVISIBLE_POSITION; k and v in compute_dtype, the values the cache holds. A decode step's
            rows are the ring itself when it is held in compute_dtype (held_dtype; no copy; valid until the
            sequence's next step), else the ring widened; a longer step's are the kept positions then
            the new ones, in order.

        Raises:
            RuntimeError: start > 0 and the positions [start - m, start) are not all kept.
        """
        window = self.windows[layer]
        n = k_new.shape[0]
        need = min(start, window - 1)
        layers = self._kept.setdefault(seq_id, {})
        ring = layers.get(layer) if start > 0 else None
        if need > 0 and (ring is None or ring.first > start - need or ring.end < start):
            have = "nothing" if ring is None or ring.first >= ring.end else f"[{ring.first}, {ring.end})"
            raise RuntimeError(f"window cache: sequence {seq_id} starts at position {start} in layer {layer} (window {window}), "
                               f"which needs positions [{start - need}, {start}) kept, but holds {have}")
        if ring is None:
            ring = layers[layer] = _Ring(window - 1 + SPARE_ROWS, k_new, self.dtype, self.compute_dtype)
        if n <= SPARE_ROWS:  # rows [start - (W - 1), start) survive writing [start, start + n)
            ring.write(start, k_new, v_new)
            return (*ring.read(), ring.pos)
        kept = torch.arange(start - need, start, device=ring.pos.device) % ring.size
        k_kept, v_kept = ring.read(kept)
        k = torch.cat((k_kept, ring.as_stored(k_new)))
        v = torch.cat((v_kept, ring.as_stored(v_new)))
        pos = torch.cat((ring.pos[kept], torch.arange(start, start + n, dtype=torch.int64, device=ring.pos.device)))
        tail = max(0, n - ring.size)  # the ring keeps the last `size` new rows (a checkpoint may want them)
        ring.write(start + tail, k_new[tail:], v_new[tail:])
        return k, v, pos

    def decode_row(self, layer: int, seq_id: int, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """A one-row decode step of sequence `seq_id` at position `start` whose caller writes the new key and value
        itself (engine.worker.compiled_decode): the ring of window layer `layer` with that position marked held, as
        extend marks it, as (k, v, kv_pos, row): the ring's keys and values (size, Hkv, D) held in compute_dtype, its
        positions (size,), and the row to write, with what write() stores (each value rounded through `dtype`). What
        the queries then attend to is extend's result for that row. None, nothing marked, where extend does more: no
        ring kept, the positions before `start` not all kept (extend raises), fp8 or a ring not held in compute_dtype.

        >>> cache = WindowKVCache({0: 4}, num_kv_heads=1, head_dim=2)
        >>> _ = cache.extend(0, 7, 0, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
        >>> k, v, pos, row = cache.decode_row(0, 7, 3)
        >>> row, pos[:4].tolist(), cache.decode_row(0, 7, 9)
        (3, [0, 1, 2, 3], None)
        """
        need = min(start, self.windows[layer] - 1)
        ring = self._kept.get(seq_id, {}).get(layer) if start > 0 else None
        if (ring is None or ring.scales is not None or ring.k.dtype != self.compute_dtype
                or (need > 0 and (ring.first > start - need or ring.end < start))):
            return None
        return ring.k, ring.v, ring.pos, ring._row(start)

    def release(self, seq_id: int) -> None:
        """Forget sequence `seq_id` (finished, failed or preempted)."""
        self._kept.pop(seq_id, None)

    def save(self, seq_id: int, end: int, checkpoint: int) -> None:
        """Copy sequence `seq_id`'s window state at position `end` (every window layer's rows of
        positions [max(0, end - W + 1), end)) into checkpoint `checkpoint`.

        Raises:
            RuntimeError: the sequence's rings do not hold those positions (the scheduler asked
                for a boundary too far behind the sequence's last step: a bug, never a wrong answer).
        """
        rows = {}
        for layer, window in self.windows.items():
            ring = self._kept.get(seq_id, {}).get(layer)
            first = max(0, end - window + 1)
            if end > 0 and (ring is None or ring.first > first or ring.end < end):
                have = "nothing" if ring is None else f"[{ring.first}, {ring.end})"
                raise RuntimeError(f"window cache: checkpoint {checkpoint} of sequence {seq_id} at position {end} needs "
                                   f"positions "
                                   f"[{first}, {end}) of layer {layer}, but the sequence holds {have}")
            at = torch.arange(first, end, device=self.device) % ring.size if end > 0 else None
            rows[layer] = ring.stored(at) if at is not None else None
        self._checkpoints[checkpoint] = (end, rows)

    def restore(self, seq_id: int, checkpoint: int) -> None:
        """Start sequence `seq_id` at checkpoint `checkpoint`'s position with its window state
        (the sequence's next step starts there). Raises KeyError naming an unknown checkpoint."""
        if checkpoint not in self._checkpoints:
            raise KeyError(f"window cache: no checkpoint {checkpoint} (held: {sorted(self._checkpoints)})")
        end, rows = self._checkpoints[checkpoint]
        layers = self._kept[seq_id] = {}
        for layer, window in self.windows.items():
            if rows[layer] is None:
                continue
            k = rows[layer][0]
            ring = layers[layer] = _Ring(window - 1 + SPARE_ROWS, k, self.dtype, self.compute_dtype)
            ring.write_stored(end - k.shape[0], *rows[layer])

    def checkpoint_payload(self, checkpoint: int) -> bytes | None:
        """Checkpoint `checkpoint`'s rows as bytes, exactly as held (per window layer, in order: keys,
        values, an fp8 cache's scales), for the KV store; None when it is not held."""
        if checkpoint not in self._checkpoints:
            return None
        _, rows = self._checkpoints[checkpoint]
        parts = [t.contiguous().view(torch.uint8).reshape(-1).cpu() for stored in rows.values() if stored is not None
                 for t in stored if t is not None]
        return torch.cat(parts).numpy().tobytes() if parts else b""

    def load_checkpoint(self, checkpoint: int, end: int, payload) -> bool:
        """Hold `payload` (checkpoint_payload's bytes of a checkpoint at position `end`) as
        checkpoint `checkpoint`. False, holding nothing, when its length does not fit."""
        flat = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        rows, at = {}, 0
        for layer, window in self.windows.items():
            n = min(end, window - 1)
            if n == 0:
                rows[layer] = None
                continue
            shapes = [((n, self.num_kv_heads, self.head_dim), self.dtype)] * 2
            shapes += [((2, n, self.num_kv_heads), torch.float32)] if self.dtype == FP8 else []
            stored = []
            for shape, dtype in shapes:
                size = dtype.itemsize * math.prod(shape)
                if at + size > flat.numel():
                    return False
                stored.append(flat[at : at + size].view(dtype).view(shape).to(self.device, copy=True))
                at += size
            rows[layer] = (*stored, None) if self.dtype != FP8 else tuple(stored)
        if at != flat.numel():
            return False
        self._checkpoints[checkpoint] = (end, rows)
        return True

    def drop(self, checkpoint: int) -> None:
        """Forget checkpoint `checkpoint` (its prefix left the prefix cache); unknown ids are ignored."""
        self._checkpoints.pop(checkpoint, None)

    @property
    def checkpoints(self) -> int:
        """Checkpoints held now."""
        return len(self._checkpoints)

    def nbytes(self) -> int:
        """Bytes of keys and values kept now, over all sequences and layers, checkpoints included."""
        rings = sum(ring.nbytes() for layers in self._kept.values() for ring in layers.values())
        saved = sum(t.numel() * t.element_size() for _, rows in self._checkpoints.values()
                    for stored in rows.values() if stored is not None for t in stored if t is not None)
        return rings + saved

    def __repr__(self) -> str:
        return f"WindowKVCache(layers={sorted(self.windows)}, sequences={len(self._kept)}, bytes={self.nbytes()})"


# Rows of a ring beyond the window's W - 1: a step of up to SPARE_ROWS rows (a token and its drafts)
# is written in place.
SPARE_ROWS = 16


class _Ring:
    """The rows of one (sequence, window layer): position t in row t mod size. Positions
    [first, end) are held (consecutive, the latest written last). Stored in `dtype` (fp8: codes and
    their float32 scales, `scales[0]` the keys', `scales[1]` the values'), read in `compute_dtype`."""

    def __init__(self, size: int, like: torch.Tensor, dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        self.size, self.dtype, self.compute_dtype = size, dtype, compute_dtype
        held = held_dtype(dtype, compute_dtype)  # a 16-bit ring read in float32: float32 values of `dtype`
        self.k = torch.zeros(size, *like.shape[1:], dtype=held, device=like.device)
        self.v = torch.zeros_like(self.k)
        self.scales = torch.ones(2, size, like.shape[1], dtype=torch.float32, device=like.device) if dtype == FP8 else None
        self.pos = torch.full((size,), INVISIBLE_POSITION, dtype=torch.int64, device=like.device)
        self.first = self.end = 0

    def _rows(self, start: int, n: int) -> torch.Tensor:
        """The ring rows of positions [start, start + n) (n <= size), marked held; a rollback
        (start < end) forgets the positions from start on."""
        rows = torch.arange(start, start + n, device=self.pos.device)
        if start == 0 or start > self.end:
            self.first = start
        self.pos[rows % self.size] = rows
        self.end = start + n
        self.first = max(self.first, self.end - self.size)
        return rows % self.size

    def _row(self, start: int) -> int:
        """_rows(start, 1) as a plain int: the ring row of position `start`, marked held."""
        row = start % self.size
        if start == 0 or start > self.end:
            self.first = start
        self.pos[row] = start
        self.end = start + 1
        self.first = max(self.first, self.end - self.size)
        return row

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values (n, Hkv, D) of positions [start, start + n), stored in the ring's dtype."""
        if k.shape[0] == 1 and self.scales is None:  # a decode step's row: a plain index, not index tensors
            at = self._row(start)
            self.k[at], self.v[at] = k[0].to(self.dtype).to(self.k.dtype), v[0].to(self.dtype).to(self.v.dtype)
            return
        at = self._rows(start, k.shape[0])
        if self.scales is None:
            self.k[at], self.v[at] = k.to(self.dtype).to(self.k.dtype), v.to(self.dtype).to(self.v.dtype)
        else:
            (self.k[at], self.scales[0, at]), (self.v[at], self.scales[1, at]) = quantize_fp8(k), quantize_fp8(v)

    def write_stored(self, start: int, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Rows as `stored` gave them (the same bits: nothing is rounded again)."""
        at = self._rows(start, k.shape[0])
        self.k[at], self.v[at] = k.to(self.k.dtype), v.to(self.v.dtype)  # widened exactly where held in float32
        if self.scales is not None:
            self.scales[:, at] = scales

    def stored(self, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Copies of rows `at` as stored, in the cache's dtype: k, v and (fp8) their scales (2, len(at), Hkv)."""
        k, v = self.k[at], self.v[at]  # indexing copies; a ring held in float32 narrows exactly
        return (k.to(self.dtype), v.to(self.dtype),
                None if self.scales is None else self.scales[:, at].clone())

    def read(self, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows `at` (every row when None) in compute_dtype: the ring itself when it
        is held so (held_dtype) and every row is read, else a copy."""
        k, v = (self.k, self.v) if at is None else (self.k[at], self.v[at])
        if self.scales is not None:
            ks, vs = self.scales if at is None else self.scales[:, at]
            return dequantize_fp8(k, ks, self.compute_dtype), dequantize_fp8(v, vs, self.compute_dtype)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """New rows (n, Hkv, D) in compute_dtype, with the values storing them would keep."""
        if self.scales is not None:
            return dequantize_fp8(*quantize_fp8(x), self.compute_dtype)
        return x.to(self.dtype).to(self.compute_dtype)

    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * 4
        return 2 * self.k.numel() * self.k.element_size() + scales


__all__ = ["WindowKVCache", "held_dtype", "hybrid_windows", "paged_layers", "window_bytes_per_sequence"]
