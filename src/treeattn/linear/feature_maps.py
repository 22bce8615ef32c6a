"""Feature maps phi of linear attention: the kernel phi(q) . phi(k) that stands in for exp(q . k).

    "elu"      phi(x) = elu(x) + 1                      (Katharopoulos et al. 2020)
    "relu"     phi(x) = relu(x)
    Hedgehog   phi(x) = softmax([x W_h + b_h, -(x W_h + b_h)])   per head h, W_h learned
               (Zhang et al. 2024, "The Hedgehog & the Porcupine"; LoLCATs' stage-one maps)

A feature map takes x (B, S, H, D) and returns phi(x) (B, S, H, F) in float32 (float64 for float64
input): linear attention accumulates in that dtype whatever the input dtype. The named maps are
elementwise (F = D); a HedgehogFeatureMap has F = 2 * feature_dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

FeatureMap = Callable[[torch.Tensor], torch.Tensor]

NAMED_FEATURE_MAPS = ("elu", "relu")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0, elementwise, in the accumulation dtype."""
    return F.elu(x.to(accumulation_dtype(x.dtype))) + 1.0


def relu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = relu(x) >= 0, elementwise, in the accumulation dtype (a row may map to 0: its
    query then sees nothing and returns 0, never NaN)."""
    return F.relu(x.to(accumulation_dtype(x.dtype)))


class HedgehogFeatureMap(nn.Module):
    """Hedgehog's learned feature map: per head a linear map, then a softmax over [y, -y].

        y = x @ weight[h] + bias[h]            x (B, S, H, D) -> y (B, S, H, feature_dim)
        phi(x) = softmax(cat([y, -y], -1), -1) (B, S, H, 2 * feature_dim), positive, sums to 1

    (LoLCATs' code takes two separate softmaxes, of y and of -y; one softmax over the concatenation
    is what the toolset describes and is used here.)

    Heads: x may have num_heads heads, or a multiple G * num_heads (grouped-query attention: the
    G query heads of a KV group share their KV head's map, head h uses map h // G). So one map with
    num_heads = Hkv serves both q (Hq heads) and k (Hkv heads).

    Args:
        num_heads: number of maps (usually Hkv of the layer).
        head_dim: D, the input features.
        feature_dim: output features before the [y, -y] doubling; default head_dim.
        dtype, device: of the parameters. The map computes in float32 (float64 for float64 input)
            whatever the parameter dtype.

    Initialized to weight = identity (feature_dim == head_dim) or a scaled random matrix, bias 0.
    """

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        feature_dim = head_dim if feature_dim is None else feature_dim
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("feature_dim", feature_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_heads, self.head_dim, self.feature_dim = num_heads, head_dim, feature_dim
        if feature_dim == head_dim:
            weight = torch.eye(head_dim).expand(num_heads, head_dim, head_dim).clone()
        else:
            weight = torch.randn(num_heads, head_dim, feature_dim, generator=torch.Generator().manual_seed(0)) * head_dim ** -0.5
        self.weight = nn.Parameter(weight.to(device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_heads, feature_dim, device=device, dtype=dtype))

    @property
    def out_features(self) -> int:
        return 2 * self.feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"x must be a (B, S, H, D) tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        B, S, H, D = x.shape
        if D != self.head_dim:
            raise ValueError(f"x must have head_dim={self.head_dim} features (last dim), got shape {tuple(x.shape)}")
        if H % self.num_heads:
            raise ValueError(f"x must have a multiple of num_heads={self.num_heads} heads (dim 2), got shape {tuple(x.shape)}")
        acc = accumulation_dtype(x.dtype)
        group = H // self.num_heads
        xs = x.to(acc).reshape(B, S, self.num_heads, group, D)
        y = torch.einsum("bshgd,hdf->bshgf", xs, self.weight.to(acc)) + self.bias.to(acc)[:, None, :]
        phi = torch.softmax(torch.cat((y, -y), dim=-1), dim=-1)
        return phi.reshape(B, S, H, 2 * self.feature_dim)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"


def resolve_feature_map(feature_map) -> tuple[FeatureMap, FeatureMap, str]:
    """feature_map argument -> (phi_q, phi_k, name).

    Accepts "elu", "relu", a callable (nn.Module or function, used for q and k), or a pair
    (phi_q, phi_k) of callables (separate query and key maps, as LoLCATs trains them).
    """
    if isinstance(feature_map, str):
        if feature_map == "elu":
            return elu_feature_map, elu_feature_map, "elu"
        if feature_map == "relu":
            return relu_feature_map, relu_feature_map, "relu"
        raise ValueError(f"feature_map must be one of {NAMED_FEATURE_MAPS}, a callable or a (phi_q, phi_k) pair, got "
                         f"{feature_map!r}")
    if isinstance(feature_map, tuple) and len(feature_map) == 2 and all(callable(f) for f in feature_map):
        return feature_map[0], feature_map[1], type(feature_map[0]).__name__
    if callable(feature_map) and not isinstance(feature_map, tuple):
        return feature_map, feature_map, type(feature_map).__name__
    raise TypeError(f"feature_map must be one of {NAMED_FEATURE_MAPS}, a callable or a (phi_q, phi_k) pair, got "
                    f"{type(feature_map).__name__}")
