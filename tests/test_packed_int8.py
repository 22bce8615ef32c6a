"""The 8-bit activation path of packed weights (activation_format="int8": treeattn.ops.packed_int8_kernel) does llama.cpp's
arithmetic.

x is quantized per block of 32 exactly as ggml's quantize_row_q8_0_ref (gguf.quants.Q8_0) does; every weight
block times every x block is an exact integer dot product, scaled once per block. Checked against a float64
numpy reference of that arithmetic: exactly where every term and partial sum is a float32 value (power-of-two
scales: then a wrong integer anywhere shows), within float32's accumulation bound elsewhere. The kernel needs
AVX-512 VNNI: on a host without it these tests are skipped (with the reason), and "int8" is refused in one line.
"""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from helpers.packed import gamma, weights

from treeattn.engine.config import EngineConfig
from treeattn.engine.errors import ConfigError
from treeattn.models.packed import PackedLinear, set_activation_format
from treeattn.ops import packed_linear
from treeattn.ops.kernels import optional_kernel
from treeattn.ops.packed_linear import int8_module, packed_matmul, resolve_activation_format, unpack_blocks

Q = gguf.GGMLQuantizationType
FORMATS = [("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1), ("q8_0", Q.Q8_0)]
needs_int8 = pytest.mark.skipif(int8_module() is None,
                                reason="the int8 kernel needs numba and AVX-512 VNNI/BW/VL; this CPU has not")


def ggml_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gguf.quants.Q8_0 of the rows of x: the values (M, K // 32, 32) int8 and the float32 scales before ggml's float16
    rounding."""
    raw = gguf.quants.quantize(x, Q.Q8_0).reshape(x.shape[0], -1, 34)
    qs = raw[..., 2:].copy().view(np.int8)
    d = np.abs(x.reshape(x.shape[0], -1, 32)).max(axis=-1) / np.float32(127)
    assert np.array_equal(d.astype(np.float16), raw[..., :2].copy().view(np.float16)[..., 0])
    return qs, d


def reference(fmt: str, x: np.ndarray, qs, d, m) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's arithmetic in float64: sum over blocks of d_w d_x int_dot (+ m_w d_x sum q_x); and the sum of the
    terms' magnitudes (for the float32 bound)."""
    xq, xd = ggml_q8_0(x)
    xq, xd = xq.astype(np.int64), xd.astype(np.float64)
    if fmt == "q8_0":
        w = qs.numpy().astype(np.int64)
    else:
        q = qs.numpy().astype(np.int64)
        w = np.concatenate((q & 15, q >> 4), axis=-1) - (8 if fmt == "q4_0" else 0)
    dots = np.einsum("nbj,mbj->mnb", w, xq)  # exact integers
    terms = d.numpy().astype(np.float64)[None] * xd[:, None] * dots
    size = np.abs(terms).sum(-1)
    if m is not None:  # the offsets' terms apart: their magnitudes count alone in the bound
        offsets = m.numpy().astype(np.float64)[None] * (xd * xq.sum(-1))[:, None]
        return terms.sum(-1) + offsets.sum(-1), size + np.abs(offsets).sum(-1)
    return terms.sum(-1), size


@needs_int8
def test_activations_are_quantized_as_ggml_quantize_row_q8_0_does():
    kernel = optional_kernel("packed_int8_kernel")
    g = np.random.default_rng(0)
    x = (g.standard_normal((3, 128)) * np.array([1.0, 1e4, 1e-5])[:, None]).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0, values 0
    x[1, 32:64] = np.arange(32, dtype=np.float32) - 15.5  # halves: roundf takes them away from 0
    xq = np.empty((3, 4, 32), np.int8)
    xd = np.empty((3, 4), np.float32)
    xs = np.empty((3, 4), np.int32)
    kernel.quantize_q8(x, xq, xd, xs)
    qs, d = ggml_q8_0(x)
    assert np.array_equal(xq, qs) and np.array_equal(xd, d) and np.array_equal(xs, qs.astype(np.int32).sum(-1))


def power_of_two_blocks(fmt: str, N: int, K: int, seed: int):
    """A packed weight whose scales (and offsets) are powers of two: every block's term is then exact in float32."""
    g = np.random.default_rng(seed)
    nb = K // 32
    values = g.integers(0, 256, (N, nb, 16), dtype=np.uint8) if fmt != "q8_0" else g.integers(-128, 128,
                                                                                              (N, nb, 32)).astype(np.int8)
    d = torch.from_numpy(np.float32(2.0) ** g.integers(-6, -3, (N, 1)).astype(np.float32) * np.ones((1, nb), np.float32))
    m = torch.from_numpy(-(np.float32(2.0) ** np.float32(-2)) * np.ones((N, nb), np.float32)) if fmt == "q4_1" else None
    return torch.from_numpy(values), d, m


@needs_int8
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_the_integer_dot_products_are_exact(fmt, threads):
    """Blocks of 1 to 9 (the 512-bit groups and every tail), x rows whose scales come out as powers of two
    (each block's largest |x| is 127 * 2**-4): every term and partial sum is a float32, so the kernel equals the
    float64 reference exactly, and any wrong integer (a lane, a tail block, an offset) would show."""
    g = np.random.default_rng(1)
    for K in (32, 64, 96, 128, 160, 288):
        N = 13
        qs, d, m = power_of_two_blocks(fmt, N, K, K)
        ints = g.integers(-127, 128, (3, K)).astype(np.float32)
        ints.reshape(3, -1, 32)[..., 5] = 127.0
        x = ints * np.float32(2.0 ** -4)
        out = np.empty((3, N), np.float32)
        int8_module().matmul(threads, fmt, x, *packed_linear.kernel_arrays(qs, d, m), out)
        ref, _ = reference(fmt, x, qs, d, m)
        assert np.array_equal(out.astype(np.float64), ref), (fmt, K)


@needs_int8
@pytest.mark.parametrize("fmt,qtype", FORMATS)
def test_int8_products_are_llama_cpps_arithmetic_within_float32_accumulation(fmt, qtype):
    N, K = 37, 576
    qs, d, m = unpack_blocks(fmt, gguf.quants.quantize(weights(N, K, 2), qtype))
    x = torch.randn(1, 4, K, generator=torch.Generator().manual_seed(3))
    x[0, 0, :7] *= 1e3
    y = packed_matmul(x, fmt, qs, d, m, activations="int8")
    ref, size = reference(fmt, x.reshape(-1, K).numpy(), qs, d, m)
    assert y.shape == (1, 4, N) and y.dtype == torch.float32
    err = np.abs(y.reshape(-1, N).double().numpy() - ref)
    assert (err <= gamma(2 * (K // 32) + 3) * size).all(), float((err / (gamma(2 * (K // 32) + 3) * size)).max())
    exact = packed_matmul(x, fmt, qs, d, m)  # the float32 path: other numbers, within x's 8-bit rounding
    assert not torch.equal(exact, y) and torch.allclose(exact, y, rtol=0.05, atol=0.05 * float(exact.abs().max()))


@needs_int8
def test_non_finite_activations_give_non_finite_products():
    qs, d, m = unpack_blocks("q4_1", gguf.quants.quantize(weights(8, 64, 4), Q.Q4_1))
    x = torch.ones(2, 64)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    assert not torch.isfinite(packed_matmul(x, "q4_1", qs, d, m, activations="int8")).any()


@needs_int8
def test_layers_take_the_int8_path_where_set_and_float32_elsewhere(monkeypatch):
    calls = []
    kernel = int8_module()
    real = kernel.matmul
    monkeypatch.setattr(kernel, "matmul", lambda *a: (calls.append(a[1]), real(*a)))
    layer = PackedLinear("q8_0", *unpack_blocks("q8_0", gguf.quants.quantize(weights(8, 64, 5), Q.Q8_0)))
    wide = PackedLinear("q8_0", torch.zeros(8, 2, 32, dtype=torch.int16), torch.ones(8, 2), None)  # Q6_K as int16 q8_0 blocks
    x = torch.randn(1, 64)
    exact = layer(x)
    assert set_activation_format(torch.nn.ModuleList([layer, wide]), "int8") == "int8"
    assert not torch.equal(layer(x), exact) and calls == ["q8_0"]
    wide(x), layer(torch.randn(40, 64))  # int16 values and prefill-sized calls: float32
    assert calls == ["q8_0"]
    set_activation_format(layer, "float32")
    assert torch.equal(layer(x), exact)


def test_the_activation_format_is_chosen_per_host_and_checked():
    assert resolve_activation_format("float32") == "float32"
    assert resolve_activation_format("auto") == (packed_linear.AUTO_ACTIVATIONS if int8_module() is not None else "float32")
    with pytest.raises(ConfigError, match="activation_format must be one of"):
        EngineConfig(activation_format="int4")
    if int8_module() is None:
        with pytest.raises(ValueError, match="activation_format='int8' needs numba and a CPU with AVX-512 VNNI"):
            resolve_activation_format("int8")
    else:
        assert resolve_activation_format("int8") == "int8"
        import numba

        # a fresh compilation: a kernel loaded from numba's cache shows no assembly
        kernel = optional_kernel("packed_int8_kernel")
        fresh = numba.njit(kernel._q4_1_serial.py_func, fastmath=kernel._FASTMATH)
        qs, d, m = power_of_two_blocks("q4_1", 2, 160, 0)
        fresh(np.zeros((1, 160), np.float32), qs.numpy(), d.numpy(), m.numpy(), np.empty((1, 2), np.float32), 1)
        assert "vpdpbusd" in "".join(fresh.inspect_asm().values())  # the VNNI instruction, 512-bit and in the tail


@needs_int8
def test_strided_arrays_are_refused_not_misread():
    qs, d, m = power_of_two_blocks("q4_0", 8, 64, 0)
    out = np.empty((1, 4), np.float32)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        int8_module().matmul(1, "q4_0", np.zeros((1, 64), np.float32), qs.numpy()[::2], d.numpy()[::2], d.numpy()[::2], out)
