"""Linear layers over weights kept in ggml's block formats (q4_0, q4_1, q8_0), as a GGUF file ships them.

    qs, d, m = unpack_blocks("q4_1", raw)          # raw: uint8 (N, K // 32 * 20), the file's rows of blocks
    y = packed_matmul(x, "q4_1", qs, d, m)         # x (..., K) float -> y (..., N) in x.dtype
    w = dequantize_packed("q4_1", qs, d, m)        # float32 (N, K): what gguf.quants.dequantize gives

A row of an (N, K) weight is K // 32 blocks of 32 weights. Each block holds a float16 scale d (and,
for q4_1, a float16 offset m) and its 32 quantized values q:

    q4_0: 18 bytes: d, then 16 bytes, byte j = weight j (low nibble) | weight j + 16 (high nibble);  w = d * (q - 8)
    q4_1: 20 bytes: d, m, then the same 16 bytes;                                                  w = d * q + m
    q8_0: 34 bytes: d, then 32 int8;                                                               w = d * q

unpack_blocks splits the file's bytes into the quantized values qs (kept as they are: uint8 (N,
K // 32, 16) for the 4-bit formats, int8 (N, K // 32, 32) for q8_0) and the scales, widened from
float16 to float32 once (exactly: every float16 is a float32), so nothing is rounded. The weights a
layer multiplies by are exactly the file's float32 dequantization; only the float32 accumulation of
the products differs from x @ W in float64.

packed_matmul: calls of at most MAX_KERNEL_ROWS rows of x (decode steps, their drafts) run the numba
kernel (treeattn.ops.packed_cpu_kernel), which reads the blocks in place: bytes streamed per weight
are 4.75 (q4_0), 6 (q4_1) or 9 (q8_0) bits instead of float32's 32. Longer calls (prefill chunks)
dequantize the whole weight once to float32 and use torch's matmul, which batches the rows (with
prefill_dtype="bfloat16", opt-in: the weight and the rows rounded to bfloat16, float32 accumulation); so does
a call without numba, or one that autograd records. On CUDA, decode-sized calls run the Triton kernel
(treeattn.ops.packed_triton), which reads the blocks in place the same way; longer ones dequantize. The kernel runs
on torch's thread count for weights of PARALLEL_MIN_WEIGHTS values or more (an output projection over
the vocabulary) and on the calling thread for smaller ones (a layer's projections): waking numba's
thread pool 7 times a layer, beside torch's own pool, cost more than the second thread gained. On
this project's 2-core machine one process with 2 threads decoded SmolLM2 (packed, 4,096 tokens of
context) in a median 85.5 / 95.9 ms per step against 143.9 / 116.3 ms with every call parallel
(benchmarks/kernels/packed_threads.py; docs/benchmarks.md, "Weights kept packed"); with session 11's faster
kernels the model's part of a step took 11.5 ms against 19.8 with every call parallel (`treeattn bench
profile` at 4,096 tokens, one process, two runs alternated).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from treeattn.ops.dense_linear import linear_float32
from treeattn.ops.kernels import numpy_rows, optional_kernel

FORMATS = ("q4_0", "q4_1", "q8_0")
BLOCK = 32
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
# packed_matmul calls with at most this many rows of x go to the kernel (a decode step of a batch of up
# to 16 sequences); longer ones (prefill) dequantize the weight and run torch's matmul.
MAX_KERNEL_ROWS = 16
# Weights of fewer values than this are multiplied on the calling thread whatever torch's thread count: waking a
# thread pool costs more than the second thread gains on a matrix this small (a Llama layer's
# projections); larger ones (an output projection over the vocabulary) split their rows over the threads.
PARALLEL_MIN_WEIGHTS = 1 << 22
ACTIVATION_FORMATS = ("auto", "float32", "int8")
"""How a packed CPU layer multiplies its decode-sized calls: "float32" (the exact kernel: the file's weights,
float32 activations), "int8" (llama.cpp's arithmetic: activations quantized to 8 bits per block of 32,
integer dot products on AVX-512 VNNI: treeattn.ops.packed_int8_kernel; only where the CPU has it) or
"auto" (resolve_activation_format: AUTO_ACTIVATIONS where the host can, else float32)."""
AUTO_ACTIVATIONS = "float32"
"""What "auto" picks on a host that can run both paths: the exact one (see docs/benchmarks.md, issue 50,
for the measured speed and token agreement of "int8")."""


PREFILL_DTYPES = ("float32", "bfloat16")
"""What a packed CPU layer multiplies its prefill-sized calls (more than MAX_KERNEL_ROWS rows) in: "float32" (exact:
the file's weights dequantized to float32, float32 activations) or "bfloat16" (the dequantized weight and the activations
rounded to bfloat16, oneDNN's GEMM accumulating in float32, the result float32; only where torch's CPU has fast
bfloat16: resolve_prefill_dtype). Decode-sized calls are unchanged either way (docs/bench_weights.md, "bfloat16 prefill")."""


def fast_bf16() -> bool:
    """Whether torch's CPU GEMM runs bfloat16 natively here (oneDNN with AVX-512 BF16 or AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_prefill_dtype(prefill_dtype: str) -> str:
    """prefill_dtype checked against PREFILL_DTYPES and this host: "bfloat16" where torch's CPU lacks fast bfloat16 is
    refused in one line.

    >>> resolve_prefill_dtype("float32")
    'float32'
    >>> resolve_prefill_dtype("float16")
    Traceback (most recent call last):
    ValueError: prefill_dtype must be one of ('float32', 'bfloat16'), got 'float16'
    """
    if prefill_dtype not in PREFILL_DTYPES:
        raise ValueError(f"prefill_dtype must be one of {PREFILL_DTYPES}, got {prefill_dtype!r}")
    if prefill_dtype == "bfloat16" and not fast_bf16():
        raise ValueError("prefill_dtype='bfloat16' needs torch's oneDNN with native bfloat16 (a CPU with avx512_bf16 or "
                         "amx_bf16 in /proc/cpuinfo); this host has not: use prefill_dtype='float32'")
    return prefill_dtype


def int8_module():
    """treeattn.ops.packed_int8_kernel where this host can run it (numba installed, AVX-512 VNNI/BW/VL), else None."""
    module = optional_kernel("packed_int8_kernel")
    return module if module is not None and module.available() else None


def resolve_activation_format(activation_format: str) -> str:
    """"float32" or "int8" for one of ACTIVATION_FORMATS on this host; "int8" where the host cannot run it is
    refused in one line.

    >>> resolve_activation_format("float32")
    'float32'
    >>> resolve_activation_format("auto") in ("float32", "int8")
    True
    """
    if activation_format not in ACTIVATION_FORMATS:
        raise ValueError(f"activation_format must be one of {ACTIVATION_FORMATS}, got {activation_format!r}")
    if activation_format == "auto":
        return AUTO_ACTIVATIONS if int8_module() is not None else "float32"
    if activation_format == "int8" and int8_module() is None:
        raise ValueError("activation_format='int8' needs numba and a CPU with AVX-512 VNNI, BW and VL (avx512_vnni in "
                         "/proc/cpuinfo); this host has not: use activation_format='float32' or 'auto'")
    return activation_format


def kernel_module():
    """treeattn.ops.packed_cpu_kernel, or None when numba is not installed (ops.kernels): packed
    weights are then dequantized for every call."""
    return optional_kernel("packed_cpu_kernel")


def _blocks(raw: np.ndarray, block_bytes: int, block_weights: int, what: str) -> np.ndarray:
    """raw uint8 (N, K // block_weights * block_bytes), checked, as its blocks: (N, K // block_weights, block_bytes)."""
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"raw must be uint8 (N, K // {block_weights} * {block_bytes}) for {what}, got {raw.dtype} {raw.shape}")
    return np.ascontiguousarray(raw).reshape(raw.shape[0], -1, block_bytes)


def _float16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 stored at byte `at` of every block (..., bytes), widened to float32 (exactly): (...)."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def unpack_blocks(fmt: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Split rows of ggml blocks into quantized values and float32 scales (new tensors, no view of `raw`).

    Args:
        fmt: "q4_0", "q4_1" or "q8_0".
        raw: uint8 (N, K // 32 * BLOCK_BYTES[fmt]): each row's blocks as the file stores them.

    Returns:
        qs: uint8 (N, K // 32, 16) (q4_0, q4_1) or int8 (N, K // 32, 32) (q8_0);
        d: float32 (N, K // 32), the blocks' scales; m: float32 (N, K // 32) for q4_1, else None.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    blocks = _blocks(raw, BLOCK_BYTES[fmt], BLOCK, fmt)
    d = torch.from_numpy(_float16(blocks, 0))
    m = torch.from_numpy(_float16(blocks, 2)) if fmt == "q4_1" else None
    values = blocks[..., 4:] if fmt == "q4_1" else blocks[..., 2:]
    qs = torch.from_numpy(values.copy().view(np.int8) if fmt == "q8_0" else values.copy())
    return qs, d, m


Q4_K_BLOCK_BYTES = 144
"""Bytes of a Q4_K super-block of 256 weights: float16 d and dmin, 12 bytes of eight 6-bit scales and
eight 6-bit minimums, 128 bytes of 4-bit values."""


def q4_k_as_q4_1(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of Q4_K super-blocks as q4_1 blocks of 32 weights (unpack_blocks' "q4_1" output), the same values exactly.

    Sub-block j (32 weights) of a super-block holds w = (d * sc_j) * q - dmin * m_j with q in 0..15, which is
    how ggml and gguf.quants dequantize it. d * sc_j and dmin * m_j are exact in float32 (an 11-bit
    mantissa times a 6-bit integer), and so is (d * sc_j) * q (17 bits times 4); so the q4_1 block with
    scale D = d * sc_j and offset M = -(dmin * m_j) gives D * q + M: the same single rounding. The 4-bit
    values are regrouped (a super-block stores each 64 weights as 32 bytes, low nibbles first; a q4_1
    block byte i holds weights i and i + 16): 6 bits a weight in memory instead of the file's 4.5.

    Args:
        raw: uint8 (N, K // 256 * 144), each row's super-blocks as the file stores them.

    Returns:
        qs uint8 (N, K // 32, 16); d, m float32 (N, K // 32).
    """
    import gguf.quants

    N = raw.shape[0]
    blocks = _blocks(raw, Q4_K_BLOCK_BYTES, 256, "q4_k").reshape(-1, Q4_K_BLOCK_BYTES)  # (N * super-blocks, 144)
    d, dmin = _float16(blocks, 0)[:, None], _float16(blocks, 2)[:, None]  # (n, 1)
    sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # (n, 8) each: sub-block j's 6-bit scale and minimum
    values = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    values = (values & np.uint8(15)).reshape(-1, 8, 32)  # sub-block j's 32 values in order (gguf.quants' order)
    qs = values[..., :16] | (values[..., 16:] << np.uint8(4))
    scale = d * sc.astype(np.float32)
    offset = -(dmin * mins.astype(np.float32))
    return (torch.from_numpy(np.ascontiguousarray(qs).reshape(N, -1, 16)), torch.from_numpy(scale.reshape(N, -1)),
            torch.from_numpy(offset.reshape(N, -1)))


Q5_0_BLOCK_BYTES = 22
"""Bytes of a Q5_0 block of 32 weights: float16 d, 4 bytes of the values' fifth bits, 16 bytes of their low 4 bits."""


def q5_0_as_q8_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Rows of Q5_0 blocks as q8_0 blocks (unpack_blocks' "q8_0" output), the same values exactly.

    A Q5_0 weight is d * (q - 16) with q = (low nibble) | (fifth bit << 4) in 0..31, which is how ggml and
    gguf.quants dequantize it: the q8_0 block with the same d and the int8 value q - 16 holds exactly that
    (d * int8 is the q8_0 kernel's product, exact in float32). 9 bits a weight in memory where the file has 5.5.

    Args:
        raw: uint8 (N, K // 32 * 22), each row's blocks as the file stores them.

    Returns:
        qs int8 (N, K // 32, 32); d float32 (N, K // 32); None (q8_0 has no offsets).
    """
    N = raw.shape[0]
    blocks = _blocks(raw, Q5_0_BLOCK_BYTES, BLOCK, "q5_0").reshape(-1, Q5_0_BLOCK_BYTES)
    d = _float16(blocks, 0)
    # (n, 32): weight j's fifth bit
    high = (blocks[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    low = (blocks[:, 6:22, None] >> np.array([0, 4], dtype=np.uint8)) & np.uint8(15)  # (n, 16, 2): weights j and j + 16
    low = low.transpose(0, 2, 1).reshape(-1, 32)
    qs = (low | (high.astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(16)
    return torch.from_numpy(qs.reshape(N, -1, 32)), torch.from_numpy(d.reshape(N, -1)), None


Q6_K_BLOCK_BYTES = 210
"""Bytes of a Q6_K super-block of 256 weights: 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales, float16 d."""


def q6_k_as_q8_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Rows of Q6_K super-blocks as q8_0-style blocks of 32 with int16 values, the same values exactly.

    Weight t of sub-block j (16 weights) of a super-block is (d * sc_j) * q_t with q_t = (6-bit value) - 32, as
    ggml and gguf.quants dequantize it. Here it is d * v_t with the int16 v_t = sc_j * q_t (|v_t| <= 4096): the
    same real number, and exactly a float32 both ways (an 11-bit mantissa times an integer below 2**13 needs at
    most 24 bits), so the q8_0 kernel's d * v is gguf's value bit for bit. Each block of 32 gets its
    super-block's d. 17 bits a weight in memory where the file has 6.56 (float32: 32).

    Args:
        raw: uint8 (N, K // 256 * 210), each row's super-blocks as the file stores them.

    Returns:
        qs int16 (N, K // 32, 32); d float32 (N, K // 32); None.
    """
    N = raw.shape[0]
    # gguf.quants.Q6_K's unpacking, in integers
    blocks = _blocks(raw, Q6_K_BLOCK_BYTES, 256, "q6_k").reshape(-1, Q6_K_BLOCK_BYTES)
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.int16)  # (n, 16)
    d = _float16(blocks, 208)[:, None]  # (n, 1)
    ql = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    qh = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    q = (ql.reshape(-1, 256) | (qh.reshape(-1, 256) << np.uint8(4))).astype(np.int16) - np.int16(32)
    v = (q.reshape(-1, 16, 16) * scales[:, :, None]).astype(np.int16)
    return torch.from_numpy(v.reshape(N, -1, 32)), torch.from_numpy(np.repeat(d, 8, axis=1).reshape(N, -1)), None


def dequantize_packed(fmt: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """float32 (N, K) weights of unpack_blocks' output (any leading rows of it): d * q (+ m) per block.

    One float32 buffer, the values written into it and scaled in place: the same products and sums,
    rounded alike, as forming q, q * d and + m as tensors of their own, at a fifth of the memory
    traffic (a prefill chunk dequantizes every weight it multiplies).

    >>> qs = torch.tensor([[[0x21] * 16]], dtype=torch.uint8)                # low nibbles 1, high 2
    >>> dequantize_packed("q4_1", qs, torch.tensor([[0.5]]), torch.tensor([[1.0]]))[0, [0, 16]].tolist()
    [1.5, 2.0]
    """
    w = torch.empty(*qs.shape[:-1], BLOCK, dtype=torch.float32, device=qs.device)
    if fmt == "q8_0":
        w.copy_(qs)
    else:
        w[..., :16] = qs & 15  # low nibbles are weights 0..15, high 16..31
        w[..., 16:] = qs >> 4
        if fmt == "q4_0":
            w.sub_(8.0)
    w.mul_(d[..., None])
    if m is not None:
        w.add_(m[..., None])
    return w.reshape(*qs.shape[:-2], -1)


def kernel_arrays(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A CPU packed weight's blocks as the kernel reads them: numpy views of qs, d and m (d again for
    the formats without m); None on another device. A caller that multiplies by one weight many times
    (the packed layers) makes them once and passes them to packed_matmul."""
    if qs.device.type != "cpu":
        return None
    return qs.numpy(), d.numpy(), (d if m is None else m).numpy()


def kernel_takes(x: torch.Tensor) -> bool:
    """Whether packed_matmul(x, ...) runs the CPU kernel: x on the CPU, at most MAX_KERNEL_ROWS rows, outside
    autograd, numba installed."""
    rows = x.shape[:-1].numel()
    return (x.device.type == "cpu" and rows <= MAX_KERNEL_ROWS and not (x.requires_grad and torch.is_grad_enabled())
            and kernel_module() is not None)


def kernel_matmul(x: torch.Tensor, fmt: str, qs: torch.Tensor, arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
                  threads: int | None = None, activations: str = "float32") -> np.ndarray:
    """packed_matmul's CPU kernel call (the caller checked that kernel_takes(x)): x (..., K) @ W.T as a float32
    numpy array (..., N), W the packed weight of qs and arrays (kernel_arrays); threads and activations as
    packed_matmul takes them. A caller that splits the product (models.packed.FusedPacked) slices this array.

    >>> import torch
    >>> qs, d = torch.ones(2, 1, 32, dtype=torch.int8), torch.tensor([[0.5], [2.0]])    # q8_0: W = d * q, (2, 32)
    >>> x = torch.ones(1, 32)
    >>> None if not kernel_takes(x) else kernel_matmul(x, "q8_0", qs, kernel_arrays(qs, d, None)).tolist()
    [[16.0, 64.0]]
    """
    N, K = qs.shape[0], qs.shape[1] * BLOCK
    rows = numpy_rows(x if x.dtype == torch.float32 else x.to(torch.float32), K)
    out = np.empty((*x.shape[:-1], N), dtype=np.float32)
    if threads is None:
        threads = torch.get_num_threads() if N * K >= PARALLEL_MIN_WEIGHTS else 1
    int8 = int8_module() if activations == "int8" and qs.dtype != torch.int16 else None
    (int8 or kernel_module()).matmul(threads, fmt, rows, *arrays, out.reshape(rows.shape[0], N))
    return out


def packed_matmul(x: torch.Tensor, fmt: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                  bias: torch.Tensor | None = None, *, arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                  threads: int | None = None, activations: str = "float32", prefill_dtype: str = "float32") -> torch.Tensor:
    """x @ W.T (+ bias) for a weight W kept packed (unpack_blocks' qs, d, m).

    Args:
        x: (..., K) float tensor on W's device.
        fmt, qs, d, m: the packed weight, W (N, K).
        bias: (N,) or None.
        arrays: kernel_arrays(qs, d, m), made once by the caller; None: made here when the kernel runs.
        threads: the CPU kernel's threads; None: torch's thread count for weights of PARALLEL_MIN_WEIGHTS
            values or more, else 1 (a fused matrix passes 1: its parts' rows then group as they did alone).
        activations: "float32" (the exact kernel) or "int8" (x quantized per block of 32 and integer dot products,
            llama.cpp's arithmetic: packed_int8_kernel) for the calls the CPU kernel takes; int16 values (Q6_K
            as q8_0) and hosts without the int8 kernel run float32.
        prefill_dtype: "float32" or "bfloat16" (PREFILL_DTYPES, checked by the caller: resolve_prefill_dtype) for the
            CPU calls that dequantize the weight (more than MAX_KERNEL_ROWS rows): "bfloat16" rounds the weight and x to
            bfloat16 and multiplies them accumulating in float32; "float32" multiplies in float32 through
            ops.dense_linear.linear_float32 (oneDNN's matmul where torch's float32 math is strict and the CPU is not
            Intel's: 1.04-1.16x MKL's speed on one thread of this project's AMD EPYC for prefill shapes, session 19;
            MKL's sgemm on an Intel Xeon, where oneDNN ran 0.92-0.98x for these shapes, session 20).

    Returns:
        (..., N) in x.dtype, accumulated in float32 (x is taken in float32).
    """
    N, K = qs.shape[0], qs.shape[1] * BLOCK
    if x.shape[-1] != K:
        raise ValueError(f"x must have {K} features (the packed weight's columns), got shape {tuple(x.shape)}")
    M = x.shape[:-1].numel()  # rows of x
    decode_sized = M <= MAX_KERNEL_ROWS and not (x.requires_grad and torch.is_grad_enabled())
    kernel = kernel_module() if decode_sized and x.device.type == "cpu" else None
    if kernel is not None:  # numpy views around the call: a fraction of torch's reshape/view cost
        out = torch.from_numpy(kernel_matmul(x, fmt, qs, arrays or kernel_arrays(qs, d, m), threads, activations))
    elif decode_sized and x.device.type == "cuda":
        # triton: installed where packed weights run on CUDA
        from treeattn.ops.packed_triton import packed_matmul as triton_packed_matmul

        out = triton_packed_matmul(x.reshape(-1, K), fmt, qs, d, m).view(*x.shape[:-1], N)
    elif prefill_dtype == "bfloat16" and x.device.type == "cpu" and not decode_sized:
        w = dequantize_packed(fmt, qs, d, m).to(torch.bfloat16)
        out = F.linear(x.reshape(-1, K).to(torch.bfloat16), w).to(torch.float32).view(*x.shape[:-1], N)
    else:
        out = linear_float32(x.reshape(-1, K).to(torch.float32), dequantize_packed(fmt, qs, d, m)).view(*x.shape[:-1], N)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out if out.dtype == x.dtype else out.to(x.dtype)


__all__ = ["ACTIVATION_FORMATS", "AUTO_ACTIVATIONS", "BLOCK", "BLOCK_BYTES", "FORMATS", "MAX_KERNEL_ROWS", "PARALLEL_MIN_WEIGHTS",
           "PREFILL_DTYPES", "fast_bf16", "resolve_prefill_dtype",
           "Q4_K_BLOCK_BYTES", "Q5_0_BLOCK_BYTES", "Q6_K_BLOCK_BYTES",
           "dequantize_packed", "int8_module", "kernel_arrays", "kernel_matmul", "kernel_takes", "packed_matmul", "q4_k_as_q4_1",
           "q5_0_as_q8_0", "q6_k_as_q8_0", "resolve_activation_format", "unpack_blocks"]
