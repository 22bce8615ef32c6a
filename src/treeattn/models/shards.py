"""A model's parameters narrowed to one share of each (the rank-free half of tensor parallelism).

    cuts = {"layers.0.mlp.down_proj.weight": Cut(dim=1, start=0, stop=48), ...}
    shard_model(model, cuts)               # in place: a loaded model, or a loader's "meta" skeleton
    share = narrow(tensor, cuts[name])     # what a loader reads of one tensor

Which share a rank holds is the engine's plan (treeattn.engine.worker.tensor_parallel); this module only
cuts. A packed layer (treeattn.models.packed) keeps the file's bytes: its rows as they are, its
columns on block boundaries only (a ValueError naming the parameter otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Cut:
    """One share of a parameter: indices [start, stop) along `dim`.

    >>> narrow(torch.arange(12).view(3, 4), Cut(dim=1, start=1, stop=3)).tolist()
    [[1, 2], [5, 6], [9, 10]]
    """

    dim: int
    start: int
    stop: int


def narrow(tensor: torch.Tensor, cut: Cut | None) -> torch.Tensor:
    """This rank's share of a whole tensor: a new contiguous tensor (none of the whole one kept)."""
    if cut is None:
        return tensor
    return tensor.narrow(cut.dim, cut.start, cut.stop - cut.start).clone(memory_format=torch.contiguous_format)


def _packed_share(module, cut: Cut, name: str):
    """A packed layer (treeattn.models.packed) holding only `cut` of its weight: rows as they are,
    columns on block boundaries (ValueError naming the parameter otherwise); the file's bytes."""
    from treeattn.models.packed import PackedEmbedding, PackedLinear
    from treeattn.ops.packed_linear import BLOCK

    qs, d_bits, m_bits = module.qs, module.d_bits, module.m_bits
    if cut.dim == 1:
        if cut.start % BLOCK or cut.stop % BLOCK:
            raise ValueError(f"{name} is packed in blocks of {BLOCK} columns, but this rank's share [{cut.start}, "
                             f"{cut.stop}) does not start and end on a block boundary; use weight_format='dequantize'")
        cut = Cut(1, cut.start // BLOCK, cut.stop // BLOCK)
    pieces = [None if t is None else narrow(t, cut) for t in (qs, d_bits, m_bits)]
    d, m = pieces[1].view(torch.float32), None if pieces[2] is None else pieces[2].view(torch.float32)
    if isinstance(module, PackedEmbedding):
        return PackedEmbedding(module.fmt, pieces[0], d, m)
    return PackedLinear(module.fmt, pieces[0], d, m, bias=module.bias)


def shard_model(model: nn.Module, cuts: dict[str, Cut]) -> None:
    """Narrow, in place, every parameter of `model` that `cuts` names to this rank's share (a packed
    layer's blocks too); the model's "meta" skeleton the same way (the loaders then read the shares)."""
    from treeattn.models.packed import _Packed

    for name, cut in cuts.items():
        owner, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            continue  # e.g. lm_head of a tied model, biases of a model without them
        if isinstance(module, _Packed) and attr == "weight":
            model.set_submodule(owner, _packed_share(module, cut, name))
            continue
        param = getattr(module, attr, None)
        if isinstance(param, nn.Parameter):
            setattr(module, attr, nn.Parameter(narrow(param.data, cut), requires_grad=False))


__all__ = ["Cut", "narrow", "shard_model"]
