"""The Triton flash-decoding kernel (treeattn.ops.triton_decode) against the float64 reference.

Without CUDA the kernels run on CPU tensors through Triton's interpreter. Triton reads
TRITON_INTERPRET when a kernel is decorated and again at launch, so it is set here, before the
kernel module is imported, and left set for the session (nothing else in treeattn uses Triton on
the CPU). With CUDA the same small tests run compiled on the GPU, and the tests marked `gpu`
add real decode shapes. The whole module is skipped when triton is not installed.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

import treeattn as ta  # noqa: E402
from treeattn.ops import merge_states_list, reference_attention  # noqa: E402

td = importlib.import_module("treeattn.ops.triton_decode")
if not HAS_CUDA and not td._INTERPRETED:  # imported earlier without the interpreter
    td = importlib.reload(td)

DEVICE = "cuda" if HAS_CUDA else "cpu"
# Interpreter or compiled kernel against the float64 oracle on the same rounded inputs: float32
# is exact up to accumulation order; 16-bit inputs round the probabilities fed to P @ V and the
# output to their dtype.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def make_qkv(B=1, Sq=1, Sk=37, Hq=4, Hkv=2, D=16, Dv=None, dtype=torch.float32, seed=0, logit_scale=1.0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = (torch.randn(B, Sq, Hq, D, generator=g) * logit_scale).to(dtype).to(device)
    k = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Sk, Hkv, Dv, generator=g).to(dtype).to(device)
    return q, k, v


def assert_state_close(out, lse, ref_out, ref_lse, dtype):
    """out/lse of the kernel against a float64 reference state; -inf rows must match exactly."""
    tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    out, lse = out.cpu().double(), lse.cpu().double()
    ref_out, ref_lse = ref_out.cpu(), ref_lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol * max(1.0, ref_out.abs().max().item()))


# ---------------------------------------------------------------- contiguous KV


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Sk", [1, 37, 300])
@pytest.mark.parametrize("heads", list(HEADS))
def test_matches_reference(heads, Sk, dtype):
    """Every head layout x key count x dtype, with one and three queries, plain and causal."""
    Hq, Hkv = HEADS[heads]
    for Sq, causal in ((1, False), (3, True)):
        q, k, v = make_qkv(Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, dtype=dtype, seed=Sk)
        out, lse = td.decode_attention(q, k, v, causal=causal, num_splits=3)
        assert_state_close(out, lse, *reference_attention(q, k, v, causal=causal), dtype)


@pytest.mark.parametrize("heads,dtype", [("MHA", torch.float32), ("GQA", torch.bfloat16), ("MQA", torch.float16)])
def test_sixteen_queries(heads, dtype):
    """Sq = 16 (rows = group x 16 up to 64): plain, causal (bottom-right) and two batches."""
    Hq, Hkv = HEADS[heads]
    q, k, v = make_qkv(B=2, Sq=16, Sk=37, Hq=Hq, Hkv=Hkv, dtype=dtype)
    for causal in (False, True):
        out, lse = td.decode_attention(q, k, v, causal=causal, num_splits=2)
        assert_state_close(out, lse, *reference_attention(q, k, v, causal=causal), dtype)


def test_row_blocks_beyond_one_program():
    """MQA with 32 query heads x 3 queries = 96 rows: two row blocks share each K/V head."""
    q, k, v = make_qkv(Sq=3, Sk=40, Hq=32, Hkv=1)
    assert_state_close(*td.decode_attention(q, k, v, causal=True), *reference_attention(q, k, v, causal=True), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 1000])
def test_split_count_does_not_change_result(num_splits):
    """One split, several (the last ones short or empty under the mask), and more than tiles."""
    q, k, v = make_qkv(Sq=2, Sk=300, seed=3)
    q_pos = torch.tensor([40, 41], device=DEVICE)  # keys past 41 are masked: later splits see nothing
    out, lse = td.decode_attention(q, k, v, causal=True, q_pos=q_pos, num_splits=num_splits)
    assert_state_close(out, lse, *reference_attention(q, k, v, causal=True, q_pos=q_pos), torch.float32)


@pytest.mark.parametrize("num_splits", [0, -2, 1.5, True])
def test_bad_num_splits_is_rejected(num_splits):
    q, k, v = make_qkv(Sk=20)
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        td.decode_attention(q, k, v, num_splits=num_splits)


def test_masks_with_positions_and_window():
    """Per-batch shuffled kv_pos, explicit q_pos, a window; rows that see nothing give (0, -inf)."""
    B, Sq, Sk = 2, 3, 50
    q, k, v = make_qkv(B=B, Sq=Sq, Sk=Sk, seed=5)
    g = torch.Generator().manual_seed(1)
    kv_pos = torch.stack([torch.randperm(Sk, generator=g) + 10 for _ in range(B)]).to(DEVICE)
    q_pos = torch.tensor([[5, 30, 59], [12, 40, 200]], device=DEVICE)  # 5: before every key; 200: past the window
    for window in (None, 8):
        out, lse = td.decode_attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos, window=window, num_splits=3)
        ref = reference_attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos, window=window)
        assert_state_close(out, lse, *ref, torch.float32)
        assert torch.isneginf(lse[0, :, 0]).all() and (out[0, 0] == 0).all()
    assert torch.isneginf(lse[1, :, 2]).all() and (out[1, 2] == 0).all()  # window 8 leaves nothing at 200


def test_window_without_causal_is_refused():
    """A window is a causal sliding window (as in ta.attention): without causal=True it is refused."""
    q, k, v = make_qkv(Sq=2, Sk=60, seed=6)
    with pytest.raises(ValueError, match="window=5 needs causal=True"):
        td.decode_attention(q, k, v, window=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softcap_matches_reference(dtype):
    """Gemma 2 logit capping (c * tanh(s / c)) inside the kernel, with positions and a window, and
    through ta.attention's dispatch; huge scores saturate at +-c instead of overflowing."""
    for logit_scale in (3.0, 300.0):
        q, k, v = make_qkv(B=2, Sq=3, Sk=70, dtype=dtype, seed=10, logit_scale=logit_scale)
        q_pos, kv_pos = torch.tensor([40, 60, 69], device=DEVICE), torch.arange(70, device=DEVICE)
        kwargs = dict(causal=True, q_pos=q_pos, kv_pos=kv_pos, window=30, softcap=2.5)
        ref = reference_attention(q, k, v, **kwargs)
        assert_state_close(*td.decode_attention(q, k, v, num_splits=3, **kwargs), *ref, dtype)
        out, lse = td.try_decode_attention(q, k, v, scale=16 ** -0.5, causal=True, q_pos=q_pos[None], kv_pos=kv_pos[None],
                                           window=30, softcap=2.5)
        assert_state_close(out, lse, *ref, dtype)


def test_value_dim_differs_and_scale():
    q, k, v = make_qkv(Sq=2, Sk=45, D=32, Dv=16, seed=7)
    out, lse = td.decode_attention(q, k, v, scale=0.3)
    assert_state_close(out, lse, *reference_attention(q, k, v, scale=0.3), torch.float32)


def test_strided_inputs_are_read_in_place():
    """K/V as views with permuted and padded strides, q with a padded head dim: no copies needed."""
    B, Sq, Sk, Hq, Hkv, D = 2, 2, 70, 4, 2, 16
    g = torch.Generator().manual_seed(8)
    k_store = torch.randn(B, Hkv, Sk + 5, D + 16, generator=g).to(DEVICE)  # (B, Hkv, S, D) layout, padded
    v_store = torch.randn(Sk, B, Hkv, D, generator=g).to(DEVICE)
    q_store = torch.randn(B, Sq, Hq, 2 * D, generator=g).to(DEVICE)
    k = k_store[:, :, 3 : 3 + Sk, :D].transpose(1, 2)
    v = v_store.permute(1, 0, 2, 3)
    q = q_store[..., ::2]
    assert not (k.is_contiguous() or v.is_contiguous() or q.is_contiguous())
    out, lse = td.decode_attention(q, k, v, causal=True, num_splits=2)
    assert_state_close(out, lse, *reference_attention(q, k, v, causal=True), torch.float32)


def test_huge_and_tiny_logits():
    """Scores of +-1e3 (exp would overflow without the running max) stay finite and exact."""
    q, k, v = make_qkv(Sq=2, Sk=100, seed=9, logit_scale=300.0)
    out, lse = td.decode_attention(q, k, v, num_splits=4)
    assert torch.isfinite(lse).all()
    assert_state_close(out, lse, *reference_attention(q, k, v), torch.float32)
    out, lse = td.decode_attention(q * 1e-6, k, v, num_splits=4)
    assert_state_close(out, lse, *reference_attention(q * 1e-6, k, v), torch.float32)


def test_empty_kv_and_empty_queries_launch_nothing(monkeypatch):
    monkeypatch.setattr(td, "_split_kv_kernel", None)  # any launch would fail
    q, k, v = make_qkv(B=2, Sq=3, Sk=0)
    out, lse = td.decode_attention(q, k, v, causal=True)
    assert out.shape == (2, 3, 4, 16) and (out == 0).all() and torch.isneginf(lse).all()
    q, k, v = make_qkv(Sq=0, Sk=5)
    out, lse = td.decode_attention(q, k, v)
    assert out.shape == (1, 0, 4, 16) and lse.shape == (1, 4, 0)


# ---------------------------------------------------------------- merge kernel


@pytest.mark.parametrize("n", [1, 5, 40])
def test_merge_kernel_equals_merge_states_list(n):
    """The Triton reduction against ta.merge_states_list on the same states, -inf entries included."""
    B, Sq, Hq, Dv = 2, 3, 4, 16
    g = torch.Generator().manual_seed(n)
    part_out = torch.randn(n, B, Sq, Hq, Dv, generator=g)
    part_lse = torch.randn(n, B, Hq, Sq, generator=g) * 20
    part_lse[torch.rand(part_lse.shape, generator=g) < 0.3] = float("-inf")
    part_lse[:, 0, 1, 2] = float("-inf")  # one row with no key in any state
    part_out[torch.isneginf(part_lse).permute(0, 1, 3, 2)] = 0.0
    part_out, part_lse = part_out.to(DEVICE), part_lse.to(DEVICE)
    out, lse = td.merge_split_states(part_out, part_lse, torch.float32)
    ref_out, ref_lse = merge_states_list(list(part_out), list(part_lse))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert (out[0, 2, 1] == 0).all()
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- paged KV


def make_paged(k, v, seq_lens, block_size, extra_blocks=3, seed=0):
    """Scatter contiguous (B, L, Hkv, D) K/V into a shuffled pool; unused table entries are -1."""
    B, L = k.shape[:2]
    max_blocks = -(-L // block_size)
    used = [-(-int(n) // block_size) for n in seq_lens]
    num_blocks = sum(used) + extra_blocks
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_pool = torch.randn(num_blocks, block_size, *k.shape[2:], generator=g).to(k.dtype).to(k.device)
    v_pool = torch.randn(num_blocks, block_size, *v.shape[2:], generator=g).to(v.dtype).to(v.device)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    for b in range(B):
        for j in range(used[b]):
            block = order.pop()
            table[b, j] = block
            rows = slice(j * block_size, min((j + 1) * block_size, int(seq_lens[b])))
            count = rows.stop - rows.start
            k_pool[block, :count] = k[b, rows]
            v_pool[block, :count] = v[b, rows]
    return k_pool, v_pool, table.to(k.device)


def paged_reference(q, k, v, seq_lens, **kwargs):
    """Per-sequence reference on the first seq_lens[b] keys (positions sliced alike)."""
    outs, lses = [], []
    for b, n in enumerate(seq_lens):
        per_b = {}
        for name in ("q_pos", "kv_pos"):
            pos = kwargs.get(name)
            if pos is not None:
                pos = pos[b : b + 1] if pos.dim() == 2 else pos.unsqueeze(0)
                per_b[name] = pos[:, :n] if name == "kv_pos" else pos
        rest = {key: val for key, val in kwargs.items() if key not in ("q_pos", "kv_pos")}
        out, lse = reference_attention(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], **rest, **per_b)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_matches_reference(dtype):
    """Shuffled block table, uneven lengths (0 included), tiles crossing blocks, causal."""
    B, Sq, L, block_size = 3, 2, 100, 16
    q, k, v = make_qkv(B=B, Sq=Sq, Sk=L, Hq=4, Hkv=2, dtype=dtype, seed=11)
    seq_lens = [37, 0, 100]
    k_pool, v_pool, table = make_paged(k, v, seq_lens, block_size)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    for causal in (False, True):
        out, lse = td.paged_decode_attention(q, k_pool, v_pool, table, lens, causal=causal, num_splits=3)
        assert_state_close(out, lse, *paged_reference(q, k, v, seq_lens, causal=causal), dtype)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()


def test_paged_with_positions_and_window():
    B, Sq, L, block_size = 2, 3, 64, 8
    q, k, v = make_qkv(B=B, Sq=Sq, Sk=L, Hq=8, Hkv=2, seed=12)
    seq_lens = [50, 64]
    k_pool, v_pool, table = make_paged(k, v, seq_lens, block_size, seed=4)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)
    g = torch.Generator().manual_seed(2)
    kv_pos = torch.stack([torch.randperm(L, generator=g) for _ in range(B)]).to(DEVICE)
    q_pos = torch.tensor([[10, 20, 63], [0, 31, 62]], device=DEVICE)
    out, lse = td.paged_decode_attention(q, k_pool, v_pool, table, lens, causal=True, q_pos=q_pos, kv_pos=kv_pos, window=16)
    ref = paged_reference(q, k, v, seq_lens, causal=True, q_pos=q_pos, kv_pos=kv_pos, window=16)
    assert_state_close(out, lse, *ref, torch.float32)


def test_paged_bad_inputs_name_the_argument():
    q, k, v = make_qkv(B=2, Sk=32)
    k_pool, v_pool, table = make_paged(k, v, [32, 32], 16)
    lens = torch.tensor([32, 32], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="block_table must be int32"):
        td.paged_decode_attention(q, k_pool, v_pool, table.long(), lens)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(2,\)"):
        td.paged_decode_attention(q, k_pool, v_pool, table, lens[:1])
    with pytest.raises(ValueError, match="k_pool"):
        td.paged_decode_attention(q, k_pool[..., :8], v_pool, table, lens)
    with pytest.raises(ValueError, match=r"block_table must have shape \(2, max_blocks\)"):
        td.paged_decode_attention(q, k_pool, v_pool, table[:1], lens)


# ---------------------------------------------------------------- fallback and errors


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(dtype=torch.float64), "dtype torch.float64"),
        (dict(D=24), "head dims D=24"),
        (dict(D=512), "head dims D=512"),
        (dict(D=8), "head dims D=8"),
        (dict(Sq=17), "Sq=17 queries"),
    ],
)
def test_unsupported_inputs_fall_back_with_a_reason(kwargs, reason, caplog):
    q, k, v = make_qkv(Sk=5, **kwargs)
    assert reason in td.unsupported_reason(q, k, v)
    with pytest.raises(ValueError, match="does not take " + reason):
        td.decode_attention(q, k, v)
    td._logged_reasons.clear()
    with caplog.at_level(logging.INFO, logger="treeattn.ops.triton_decode"):
        assert td.try_decode_attention(q, k, v, scale=0.25, causal=False, q_pos=None, kv_pos=None, window=None) is None
    assert reason in caplog.text and "generic path" in caplog.text


def test_launch_error_names_the_shapes(monkeypatch):
    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("out of resources")

            return launch

    monkeypatch.setattr(td, "_split_kv_kernel", Broken())
    q, k, v = make_qkv(Sq=2, Sk=20)
    with pytest.raises(RuntimeError, match=r"q \(1, 2, 4, 16\) torch.float32 .*k \(1, 20, 2, 16\).*out of resources"):
        td.decode_attention(q, k, v)


def test_attention_on_cpu_uses_the_generic_path(monkeypatch):
    """ta.attention dispatches only CUDA tensors; CPU results come from the generic path."""
    calls = []
    monkeypatch.setattr(td, "try_decode_attention", lambda *a, **kw: calls.append(1))
    q, k, v = make_qkv(device="cpu")
    ta.attention(q, k, v)
    assert calls == []


# ---------------------------------------------------------------- compiled for real GPUs

_NVIDIA_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
_BENCHMARK = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "kernels", "gpu_decode.py")


@pytest.mark.skipif(not os.path.exists(_NVIDIA_TOOLS), reason="triton wheel without the NVIDIA tools")
def test_kernels_compile_for_nvidia_without_spills(tmp_path):
    """bf16, Hq=32, Hkv=8, D=128 compiled offline for sm_80 and sm_90 (decode, 16 queries, paged, paged
    over an fp8 cache): K/V loads are pipelined and nothing spills. A subprocess, because the
    interpreter mode this module turns on must be off when triton is imported for compilation."""
    report_file = tmp_path / "compile.json"
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, _BENCHMARK, "--compile-only", "--quick", "--arch", "80", "90", "--out", str(report_file)],
                   env=env, check=True, capture_output=True, timeout=300)
    report = json.loads(report_file.read_text())["compile_report"]
    assert len(report) == 8 and sum(entry["fp8_kv"] for entry in report) == 2
    for entry in report:
        assert entry["spill_stack_bytes"] == 0 and entry["local_bytes"] == 0, entry
        assert entry["pipelined_loads"], entry
        assert entry["shared_bytes"] <= 100 * 1024, entry


# ---------------------------------------------------------------- real shapes on a GPU


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("Sq", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_real_shapes(Sq, dtype):
    """B=1, Hq=32, Hkv=8, D=128 over 70001 keys; causal with positions; default num_splits."""
    q, k, v = make_qkv(Sq=Sq, Sk=70_001, Hq=32, Hkv=8, D=128, dtype=dtype, device="cuda")
    out, lse = td.decode_attention(q, k, v)
    assert_state_close(out, lse, *reference_attention(q, k, v), dtype)
    q_pos = torch.arange(Sq, device="cuda") + 50_000
    out, lse = td.decode_attention(q, k, v, causal=True, q_pos=q_pos, window=30_000)
    assert_state_close(out, lse, *reference_attention(q, k, v, causal=True, q_pos=q_pos, window=30_000), dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_paged_real_shapes(block_size):
    B, Sq, L = 2, 1, 40_000
    q, k, v = make_qkv(B=B, Sq=Sq, Sk=L, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, device="cuda")
    seq_lens = [33_333, 40_000]
    k_pool, v_pool, table = make_paged(k, v, seq_lens, block_size)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out, lse = td.paged_decode_attention(q, k_pool, v_pool, table, lens, causal=True)
    assert_state_close(out, lse, *paged_reference(q, k, v, seq_lens, causal=True), torch.bfloat16)


@pytest.mark.gpu
@gpu
def test_gpu_attention_dispatches_to_the_kernel(monkeypatch):
    """ta.attention on CUDA uses the kernel for decode shapes and the generic path otherwise."""
    calls = []
    real = td._decode
    monkeypatch.setattr(td, "_decode", lambda *a: calls.append(1) or real(*a))
    q, k, v = make_qkv(Sq=2, Sk=5000, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, device="cuda")
    assert_state_close(*ta.attention(q, k, v, causal=True), *reference_attention(q, k, v, causal=True), torch.bfloat16)
    assert calls == [1]
    q17 = make_qkv(Sq=17, Sk=5000, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, device="cuda")[0]
    ta.attention(q17, k, v, causal=True)
    assert calls == [1]


@pytest.mark.gpu
@gpu
def test_gpu_decode_step_is_graph_capturable():
    """Paged decode replayed from a CUDA graph after seq_lens changes on the device."""
    q, k, v = make_qkv(Sq=1, Sk=4096, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, device="cuda")
    k_pool, v_pool, table = make_paged(k, v, [4096], 16, extra_blocks=0)
    lens = torch.tensor([1000], dtype=torch.int32, device="cuda")
    td.paged_decode_attention(q, k_pool, v_pool, table, lens)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = td.paged_decode_attention(q, k_pool, v_pool, table, lens)
    lens.fill_(3000)
    graph.replay()
    torch.cuda.synchronize()
    assert_state_close(out, lse, *paged_reference(q, k, v, [3000]), torch.bfloat16)
