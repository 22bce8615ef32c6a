import time, torch
from treeattn.ops.packed_linear import dequantize_packed
torch.manual_seed(0); torch.set_num_threads(1)
def deq_bf16(fmt, qs, d, m):
    return dequantize_packed(fmt, qs, d, m).to(torch.bfloat16)
for (N, K, M) in [(1536, 576, 4096), (576, 1536, 4096), (576, 576, 4096), (2048, 640, 4096), (640, 2048, 4096)]:
    qs = torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8); d = torch.rand(N, K // 32) * 0.01; m = torch.rand(N, K // 32) * -0.01
    x = torch.randn(M, K)
    res = {"f32": [], "bf16": []}
    for r in range(4):
        for name in (("f32", "bf16") if r % 2 == 0 else ("bf16", "f32")):
            t = time.thread_time()
            if name == "f32":
                y = torch.nn.functional.linear(x, dequantize_packed("q4_1", qs, d, m))
            else:
                y2 = torch.nn.functional.linear(x.to(torch.bfloat16), deq_bf16("q4_1", qs, d, m)).float()
            res[name].append(time.thread_time() - t)
    err = ((y2 - y).abs().max() / y.abs().max()).item()
    f, b = min(res["f32"]), min(res["bf16"])
    print(N, K, M, f"f32 {f*1e3:.1f} ms bf16 {b*1e3:.1f} ms ratio {f/b:.2f} relerr {err:.2e}", flush=True)
