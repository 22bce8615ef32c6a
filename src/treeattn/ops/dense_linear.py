"""A float32 x @ weight.T on the CPU by the faster of MKL's sgemm and oneDNN's matmul on this CPU: the LM head's
product of many rows (prompt logprobs) and the prefill's float32 products.

torch's float32 F.linear on the CPU calls MKL's sgemm; torch.ops.mkldnn._linear_pointwise is oneDNN's matmul. Which is
faster depends on the CPU's vendor, so onednn_float32 follows a fixed rule on /proc/cpuinfo's vendor_id (cpu_vendor):
- AMD EPYC (Zen 4, AVX-512; this project's usual host): MKL ran 67-90 GFLOPS a core for SmolLM2's LM head by chunks
  (512-2048 rows x 576 x 512-4096 columns), oneDNN's matmul 91-102 (1.17-1.43x by medians), one thread, alternated,
  under load (docs/engine.md, "Session 19"; benchmarks/engine/prompt_logprobs_gemm.py). oneDNN.
- Intel Xeon (AVX-512, AMX; session 20): oneDNN's matmul was 0.90-0.98x MKL's by medians of 9 alternated repeats on
  the head's chunk (512 x 576 x 2048: 0.895) and the prefill's shapes (0.915-0.98), a prepacked oneDNN weight
  0.95-1.01x (benchmarks/engine/float32_linear_ab.py, one thread, load 3-5 on 2 cores; docs/data/eval20/), and in
  score_rows over 8,000 SmolLM2 rows oneDNN 1.005x MKL's wall time, prepacked 1.042x (medians of 3, alternated, load
  4; benchmarks/engine/prompt_logprobs_head_ab.py). MKL (F.linear).
- anything else (no /proc/cpuinfo, another vendor): oneDNN, as before session 20.
Both are float32 products with float32 accumulation; they round apart (different blocking of the sums), each within
float32 rounding of float64. oneDNN is used only where its float32 math is strict: torch.backends.mkldnn.matmul.
fp32_precision "none" or "ieee" (torch.set_float32_matmul_precision("medium") makes it "bf16": bfloat16 products, not
float32 rounding), on float32 CPU tensors; elsewhere F.linear.

prepack_float32 holds a weight in oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight, once), so that each
oneDNN call skips the weight's reorder: 5-9 % faster on the AMD EPYC for the LM head's chunks (session 19), the same
bits as the plain weight's product; linear_float32 multiplies either.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MKL_VENDORS = ("GenuineIntel",)
"""/proc/cpuinfo vendor_ids on which MKL's float32 sgemm is faster than oneDNN's matmul (see the module doc)."""


@functools.cache
def cpu_vendor() -> str:
    """This host's CPU vendor from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"); "" where it cannot be read.

    >>> from treeattn.ops.dense_linear import cpu_vendor
    >>> isinstance(cpu_vendor(), str)
    True
    """
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def onednn_float32() -> bool:
    """Whether linear_float32 takes oneDNN now: torch has oneDNN and its linear op, its float32 math is strict, and
    this CPU's vendor is not one of MKL_VENDORS (where MKL's sgemm is the faster float32 product)."""
    if cpu_vendor() in MKL_VENDORS:
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    precision = getattr(matmul, "fp32_precision", None)
    return precision in ("none", "ieee") if precision is not None else torch.get_float32_matmul_precision() == "highest"


def prepack_float32(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` (m, k) in oneDNN's blocked layout for products of about `rows` rows (an mkldnn tensor, made once by
    torch.ops.mkldnn._reorder_linear_weight), where linear_float32 takes oneDNN for a float32 CPU weight
    (onednn_float32()); else `weight` itself. The packed tensor holds the same values in about the same bytes and
    replaces the plain one: linear_float32 multiplies it with the same bits as the plain weight's oneDNN product.

    >>> import torch
    >>> from treeattn.ops.dense_linear import linear_float32, prepack_float32
    >>> x, w = torch.randn(5, 16), torch.randn(7, 16)
    >>> packed = prepack_float32(w, rows=5)
    >>> packed is w or packed.is_mkldnn, torch.equal(linear_float32(x, packed), linear_float32(x, w))
    (True, True)
    """
    if weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2 and not weight.is_mkldnn \
            and onednn_float32():
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return weight


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for float32 x (n, k) and weight (m, k) (a plain tensor, or prepack_float32's): oneDNN's matmul on
    the CPU where onednn_float32(), else F.linear (a prepacked weight made plain first: a reorder a call, only when the
    rule changed after packing). The values equal F.linear's within float32 rounding (not bit for bit: another
    summation order).

    >>> import torch
    >>> from treeattn.ops.dense_linear import linear_float32
    >>> x, w = torch.randn(5, 16, dtype=torch.float64), torch.randn(7, 16, dtype=torch.float64)
    >>> out = linear_float32(x.float(), w.float())
    >>> out.dtype, out.shape, torch.allclose(out.double(), x.float().double() @ w.float().double().T, atol=1e-5)
    (torch.float32, torch.Size([5, 7]), True)
    """
    if (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu" and x.dim() == 2
            and weight.dim() == 2 and x.shape[0] > 0 and onednn_float32()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight.to_dense() if weight.is_mkldnn else weight)
