"""The Triton kernel of packed weights on CUDA (treeattn.ops.packed_triton) against float64 x @ W.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET is set
before the module is imported, as tests/test_triton_decode.py does); with CUDA the same tests run
compiled on the GPU. The weights are the file's: the product must be within the float32 dot-product
bound gamma_K * |x| @ |W|.T of float64 x @ W (tests/test_packed_weights.py's bound), for q4_0, q4_1
and q8_0 blocks and the K-quant conversions (Q4_K as q4_1, Q6_K as int16 q8_0 blocks), with weight
rows that do not fill the kernel's last tile. The whole module is skipped without triton.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")
import gguf.quants  # noqa: E402

from helpers.packed import assert_within_float32_bound, weights  # noqa: E402

from treeattn.ops import packed_linear  # noqa: E402
from treeattn.ops.packed_linear import dequantize_packed, unpack_blocks  # noqa: E402

pt = importlib.import_module("treeattn.ops.packed_triton")
if not HAS_CUDA and not pt._INTERPRETED:  # imported earlier without the interpreter
    pt = importlib.reload(pt)

DEVICE = "cuda" if HAS_CUDA else "cpu"
Q = gguf.GGMLQuantizationType


def on_device(*tensors):
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


@pytest.mark.parametrize("fmt,qtype", [("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1), ("q8_0", Q.Q8_0)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_kernel_is_x_times_the_files_weights_within_float32_accumulation(fmt, qtype, rows):
    """70 weight rows (two tiles of 64, the second part-filled), 160 columns (five blocks: a tile of
    four and one more), 1 to 16 rows of x in float32 and bfloat16."""
    raw = gguf.quants.quantize(weights(70, 160, 3), qtype)
    w = gguf.quants.dequantize(raw, qtype).reshape(70, 160)
    qs, d, m = on_device(*unpack_blocks(fmt, raw))
    assert np.array_equal(dequantize_packed(fmt, qs.cpu(), d.cpu(), None if m is None else m.cpu()).numpy(), w)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    y = pt.packed_matmul(x, fmt, qs, d, m)
    assert y.dtype == torch.float32
    assert_within_float32_bound(y, x, w)
    x16 = x.to(torch.bfloat16)  # taken in float32, exactly
    assert_within_float32_bound(pt.packed_matmul(x16, fmt, qs, d, m), x16.float(), w)


def test_k_quant_conversions_run_through_the_same_kernel():
    """Q4_K regrouped as q4_1 blocks and Q6_K held as int16 q8_0 blocks (their values exactly gguf's)."""
    g = np.random.default_rng(5)
    half = lambda value: np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)  # noqa: E731
    q4k = g.integers(0, 256, (9, 256 // 256 * 144), dtype=np.uint8)
    q4k[:, 0:2], q4k[:, 2:4] = half(0.01), half(0.003)  # d, dmin of each super-block
    q6k = g.integers(0, 256, (9, 512 // 256 * 210), dtype=np.uint8)
    q6k.reshape(-1, 210)[:, 208:210] = half(0.002)  # d
    for raw, qtype, convert, fmt in ((q4k, Q.Q4_K, packed_linear.q4_k_as_q4_1, "q4_1"),
                                     (q6k, Q.Q6_K, packed_linear.q6_k_as_q8_0, "q8_0")):
        w = gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], -1)
        qs, d, m = on_device(*convert(raw))
        x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(1)).to(DEVICE)
        assert_within_float32_bound(pt.packed_matmul(x, fmt, qs, d, m), x, w)


def test_packed_matmul_sends_decode_sized_cuda_calls_to_the_kernel(monkeypatch):
    """packed_linear.packed_matmul on a CUDA tensor: up to MAX_KERNEL_ROWS rows go to this kernel, longer
    ones dequantize (stand-in device check on the CPU: the call is recorded, not run on a GPU)."""
    calls = []
    monkeypatch.setattr(pt, "packed_matmul", lambda x, fmt, qs, d,
                        m: calls.append(x.shape) or torch.zeros(x.shape[0], qs.shape[0]))

    class FakeCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda")

    raw = gguf.quants.quantize(weights(8, 64, 1), Q.Q8_0)
    qs, d, m = unpack_blocks("q8_0", raw)
    x = torch.randn(2, 64).as_subclass(FakeCuda)
    packed_linear.packed_matmul(x, "q8_0", qs, d, m)
    assert calls == [(2, 64)]


def test_bad_arguments_are_refused_in_one_line():
    raw = gguf.quants.quantize(weights(8, 64, 1), Q.Q8_0)
    qs, d, m = on_device(*unpack_blocks("q8_0", raw))
    with pytest.raises(ValueError, match=r"fmt must be one of \('q4_0', 'q4_1', 'q8_0'\), got 'q5_1'"):
        pt.packed_matmul(torch.randn(1, 64, device=DEVICE), "q5_1", qs, d, m)
    with pytest.raises(ValueError, match=r"x must be \(M, 64\) \(the packed weight's columns\), got shape \(1, 32\)"):
        pt.packed_matmul(torch.randn(1, 32, device=DEVICE), "q8_0", qs, d, m)
