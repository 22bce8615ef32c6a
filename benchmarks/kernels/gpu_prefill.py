"""Causal prefill on a GPU: ta.attention (torch's fused CUDA flash kernel, with the logsumexp) vs SDPA.

    python benchmarks/kernels/gpu_prefill.py [--seq-lens 32768 65536 131072] [--output FILE]

Shapes: B = 1, Hq = 32, Hkv = 8, D = 128, bfloat16 (a Llama-3-8B layer), Sq = Sk = S, causal.
Timed with triton.testing.do_bench (median):

- treeattn: ta.attention(q, k, v, causal=True) in treeattn's layout (B, S, H, D), returning
  (out, lse): GQA folded into rows for the part every query of a block sees, one causal flash
  call per query head of the group for the diagonal blocks, merged with merge_states;
- sdpa flash: F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) on the flash
  backend, on the (B, H, S, D) contiguous layout it prefers (copied outside the timing); it
  returns no logsumexp, so it cannot be merged across ranks, but it is the speed to match;
- before: ta.attention with the fused CUDA kernel switched off (the chunked matmul path every
  CUDA prefill took before), at the shortest length only.

Outputs are checked against SDPA's. Without a CUDA device the script exits with status 2.
"""

from __future__ import annotations

import importlib
import sys

import torch
import torch.nn.functional as F

from treeattn.bench import harness

B, HQ, HKV, D = 1, 32, 8, 128


def main() -> None:
    parser = harness.parser(__doc__, helps={'output': 'write the results as JSON to this file'})
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072])
    args = harness.parse_args(parser)
    if not torch.cuda.is_available():
        print("gpu_prefill.py: no CUDA device", file=sys.stderr)
        sys.exit(2)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import treeattn as ta

    attention_module = importlib.import_module("treeattn.ops.attention")  # the module, not the function

    rows = []
    print("| S | treeattn ms | sdpa flash ms | sdpa / treeattn | treeattn TFLOP/s | before ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for S in args.seq_lens:
        torch.manual_seed(0)
        q = torch.randn(B, S, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16)
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

        ours, lse = ta.attention(q, k, v, causal=True)
        expected = sdpa().transpose(1, 2)
        max_diff = (ours.float() - expected.float()).abs().max().item()
        assert max_diff < 2e-2 and torch.isfinite(lse).all(), f"S={S}: max |diff| {max_diff}"
        ours_ms = do_bench(lambda: ta.attention(q, k, v, causal=True), warmup=5, rep=50, return_mode="median")
        sdpa_ms = do_bench(sdpa, warmup=5, rep=50, return_mode="median")
        before_ms = None
        if S == args.seq_lens[0]:
            saved = attention_module._cuda_flash
            attention_module._cuda_flash = None
            try:
                before_ms = do_bench(lambda: ta.attention(q, k, v, causal=True), warmup=1, rep=5, return_mode="median")
            finally:
                attention_module._cuda_flash = saved
        flops = 4 * B * HQ * D * S * S / 2  # causal: half of QK^T and PV
        row = {"seq_len": S, "treeattn_ms": ours_ms, "sdpa_flash_ms": sdpa_ms, "before_ms": before_ms,
               "max_abs_diff_vs_sdpa": max_diff, "treeattn_tflops": flops / ours_ms / 1e9}
        rows.append(row)
        before = f"{before_ms:.2f}" if before_ms is not None else "-"
        print(f"| {S} | {ours_ms:.2f} | {sdpa_ms:.2f} | {sdpa_ms / ours_ms:.2f}x | {row['treeattn_tflops']:.0f} | {before} |")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "B": B, "Hq": HQ, "Hkv": HKV, "D": D,
            "dtype": "bfloat16"}
    harness.write_output(args.output, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
