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

Per sequence and window layer the cache keeps the rows of positions >= keep_from - (W - 1), where
keep_from is the first position the next step may start at: the end of the step, or the first
draft of a step with drafts (speculative decoding may reject them and restart there). So a step
that starts at `start` always finds positions [start - W + 1, start) kept, and a rollback over
rejected drafts needs nothing recomputed. A sequence that starts at position 0 starts afresh; one
that starts later without those positions kept is refused (RuntimeError), never attended wrongly.

What is not kept: the window layers' keys and values of a cached prefix. The engine's prefix cache
shares global-layer blocks only, so for a hybrid model it is off (a cached prefix's window-layer
state would have to be stored with it; see docs/engine.md).
"""

from __future__ import annotations

import torch


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


def window_bytes_per_sequence(model_config, dtype: torch.dtype) -> int:
    """Bytes a hybrid cache keeps per sequence for the window layers between steps (W - 1 positions
    of keys and values of each; 0 for a model that is not hybrid). Every rank keeps them."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_position = 2 * model_config.num_kv_heads * model_config.head_dim * itemsize
    return sum((w - 1) * per_position for w in hybrid_windows(tuple(model_config.layer_windows)).values())


class WindowKVCache:
    """One rank's copy of the window layers' keys and values, per sequence (see the module docstring).

    Args:
        windows: {layer: window W} of the layers kept here (hybrid_windows).
        num_kv_heads, head_dim: of the model (values share head_dim).
        dtype, device: of the kept keys and values.
    """

    def __init__(self, windows: dict[int, int], *, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for layer, w in windows.items():
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"the window of layer {layer} must be an int >= 1, got {w!r}")
        self.windows = dict(windows)
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, torch.device(device)
        # seq_id -> layer -> (k (n, Hkv, D), v (n, Hkv, D), pos int64 (n,)), positions ascending and consecutive
        self._kept: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def __contains__(self, layer: int) -> bool:
        return layer in self.windows

    def extend(self, layer: int, seq_id: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor, keep_from: int):
        """Add n new positions [start, start + n) of one sequence to window layer `layer`; return
        what their queries attend to.

        Args:
            layer: a window layer.
            seq_id: the sequence.
            start: position of the first new row; 0 starts the sequence afresh.
            k_new, v_new: (n, Hkv, D) the new rows' keys (RoPE applied) and values.
            keep_from: the first position the sequence's next step may start at (start + n, or
                the position of the step's first draft).

        Returns:
            k, v (m + n, Hkv, D) and kv_pos int64 (m + n,): the kept positions [start - m, start)
            (m = min(start, W - 1)) followed by the new rows. Rows dropped (outside every later
            window, or rejected drafts) free their memory.

        Raises:
            RuntimeError: start > 0 and the positions [start - m, start) are not all kept.
        """
        window = self.windows[layer]
        n = k_new.shape[0]
        need = min(start, window - 1)
        kept = self._kept.setdefault(seq_id, {}).get(layer) if start > 0 else None
        if need == 0:
            k, v = k_new, v_new
            pos = torch.arange(start, start + n, dtype=torch.int64, device=k_new.device)
        else:
            if kept is None or kept[2].numel() == 0 or int(kept[2][0]) > start - need or int(kept[2][-1]) < start - 1:
                have = "nothing" if kept is None or kept[2].numel() == 0 else f"[{int(kept[2][0])}, {int(kept[2][-1]) + 1})"
                raise RuntimeError(f"window cache: sequence {seq_id} starts at position {start} in layer {layer} (window {window}), "
                                   f"which needs positions [{start - need}, {start}) kept, but holds {have}")
            first = start - need - int(kept[2][0])  # rows of kept: consecutive positions from kept[2][0]
            k = torch.cat((kept[0][first : first + need], k_new))
            v = torch.cat((kept[1][first : first + need], v_new))
            pos = torch.cat((kept[2][first : first + need], torch.arange(start, start + n, dtype=torch.int64, device=k_new.device)))
        lo = max(0, keep_from - (window - 1))
        keep = slice(max(0, lo - int(pos[0])) if pos.numel() else 0, None)
        self._kept.setdefault(seq_id, {})[layer] = (k[keep].clone(), v[keep].clone(), pos[keep].clone())
        return k, v, pos

    def release(self, seq_id: int) -> None:
        """Forget sequence `seq_id` (finished, failed or preempted)."""
        self._kept.pop(seq_id, None)

    def nbytes(self) -> int:
        """Bytes of keys and values kept now, over all sequences and layers."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for layers in self._kept.values() for k, v, _ in layers.values())

    def __repr__(self) -> str:
        return f"WindowKVCache(layers={sorted(self.windows)}, sequences={len(self._kept)}, bytes={self.nbytes()})"


__all__ = ["WindowKVCache", "hybrid_windows", "paged_layers", "window_bytes_per_sequence"]
