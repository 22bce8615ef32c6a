"""One decode step on a GPU: the Triton flash-decoding kernel vs torch's alternatives.

    python benchmarks/kernels/gpu_decode.py [--seq-lens 8192 65536 524288 2097152] [--sq 1] [--output FILE]
    python benchmarks/kernels/gpu_decode.py --compile-only [--arch 80 90]   # no GPU needed

Shapes: B = 1, Hq = 32, Hkv = 8, D = 128, bfloat16 (a Llama-3-8B layer), Sq query tokens against
Sk cached keys. Timed, each with the L2 cache flushed before every call (triton.testing.do_bench,
median):

- triton: treeattn.ops.triton_decode.decode_attention on the cache in treeattn's layout
  (B, Sk, Hkv, D), returning (out, lse);
- triton paged: paged_decode_attention over the same memory viewed as a pool of 16-token blocks
  read through a shuffled block table;
- sdpa flash / sdpa efficient: F.scaled_dot_product_attention restricted to one backend, on the
  (B, H, Sk, D) contiguous layout it prefers (copied outside the timing), GQA by enable_gqa or, if
  the backend refuses it, by K/V repeated to Hq heads (which reads G times the bytes);
- matmul: q @ K^T, float32 softmax, @ V with the GQA group folded into rows (no repeat).

Achieved bandwidth = K/V bytes / time, set against the copy bandwidth measured in the same run
(a device-to-device copy of 2 GiB; read + write bytes / time). Every alternative's output is
checked against the kernel's. Without a CUDA device the script exits with status 2 and says so;
--compile-only compiles the kernels for NVIDIA targets offline and reports registers, spills and
shared memory, which needs no GPU.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

from treeattn.bench import harness

DEFAULT_SEQ_LENS = [8192, 65536, 524288, 2097152]
B, HQ, HKV, D = 1, 32, 8, 128


def copy_bandwidth(do_bench, nbytes: int = 2 << 30) -> float:
    """Bytes per second moved by a device-to-device copy (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    src = dst = None  # free the copies (rebinding, not del: the lambda above reads these names)
    return 2 * nbytes / (ms * 1e-3)


def graph_replay_ms(fn, reps: int = 50) -> float:
    """Median time of one CUDA-graph replay of fn, the L2 cache flushed before each: the kernel
    time without the host's launch overhead (what a decode step captured in a graph pays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def sdpa_runner(backend, q, k_heads, v_heads, scale):
    """A closure running SDPA on one backend, with enable_gqa if the backend takes it, else repeated K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    q_heads = q.transpose(1, 2)

    def gqa():
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q_heads, k_heads, v_heads, scale=scale, enable_gqa=True)

    try:
        gqa()
        return gqa, "enable_gqa"
    except RuntimeError:
        pass
    group = q.shape[2] // k_heads.shape[1]
    k_rep, v_rep = k_heads.repeat_interleave(group, 1), v_heads.repeat_interleave(group, 1)

    def repeated():
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q_heads, k_rep, v_rep, scale=scale)

    repeated()
    return repeated, "K/V repeated to Hq heads"


def matmul_attention(q, k_heads, v_heads, scale):
    """Plain matmul-softmax-matmul with the GQA group folded into rows: (B, Hkv, G*Sq, D)."""
    Bq, Sq, Hq, Dq = q.shape
    Hkv = k_heads.shape[1]
    rows = q.view(Bq, Sq, Hkv, Hq // Hkv, Dq).permute(0, 2, 3, 1, 4).reshape(Bq, Hkv, -1, Dq)
    scores = torch.matmul(rows, k_heads.transpose(-1, -2)).float() * scale
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, v_heads)  # (B, Hkv, G*Sq, D)
    return out.view(Bq, Hkv, Hq // Hkv, Sq, -1).permute(0, 3, 1, 2, 4).reshape(Bq, Sq, Hq, -1)


def measure(args) -> dict:
    import triton
    from triton.testing import do_bench

    from treeattn.ops import triton_decode as td

    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth(do_bench)
    meta = {
        "device": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "host": platform.machine(),
        "B": B, "Sq": args.sq, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": args.dtype,
        "copy_gb_per_s": copy_bw / 1e9,
    }
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# B={B} Sq={args.sq} Hq={HQ} Hkv={HKV} D={D} {args.dtype}; copy bandwidth (read+write) {copy_bw / 1e9:.0f} GB/s")
    print("| Sk | triton ms | triton paged ms | sdpa flash ms | sdpa efficient ms | matmul ms | triton GB/s | % of copy bw | "
          "fastest alternative / triton |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    scale = D ** -0.5
    for Sk in args.seq_lens:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, args.sq, HQ, D, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(B, Sk, HKV, D, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(B, Sk, HKV, D, device="cuda", dtype=dtype, generator=g)
        kv_bytes = 2 * k.numel() * k.element_size()
        row = {"seq_len": Sk, "kv_bytes": kv_bytes, "notes": {}}
        bench = lambda fn: do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")  # noqa: E731

        out, _ = td.decode_attention(q, k, v, scale=scale)
        row["triton_ms"] = bench(lambda: td.decode_attention(q, k, v, scale=scale))
        row["triton_graph_ms"] = graph_replay_ms(lambda: td.decode_attention(q, k, v, scale=scale))

        block = 16
        perm = torch.randperm(Sk // block, device="cuda", generator=g).to(torch.int32).unsqueeze(0)
        lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
        k_pool, v_pool = k.view(Sk // block, block, HKV, D), v.view(Sk // block, block, HKV, D)
        td.paged_decode_attention(q, k_pool, v_pool, perm, lens, scale=scale)
        row["triton_paged_ms"] = bench(lambda: td.paged_decode_attention(q, k_pool, v_pool, perm, lens, scale=scale))

        # The alternatives read K/V in the (B, H, S, D) layout they prefer; K/V are moved there
        # (not copied: the originals are freed) so 2M keys fit next to the repeated copies.
        k_heads, v_heads = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        k = v = k_pool = v_pool = None  # free this length's tensors (rebinding, not del: lambdas above read the names)
        for name in ("flash", "efficient"):
            try:
                fn, how = sdpa_runner(name, q, k_heads, v_heads, scale)
                row[f"sdpa_{name}_ms"] = bench(fn)
                if name == "flash":
                    row["sdpa_flash_graph_ms"] = graph_replay_ms(fn)
                row["notes"][f"sdpa_{name}"] = how
                row[f"sdpa_{name}_max_abs_diff"] = (fn().transpose(1, 2).float() - out.float()).abs().max().item()
                del fn
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                row[f"sdpa_{name}_ms"] = None
                row["notes"][f"sdpa_{name}"] = f"not run: {str(exc).splitlines()[0][:120]}"
            torch.cuda.empty_cache()
        try:
            row["matmul_ms"] = bench(lambda: matmul_attention(q, k_heads, v_heads, scale))
            row["matmul_max_abs_diff"] = (matmul_attention(q, k_heads, v_heads, scale).float() - out.float()).abs().max().item()
        except torch.cuda.OutOfMemoryError as exc:
            row["matmul_ms"] = None
            row["notes"]["matmul"] = f"not run: {str(exc).splitlines()[0][:120]}"
        k_heads = v_heads = None
        torch.cuda.empty_cache()

        row["triton_gb_per_s"] = kv_bytes / (row["triton_ms"] * 1e-3) / 1e9
        row["fraction_of_copy_bw"] = row["triton_gb_per_s"] * 1e9 / copy_bw
        others = [row[key] for key in ("sdpa_flash_ms", "sdpa_efficient_ms", "matmul_ms") if row[key] is not None]
        row["fastest_alternative_over_triton"] = min(others) / row["triton_ms"] if others else None
        rows.append(row)
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        ratio = "n/a" if row["fastest_alternative_over_triton"] is None else f"{row['fastest_alternative_over_triton']:.2f}x"
        print(f"| {Sk} | {fmt(row['triton_ms'])} | {fmt(row['triton_paged_ms'])} | {fmt(row['sdpa_flash_ms'])} | "
              f"{fmt(row['sdpa_efficient_ms'])} | {fmt(row['matmul_ms'])} | {row['triton_gb_per_s']:.0f} | "
              f"{100 * row['fraction_of_copy_bw']:.0f}% | {ratio} |", flush=True)
        if row["notes"]:
            print(f"#   Sk={Sk}: " + "; ".join(f"{key}: {val}" for key, val in row["notes"].items()))
    print("\nCUDA-graph replay (kernel time, no host launch overhead; L2 flushed before each replay):")
    print("| Sk | triton ms | sdpa flash ms | triton GB/s | % of copy bw | sdpa flash / triton |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        graph_bw = row["kv_bytes"] / (row["triton_graph_ms"] * 1e-3)
        row["triton_graph_gb_per_s"] = graph_bw / 1e9
        flash = row.get("sdpa_flash_graph_ms")
        flash_ms = "n/a" if flash is None else f"{flash:.4f}"
        ratio = "n/a" if flash is None else f"{flash / row['triton_graph_ms']:.2f}x"
        print(f"| {row['seq_len']} | {row['triton_graph_ms']:.4f} | {flash_ms} | "
              f"{graph_bw / 1e9:.0f} | {100 * graph_bw / copy_bw:.0f}% | {ratio} |")
    return {"meta": meta, "rows": rows}


# ---------------------------------------------------------------- offline compilation report


def _specialize(jit_fn, values, constexprs):
    """Signature and attributes as the launcher would specialize them: ints equal to 1 become
    constants, pointers and multiples of 16 get tt.divisibility 16."""
    signature, attrs, constants = {}, {}, dict(constexprs)
    for index, name in enumerate(jit_fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        value = values[name]
        if isinstance(value, str):
            signature[name] = value
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs, constants


def _split_kernel_values(Sq, Hq, Hkv, Dh, dtype, paged, Sk=65536, block_size=16, fp8=False):
    kv = (block_size * Hkv * Dh if paged else Sk * Hkv * Dh, Hkv * Dh, Dh, 1)
    kv_type = "*u8" if fp8 else "*" + dtype  # an fp8 cache's codes are passed as bytes
    return dict(
        q_ptr="*" + dtype, k_ptr=kv_type, v_ptr=kv_type, part_out_ptr="*fp32", part_lse_ptr="*fp32",
        q_pos_ptr="*i64", kv_pos_ptr="*i64", block_table_ptr="*i32", seq_lens_ptr="*i32",
        k_scale_ptr="*fp32", v_scale_ptr="*fp32",
        stride_qb=Sq * Hq * Dh, stride_qs=Hq * Dh, stride_qh=Dh, stride_qd=1,
        stride_kb=kv[0], stride_ks=kv[1], stride_kh=kv[2], stride_kd=1,
        stride_vb=kv[0], stride_vs=kv[1], stride_vh=kv[2], stride_vd=1,
        stride_ksb=block_size * Hkv, stride_kss=Hkv, stride_ksh=1, stride_vsb=block_size * Hkv, stride_vss=Hkv, stride_vsh=1,
        stride_po_split=Sq * Hq * Dh, stride_po_b=Sq * Hq * Dh, stride_po_q=Hq * Dh, stride_po_h=Dh,
        stride_pl_split=Hq * Sq, stride_pl_b=Hq * Sq, stride_pl_h=Sq,
        stride_qpos_b=0, stride_qpos_s=1, stride_kvpos_b=0, stride_kvpos_s=1,
        stride_bt_b=Sk // block_size, stride_bt_n=1, stride_sl=1,
        Sq=Sq, Sk=Sk, Hkv=Hkv, group=Hq // Hkv, split_len=4096, block_size=block_size if paged else 1,
        window=7, scale_log2=0.1, softcap_log2=72.1,
    )


def compile_report(archs, quick: bool) -> list[dict]:
    """Compile _split_kv_kernel for each configuration and NVIDIA arch; report resource usage."""
    import itertools

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treeattn.ops import triton_decode as td

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    dtypes = ["bf16"] if quick else ["bf16", "fp16", "fp32"]
    head_dims = [128] if quick else [64, 128, 256]
    # (Sq, paged, causal with kv_pos, fp8 cache: e4m3 codes and per-key scales)
    cases = [(1, False, False, False), (16, False, True, False), (1, True, True, False), (1, True, True, True)]
    report = []
    for arch, dtype, Dh, (Sq, paged, causal, fp8) in itertools.product(archs, dtypes, head_dims, cases):
        size = 4 if dtype == "fp32" else 2
        rows = HQ // HKV * Sq
        block_m = min(max(td.MIN_BLOCK_ROWS, triton.next_power_of_2(rows)), td.MAX_BLOCK_ROWS)
        block_n, num_warps, num_stages = td._pick_tiles(block_m, Dh, Dh, size)
        constexprs = dict(D=Dh, DV=Dh, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, HAS_WINDOW=False,
                          HAS_Q_POS=False, HAS_KV_POS=causal, PAGED=paged, DOT_FP32=dtype == "fp32",
                          HAS_SOFTCAP=False, FP8_KV=fp8)
        jit_fn = td._split_kv_kernel
        signature, attrs, constants = _specialize(jit_fn, _split_kernel_values(Sq, HQ, HKV, Dh, dtype, paged, fp8=fp8),
                                                  constexprs)
        kernel = triton.compile(ASTSource(jit_fn, signature, constexprs=constants, attrs=attrs),
                                target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name],
                                   capture_output=True, text=True, check=True).stdout
        fields = dict(item.split(":") for item in next(line for line in usage.splitlines() if "REG:" in line).split())
        report.append({
            "arch": f"sm_{arch}", "dtype": dtype, "D": Dh, "Sq": Sq, "rows": rows, "paged": paged, "causal": causal,
                       "fp8_kv": fp8,
            "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages,
            "registers": int(fields["REG"]), "spill_stack_bytes": int(fields["STACK"]), "local_bytes": int(fields["LOCAL"]),
            "shared_bytes": kernel.metadata.shared,
            "pipelined_loads": "async_copy_global_to_local" in kernel.asm["ttgir"],
        })
    return report


def main() -> None:
    parser = harness.parser(__doc__, helps={'output': 'write the results as JSON to this file'})
    parser.add_argument("--seq-lens", type=int, nargs="+", default=DEFAULT_SEQ_LENS)
    parser.add_argument("--sq", type=int, default=1, help="query tokens per step (1..16)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition budget, ms")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for --arch offline and report resources; no GPU needed")
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="NVIDIA compute capabilities for --compile-only")
    parser.add_argument("--quick", action="store_true", help="--compile-only: bf16 D=128 only")
    args = harness.parse_args(parser)
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)  # must be unset before triton is imported
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("gpu_decode: triton is not installed (pip install 'treeattn[triton]' or pip install triton)")

    if args.compile_only:
        report = compile_report(args.arch, args.quick)
        print("| arch | dtype | D | rows | paged | fp8 KV | BLOCK_M x BLOCK_N | warps | stages | registers | spill bytes | "
              "shared KiB | pipelined |")
        print("|---|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---|")
        for r in report:
            print(f"| {r['arch']} | {r['dtype']} | {r['D']} | {r['rows']} | {r['paged']} | {r['fp8_kv']} | {r['BLOCK_M']} x "
                  f"{r['BLOCK_N']} | "
                  f"{r['num_warps']} | {r['num_stages']} | {r['registers']} | {r['spill_stack_bytes']} | "
                  f"{r['shared_bytes'] / 1024:.1f} | {r['pipelined_loads']} |")
        result = {"compile_report": report, "triton": __import__("triton").__version__}
    else:
        if not torch.cuda.is_available():
            print("gpu_decode: no CUDA device found (torch.cuda.is_available() is False); this benchmark needs an "
                  "NVIDIA GPU. Run it on one with: python benchmarks/kernels/gpu_decode.py --output results/gpu_decode.json. "
                  "Without a GPU, --compile-only checks that the kernels compile for sm_80/sm_90.", file=sys.stderr)
            sys.exit(2)
        if not 1 <= args.sq <= 16:
            sys.exit(f"gpu_decode: --sq must be in 1..16, got {args.sq}")
        if any(s % 16 or s <= 0 for s in args.seq_lens):
            sys.exit("gpu_decode: every --seq-lens value must be a positive multiple of 16 (the paged block size)")
        result = measure(args)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
