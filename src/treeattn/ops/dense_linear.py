"""A float32 x @ weight.T through oneDNN's matmul on the CPU: the LM head's product of many rows (prompt logprobs).

torch's float32 F.linear on the CPU calls MKL's sgemm. On this project's AMD EPYC (Zen 4, AVX-512) MKL ran
67-90 GFLOPS a core for SmolLM2's LM head by chunks (512-2048 rows x 576 x 512-4096 columns), oneDNN's matmul
91-102 GFLOPS for the same shapes, one thread, alternated, under load (docs/engine.md, "Session 19";
benchmarks/engine/prompt_logprobs_gemm.py).
Both are float32 products with float32 accumulation; they round apart (different blocking of the 576-term
sums), each within float32 rounding of float64. oneDNN is used only where its float32 math is strict:
torch.backends.mkldnn.matmul.fp32_precision "none" or "ieee" (torch.set_float32_matmul_precision("medium")
makes it "bf16": bfloat16 products, not float32 rounding), on float32 CPU tensors; elsewhere F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_float32() -> bool:
    """Whether linear_float32 takes oneDNN now: torch has oneDNN and its linear op, and its float32 math is strict."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    precision = getattr(matmul, "fp32_precision", None)
    return precision in ("none", "ieee") if precision is not None else torch.get_float32_matmul_precision() == "highest"


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for float32 x (n, k) and weight (m, k): oneDNN's matmul on the CPU where onednn_float32(),
    else F.linear. The values equal F.linear's within float32 rounding (not bit for bit: another summation order).

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
    return F.linear(x, weight)
