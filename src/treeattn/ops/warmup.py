"""Every numba kernel called once on tiny inputs, so that no compilation happens inside a timed step.

    warm_kernels(kv_dtypes=(torch.float32,), attention_threads=2, packed=[("q4_1", torch.uint8, 1)],
                 rowwise=True, combine=(torch.float32,))      # a rank at start: what its model will call
    warm_all()                                                 # every kernel in every dtype (install time)
    python -m treeattn.ops.warmup                              # the same, from scripts/install.sh

numba compiles a kernel for each new type signature on its first call and keeps the machine code
beside its source file (cache=True); a later process loads it from there, which still takes a
fraction of a second per kernel. So the first decode step of a fresh install compiled for seconds,
and the first step of every process paid the loading. warm_all, run by scripts/install.sh, fills the
on-disk cache for every signature the library calls: the four KV-cache element types (float32,
bfloat16, float16, fp8_e4m3), serial and parallel kernels, the packed weight formats, the row-wise
ops, onepass's combine and prompt logprobs' reduction of a chunk of logits. The engine's ranks call
warm_kernels at start (as vLLM warms up before serving) with what their model and cache will call, so the first
request loads nothing either.

The inputs go through the same wrappers and array types as the real calls (attend_blocks,
packed_matmul's kernel.matmul, rowwise, onepass's numpy views), so every call hits a signature the
real ones then find compiled; tests/test_warmup.py checks it on an engine's first request. Without
numba every function here does nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np
import torch

from treeattn.ops.fp8 import FP8
from treeattn.ops.kernels import optional_kernel

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8)
"""The element types of a KV cache the CPU attention kernel reads (treeattn.cache.paged)."""
PACKED_KINDS = (("q4_0", torch.uint8), ("q4_1", torch.uint8), ("q8_0", torch.int8), ("q8_0", torch.int16))
"""(format, values' dtype) of the packed weights (treeattn.ops.packed_linear; int16: Q6_K as q8_0)."""
SHIPPED_HEADS = ((3, 3, 64), (1, 4, 256))
"""(KV heads, query heads a KV head, head dim) of the models scripts/install.sh installs, SmolLM2-135M and Gemma 3 270M:
the attention kernel compiles such shapes in (paged_cpu_kernel.head_shape_tag), so warm_all compiles them too, and a first
answer from either model after an install compiles nothing (Gemma 3's took 20-22 s of setup before, on an Intel Xeon)."""
ONEPASS_WINDOW = 550.0  # treeattn.parallel.tree_decode.ONEPASS_WINDOW's type (a float); ops imports nothing above it


def _attend(dtype: torch.dtype, threads: int, heads: tuple[int, int, int] = (1, 2, 8)) -> None:
    """attend_blocks over two blocks of two tokens in `dtype` on `threads` threads (1: the serial kernel),
    `heads` = (KV heads, query heads a KV head, head dim): a model's own shape where the kernel compiles
    it in (paged_cpu_kernel.head_dim_tag, head_shape_tag: head dim 64)."""
    from treeattn.ops.cpu_decode import attend_blocks, kernel_splits

    hkv, group, dim = heads
    blocks = torch.zeros(2, 2, hkv, dim).to(dtype)
    scales = (torch.ones(2, 2, hkv), torch.ones(2, 2, hkv)) if dtype == FP8 else (None, None)
    arrays = (torch.arange(2).view(1, 2).numpy(), torch.arange(4).view(1, 4).numpy(), torch.zeros(1, dtype=torch.int64).numpy(),
              torch.full((1,), 3, dtype=torch.int64).numpy(), kernel_splits(threads, 1, 2))
    attend_blocks(torch.zeros(1, 1, hkv * group, dim), blocks, blocks, dim, arrays, threads=threads, scale=0.5, window=None,
                  k_scales=scales[0], v_scales=scales[1])


def _matmul(fmt: str, values: torch.dtype, threads: int, int8: bool = False) -> bool:
    """packed_matmul's kernel call on a weight of two rows and one block in `fmt`, `values` dtype; with `int8` the
    8-bit activation kernel's instead (activation_format="int8"). Returns False where that kernel does not run
    (int16 values, or a host without the int8 kernel), having called nothing."""
    from treeattn.ops.packed_linear import int8_module, kernel_arrays, kernel_module
    from treeattn.ops.kernels import numpy_rows

    kernel = (int8_module() if values != torch.int16 else None) if int8 else kernel_module()
    if kernel is None:
        return False
    qs = torch.zeros(2, 1, 32 if fmt == "q8_0" else 16, dtype=values)
    d = torch.ones(2, 1)
    out = np.empty((1, 2), dtype=np.float32)
    kernel.matmul(threads, fmt, numpy_rows(torch.zeros(1, 32), 32), *kernel_arrays(qs, d, d if fmt == "q4_1" else None), out)
    return True


def _rowwise() -> None:
    from treeattn.ops.rowwise import apply_rope, apply_rope_pair, rms_norm

    rms_norm(torch.ones(1, 8), torch.ones(8), 1e-6)
    apply_rope(torch.ones(1, 1, 1, 8), torch.ones(1, 1, 8), torch.zeros(1, 1, 8))
    apply_rope_pair(torch.ones(1, 1, 2, 8), torch.ones(1, 1, 1, 8), torch.ones(1, 1, 8), torch.zeros(1, 1, 8))


SEGMENT_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The KV-cache dtypes the compiled decode segments write (treeattn.ops.decode_layer_cpu; their arena's element type is
in their signature)."""


def _segments(kv_dtype: torch.dtype, int8: bool, gemma: bool = False) -> bool:
    """The compiled decode segments (treeattn.ops.decode_layer_cpu; with `gemma`, Gemma 3's) once each on a layer of
    hidden size 32 (4 query heads, 1 KV head of 8), writing a cache of `kv_dtype`, with float32 activations or (int8)
    8-bit ones where the host runs them. Returns False (nothing called) for int8 on a host without the int8 kernel."""
    from treeattn.ops import decode_layer_cpu as seg
    from treeattn.ops.packed_linear import int8_module

    if int8 and int8_module() is None:
        return False
    bits = {torch.float32: torch.float32, torch.float16: torch.int16, torch.bfloat16: torch.uint16}[kv_dtype]

    def matrix(rows: int, columns: int) -> tuple:
        return (seg.Q8_0, np.zeros((rows, columns // 32, 32), np.uint8), np.ones((rows, columns // 32), np.float32),
                np.ones((rows, columns // 32), np.float32))

    def rows(*shape: int) -> np.ndarray:
        return np.zeros(shape, np.float32)

    mode, norm = (seg.INT8 if int8 else seg.FLOAT32), np.ones(32, np.float32)
    h, xn, out, q, k = rows(1, 32), rows(1, 32), rows(1, 32), rows(1, 4, 8), rows(1, 1, 8)
    kv = torch.zeros(1, 2, 2, 2, 1, 8, dtype=bits).numpy()
    index = np.zeros(1, np.int64)
    if gemma:  # Gemma 3's segments (gemma_*): six norms a layer, the q/k norms' scratch, the query factor
        norms = (norm,) * 4 + (np.ones(8, np.float32),) * 2
        attention = (matrix(48, 32), rows(1, 48), (rows(4, 8), rows(1, 32), rows(1, 8), rows(1, 8)), rows(1, 8), rows(1, 8),
                     0.5, q, k, kv, 0, index, index)
        seg.gemma_attention_input(mode, h, norms, 1e-6, xn, *attention)
        seg.gemma_mlp_input(mode, rows(1, 32), matrix(32, 32), out, h, norms, 1e-6, rows(1, 32), xn, matrix(64, 32),
                            rows(1, 64))
        seg.gemma_mlp_output(mode, rows(1, 32), matrix(32, 32), out, h, norms, 1e-6, rows(1, 32), xn, norms, *attention)
        seg.gemma_final_output(mode, rows(1, 32), matrix(32, 32), out, h, norms, 1e-6, rows(1, 32), norm, 1e-6, xn)
        seg.window_store(k, rows(1, 48), 40, 0, rows(2, 1, 8), rows(2, 1, 8), 0, kv.reshape(-1)[0])  # a ring row
        return True
    attention = (matrix(48, 32), rows(1, 48), rows(1, 8), rows(1, 8), q, k, kv, 0, index, index)
    seg.attention_input(mode, h, norm, 1e-6, xn, *attention)
    seg.mlp_input(mode, rows(1, 32), matrix(32, 32), out, h, norm, 1e-6, xn, matrix(64, 32), rows(1, 64))
    seg.mlp_output(mode, rows(1, 32), matrix(32, 32), out, h, norm, 1e-6, xn, *attention)
    seg.final_output(mode, rows(1, 32), matrix(32, 32), out, h, norm, 1e-6, xn)
    # the Helix layout's (--tp): the same segments cut at its all-reduces
    seg.product(mode, rows(1, 32), matrix(32, 32), out)
    seg.norm_gate_up(mode, out, h, norm, 1e-6, xn, matrix(64, 32), rows(1, 64))
    seg.residual_attention_input(mode, out, h, norm, 1e-6, xn, *attention)
    seg.residual_final_norm(out, h, norm, 1e-6, xn)
    return True


def _combine(dtype: torch.dtype) -> None:
    """onepass_combine's two kernel calls (treeattn.parallel.tree_decode._onepass_combine_cpu) without the all-reduce."""
    kernel = optional_kernel("combine_cpu_kernel")
    out, lse = torch.zeros(1, 1, 2, 4, dtype=dtype), torch.zeros(1, 2, 1, dtype=dtype)
    buffer = torch.empty(out.numel() + lse.numel() + 1, dtype=torch.float64)
    kernel.onepass_pack(out.numpy(), lse.numpy(), ONEPASS_WINDOW, buffer.numpy())
    kernel.onepass_unpack(buffer.numpy(), torch.empty_like(out).numpy(), torch.empty_like(lse).numpy())


def _logits() -> None:
    """prompt logprobs' reduction of a chunk of logits (engine.worker.prompt_logprobs._ChunkReducer's call)."""
    kernel = optional_kernel("logits_cpu_kernel")
    logits, rows = np.zeros((2, 4), dtype=np.float32), np.zeros(2, dtype=np.float32)
    kernel.reduce_chunk(logits, rows, 0, rows.copy(), rows.copy(), rows.copy(), np.full((2, 1), -np.inf, dtype=np.float32),
                        np.zeros((2, 1), dtype=np.int64))


def warm_kernels(*, kv_dtypes=(), attention_threads: int = 1, packed=(), rowwise: bool = False, combine=(),
                 int8: bool = False, attention_heads=(), decode_segments=(), gemma_segments=(),
                 logits: bool = False) -> list[str]:
    """Call each named numba kernel once on tiny inputs (compiling it, or loading it from numba's cache).

    Args:
        kv_dtypes: KV-cache element types (of KV_DTYPES) the paged attention kernel reads.
        attention_threads: the rank's threads (torch.get_num_threads()): the serial attention kernel, and for more
            than 1 the parallel one too (a step over a short context runs serially: cpu_decode.kernel_threads).
        packed: (fmt, values dtype, threads) of the packed weights multiplied (threads 1: serial).
        rowwise: RMSNorm and RoPE in float32.
        combine: state dtypes (float32, float64) of onepass's combine.
        int8: the packed weights' 8-bit activation kernel too (activation_format="int8"), where this host runs it.
        attention_heads: (KV heads, query heads a KV head, head dim) of the model's attention layers: the
            attention kernel for each kv_dtype in those shapes too (head dim 64 compiles them in).
        decode_segments: KV-cache dtypes (of SEGMENT_KV_DTYPES) the compiled decode segments write
            (treeattn.ops.decode_layer_cpu): float32 activations, and with `int8` 8-bit ones too.
        gemma_segments: the same for Gemma 3's segments (decode_layer_cpu.gemma_*).
        logits: prompt logprobs' reduction of a chunk of float32 logits (ops.logits_cpu_kernel).

    Returns:
        What was called, one line each; [] without numba.

    >>> warm_kernels(rowwise=True, packed=[("q4_1", torch.uint8, 1)]) in ([], ["rowwise", "packed q4_1 torch.uint8 threads=1"])
    True
    """
    done = []
    if optional_kernel("rowwise_cpu_kernel") is None:
        return done
    if rowwise:
        _rowwise()
        done.append("rowwise")
    for dtype, threads in ((d, t) for d in kv_dtypes for t in sorted({1, attention_threads})):
        _attend(dtype, threads)
        done.append(f"attention {dtype} threads={threads}")
        for heads in attention_heads:
            _attend(dtype, threads, heads)
            done.append(f"attention {dtype} threads={threads} heads={heads}")
    for fmt, values, threads in packed:
        _matmul(fmt, values, threads)
        done.append(f"packed {fmt} {values} threads={threads}")
        if int8 and _matmul(fmt, values, threads, int8=True):
            done.append(f"packed int8 {fmt} {values} threads={threads}")
    for dtype in combine:
        _combine(dtype)
        done.append(f"combine {dtype}")
    for gemma, dtypes in ((False, decode_segments), (True, gemma_segments)):
        for dtype in dtypes:
            for with_int8 in (False, True) if int8 else (False,):
                if _segments(dtype, with_int8, gemma):
                    done.append(f"{'gemma3 ' if gemma else ''}decode segments {dtype}{' int8' if with_int8 else ''}")
    if logits:
        _logits()
        done.append("logits")
    return done


def warm_groups(threads: int | None = None) -> list[list[dict]]:
    """warm_all's work as groups of warm_kernels keyword sets, no two groups compiling a signature of the same kernel
    function but the small shared helpers: one group per KV dtype of the attention kernel (serial and `threads`-thread,
    in every head shape: its non-inlined helpers take the dtype in their signature), then the packed matmuls (and their
    int8 kernels), the row-wise ops and onepass's combine. `threads` defaults to the CPU count, at least 2.

    >>> [len(group) for group in warm_groups(4)]
    [2, 2, 2, 2, 3, 1]
    """
    threads = max(2, threads or os.cpu_count() or 2)
    groups = [[dict(kv_dtypes=(dtype,), attention_threads=t, attention_heads=SHIPPED_HEADS) for t in (1, threads)]
              for dtype in KV_DTYPES]
    groups.append([dict(packed=[(f, v, t) for f, v in PACKED_KINDS], int8=True) for t in (1, threads)]
                  + [dict(rowwise=True, combine=(torch.float32, torch.float64), logits=True)])
    groups.append([dict(decode_segments=SEGMENT_KV_DTYPES, gemma_segments=SEGMENT_KV_DTYPES, int8=True)])
    return groups


def warm_all(threads: int | None = None, part: int = 0, parts: int = 1) -> list[str]:
    """warm_kernels for every signature the library calls: serial and `threads`-thread (default: the
    CPU count, at least 2) kernels, every KV dtype and packed kind (and its int8 kernel where the host runs it), the
    attention kernel in the shipped models' head shapes too (SHIPPED_HEADS), the row-wise ops, both combine dtypes.
    With `parts` > 1, only the groups of warm_groups numbered `part` modulo `parts` (one of `parts` processes)."""
    if not 0 <= part < parts:
        raise ValueError(f"part: expected 0 <= part < parts ({parts}), got {part}")
    done = []
    for group in warm_groups(threads)[part::parts]:
        for kwargs in group:
            done += warm_kernels(**kwargs)
    return done


def main(argv: list[str] | None = None) -> int:
    """`python -m treeattn.ops.warmup [--jobs N]`: warm_all in N processes (default: 2 where the host has 2 CPUs
    and flock, else 1), their cache saves under ops.numba_cache's lock; one line on stderr. `--part I/N` is one of them.

    >>> main(["--jobs", "0"])
    Traceback (most recent call last):
    SystemExit: 2
    """
    args = _parser().parse_args(argv)
    if args.part is not None:
        part, parts = args.part
        sys.stdout.write(f"{len(warm_all(part=part, parts=parts))}\n")
        return 0
    jobs = args.jobs or (2 if (os.cpu_count() or 1) >= 2 and _has_flock() else 1)
    children = [subprocess.Popen([sys.executable, "-m", "treeattn.ops.warmup", "--part", f"{i}/{jobs}"],
                                 stdout=subprocess.PIPE, text=True) for i in range(1, jobs)]
    try:
        done = len(warm_all(part=0, parts=jobs))
    except BaseException:
        for child in children:  # no part left compiling after this one failed
            child.kill()
            child.wait()
        raise
    for child in children:
        out, _ = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"warm-up part {child.args[-1]} failed with exit code {child.returncode}")
        done += int(out.split()[-1])
    processes = f"{jobs} process{'es' * (jobs > 1)}"
    sys.stderr.write(f"treeattn: {done} numba kernel signatures compiled or loaded from numba's cache ({processes})\n"
                     if done else "treeattn: numba is not installed; nothing to compile\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m treeattn.ops.warmup",
                                     description="Compile (or load) every numba kernel signature the library calls.")
    parser.add_argument("--jobs", type=_count, default=None,
                        help="processes to compile in (default: 2 where the host has 2 CPUs and flock, else 1)")
    parser.add_argument("--part", type=_part, default=None, metavar="I/N",
                        help="compile only part I of N (0 <= I < N), print its count (what --jobs starts)")
    return parser


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {text!r}")
    return int(text)


def _part(text: str) -> tuple[int, int]:
    part, _, parts = text.partition("/")
    if not (part.isdigit() and parts.isdigit() and int(part) < int(parts)):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {text!r}")
    return int(part), int(parts)


def _has_flock() -> bool:
    try:
        import fcntl  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["KV_DTYPES", "PACKED_KINDS", "SEGMENT_KV_DTYPES", "SHIPPED_HEADS", "warm_all", "warm_groups", "warm_kernels"]
