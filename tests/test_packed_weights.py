"""Weights kept as a GGUF file ships them (weight_format="packed"): q4_0, q4_1 and q8_0 blocks.

The packed layers must multiply by exactly the file's weights: the blocks unpacked and dequantized
equal gguf.quants.dequantize bit for bit, and packed_matmul (the numba kernel for <= 16 rows, the
dequantize-then-matmul path above) equals float64 x @ W within the error bound of a float32 dot
product of length K (any summation order): |err| <= gamma_K * sum_k |x_k| |w_k|, gamma_K = K u / (1 - K u),
u = 2**-24 (the products w are exact float32 values; one more rounding for a bias: gamma_{K+1}).
A model loaded packed holds the dequantized model's weights exactly and gives its greedy tokens, on
one rank and on two; what cannot be kept is refused in one line naming weight_format.
"""

from __future__ import annotations

import json

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf_files import VOCAB, write_gguf  # noqa: E402
from helpers.gguf_models import hf_model  # noqa: E402
from helpers.packed import assert_within_float32_bound, gamma, weights  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.cli import app  # noqa: E402
from treeattn.engine.checks import check_weight_format  # noqa: E402
from treeattn.engine.config import EngineConfig  # noqa: E402
from treeattn.engine.errors import ConfigError  # noqa: E402
from treeattn.models import load_model  # noqa: E402
from treeattn.models.gguf import open_gguf, packed_tensors  # noqa: E402
from treeattn.models.packed import PackedEmbedding, PackedLinear, is_packed, weight_bytes  # noqa: E402
from treeattn.ops import packed_linear  # noqa: E402
from treeattn.ops.packed_linear import dequantize_packed, kernel_module, packed_matmul, unpack_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
FORMATS = [("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1), ("q8_0", Q.Q8_0)]
@pytest.mark.parametrize("fmt,qtype", FORMATS)
def test_unpacked_blocks_dequantize_to_exactly_the_files_values(fmt, qtype):
    raw = gguf.quants.quantize(weights(37, 96, 0), qtype)
    qs, d, m = unpack_blocks(fmt, raw)
    expected = gguf.quants.dequantize(raw, qtype).reshape(37, 96)
    assert np.array_equal(dequantize_packed(fmt, qs, d, m).numpy(), expected)
    assert qs.dtype == (torch.int8 if fmt == "q8_0" else torch.uint8) and d.dtype == torch.float32
    with pytest.raises(ValueError, match="raw must be uint8"):
        unpack_blocks(fmt, raw[:, :-1])


def float16_bytes(g: np.random.Generator, n: int) -> np.ndarray:
    """n random float16 scales spread over 2**-14 .. 2**2, as the (n, 2) bytes a block stores."""
    return (g.uniform(0.5, 1.0, n) * 2.0 ** g.integers(-14, 3, n)).astype(np.float16).view(np.uint8).reshape(-1, 2)


def q4_k_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K super-blocks (gguf-py has no Q4_K quantizer): random 6-bit scales, minimums and 4-bit
    values, float16 d and dmin spread over 2**-14 .. 2**2, some zero (a row that is all zeros, one of
    only offsets)."""
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (rows, cols // 256 * 144), dtype=np.uint8)
    blocks = raw.reshape(-1, 144)
    for col in (0, 2):  # d, dmin
        blocks[:, col : col + 2] = float16_bytes(g, len(blocks))
    raw[0, 0:4] = 0  # d = dmin = 0 in the first row's first super-block
    raw[1, 0:2] = 0  # d = 0: only the offsets
    return raw


def assert_kept_exactly(convert, raw: np.ndarray, qtype, fmt: str, seed: int):
    """convert(raw) -> (qs, d, m) of `fmt` whose dequantization is gguf's for `qtype` bit for bit, whose
    product with x is within the float32 bound, and which refuses a cut row. Returns (qs, d, m)."""
    qs, d, m = convert(raw)
    expected = gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], -1)
    assert np.array_equal(dequantize_packed(fmt, qs, d, m).numpy(), expected)
    x = torch.randn(3, expected.shape[1], generator=torch.Generator().manual_seed(seed))
    assert_within_float32_bound(packed_matmul(x, fmt, qs, d, m), x, expected)
    with pytest.raises(ValueError, match="raw must be uint8"):
        convert(raw[:, :-1])
    return qs, d, m


def test_q6_k_widened_to_int16_q8_0_blocks_dequantizes_to_exactly_the_files_values():
    """Random Q6_K super-blocks (gguf-py has no Q6_K quantizer): random 6-bit values and int8 scales (-128 and
    127 included), float16 d over 2**-14 .. 2**2; the int16 values sc * (q - 32) times d are gguf's weights."""
    g = np.random.default_rng(8)
    raw = g.integers(0, 256, (5, 512 // 256 * 210), dtype=np.uint8)
    blocks = raw.reshape(-1, 210)
    blocks[:, 208:210] = float16_bytes(g, len(blocks))
    blocks[0, 192:194] = np.array([-128, 127], dtype=np.int8).view(np.uint8)
    qs, d, m = assert_kept_exactly(packed_linear.q6_k_as_q8_0, raw, Q.Q6_K, "q8_0", seed=2)
    assert qs.shape == (5, 16, 32) and qs.dtype == torch.int16 and m is None


def test_q5_0_widened_to_q8_0_blocks_dequantizes_to_exactly_the_files_values():
    raw = gguf.quants.quantize(weights(37, 96, 6), Q.Q5_0)
    qs, d, m = packed_linear.q5_0_as_q8_0(raw)
    assert qs.shape == (37, 3, 32) and qs.dtype == torch.int8 and m is None and int(qs.min()) >= -16 and int(qs.max()) <= 15
    assert np.array_equal(dequantize_packed("q8_0", qs, d, m).numpy(), gguf.quants.dequantize(raw, Q.Q5_0).reshape(37, 96))
    with pytest.raises(ValueError, match="raw must be uint8"):
        packed_linear.q5_0_as_q8_0(raw[:, :-1])


def test_q4_k_regrouped_as_q4_1_blocks_dequantizes_to_exactly_the_files_values():
    raw = q4_k_rows(5, 768, 7)
    qs, d, m = assert_kept_exactly(packed_linear.q4_k_as_q4_1, raw, Q.Q4_K, "q4_1", seed=1)
    assert qs.shape == (5, 24, 16) and qs.dtype == torch.uint8 and d.shape == m.shape == (5, 24)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt,qtype", FORMATS)
def test_packed_matmul_is_x_times_the_files_weights_within_float32_accumulation(fmt, qtype, threads, monkeypatch):
    assert kernel_module() is not None  # numba is a dependency: rows <= 16 run the kernel
    monkeypatch.setattr(packed_linear, "PARALLEL_MIN_WEIGHTS", 0)  # this small weight on the parallel kernel too
    N, K = 53, 160
    raw = gguf.quants.quantize(weights(N, K, 1), qtype)
    qs, d, m = unpack_blocks(fmt, raw)
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(N, K)).double()
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3, 16, 17, 40):  # 17 and 40: the dequantize-then-matmul path
            x = torch.randn(2, rows, K, generator=torch.Generator().manual_seed(rows))[:1]  # a leading dim of 1
            x[0, 0, :5] *= 1e4
            for b in (None, bias):
                y = packed_matmul(x, fmt, qs, d, m, b)
                ref = x.double() @ w.T + (0 if b is None else b.double())
                bound = gamma(K + 1) * (x.double().abs() @ w.abs().T + (0 if b is None else b.double().abs()))
                assert y.shape == (1, rows, N) and y.dtype == torch.float32
                assert bool(((y.double() - ref).abs() <= bound).all()), (rows, float(((y.double() - ref).abs() / bound).max()))
    finally:
        torch.set_num_threads(before)
    x16 = torch.randn(2, K).to(torch.bfloat16)  # a bfloat16 model's activations: exact in float32, the result rounded once
    y16 = packed_matmul(x16, fmt, qs, d, m)
    ref = x16.double() @ w.T
    assert y16.dtype == torch.bfloat16
    assert bool(((y16.double() - ref).abs() <= gamma(K) * (x16.double().abs() @ w.abs().T) + 2.0 ** -8 * ref.abs()).all())
    with pytest.raises(ValueError, match=f"x must have {K} features"):
        packed_matmul(torch.zeros(1, K + 32), fmt, qs, d, m)


def test_small_weights_run_on_one_thread_large_ones_on_torchs(monkeypatch):
    kernel, calls = kernel_module(), []
    real = kernel.matmul
    monkeypatch.setattr(kernel, "matmul", lambda threads, *args: (calls.append(threads), real(threads, *args)))
    raw = gguf.quants.quantize(weights(64, 128, 3), Q.Q8_0)
    qs, d, m = unpack_blocks("q8_0", raw)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(1, 128)
        small = packed_matmul(x, "q8_0", qs, d, m)
        monkeypatch.setattr(packed_linear, "PARALLEL_MIN_WEIGHTS", 64 * 128)  # this weight counts as large now
        large = packed_matmul(x, "q8_0", qs, d, m)
    finally:
        torch.set_num_threads(before)
    assert calls == [1, 2]
    w = dequantize_packed("q8_0", qs, d, m).numpy()  # the same dot products in two compiled loops: float32's bound, on any host
    assert_within_float32_bound(small, x, w)
    assert_within_float32_bound(large, x, w)


def test_packed_layers_follow_replaced_buffers_and_pickle():
    import pickle

    raw = gguf.quants.quantize(weights(40, 64, 4), Q.Q4_1)
    layer = PackedLinear("q4_1", *unpack_blocks("q4_1", raw))
    x = torch.randn(2, 64)
    y = layer(x)
    assert torch.equal(pickle.loads(pickle.dumps(layer))(x), y)
    other = gguf.quants.quantize(weights(40, 64, 5), Q.Q4_1)
    qs, d, m = unpack_blocks("q4_1", other)
    layer.qs, layer.d_bits, layer.m_bits = qs, d.view(torch.int32), m.view(torch.int32)  # what load_state_dict or .to() do
    assert torch.equal(layer(x), PackedLinear("q4_1", qs, d, m)(x)) and not torch.equal(layer(x), y)
    arrays = layer._cached()[4]  # the kernel's numpy views, made once per set of buffers: of the new ones
    assert [a.ctypes.data for a in arrays] == [qs.data_ptr(), d.data_ptr(), m.data_ptr()] and layer._cached()[4] is arrays


@pytest.mark.parametrize("fmt, qtype", FORMATS)
def test_a_projection_over_some_rows_gives_exactly_those_columns(fmt, qtype):
    """_Packed.project(x, rows): what each rank computes of a vocabulary-split output projection: those
    columns of the float32 product, within its rounding bound. Not compared bit for bit with the full
    product's columns: the kernel runs groups of ROWS weight rows and single rows through loops that
    LLVM compiles for the host (fastmath: reassociated, contracted to FMA where the CPU has it), so a
    row computed in a group here and alone there may round differently on another host (issue 46)."""
    raw = gguf.quants.quantize(weights(45, 64, 6), qtype)
    table = PackedEmbedding(fmt, *unpack_blocks(fmt, raw))
    w = table.dequantized().numpy()
    x = torch.randn(3, 64)
    assert_within_float32_bound(table.project(x), x, w)
    for rows in (slice(0, 23), slice(23, 46), slice(40, 45), slice(45, 50)):
        assert_within_float32_bound(table.project(x, rows), x, w[rows])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny GGUF files: llama (untied, permuted Q/K) in each packed format, qwen2 (tied, q/k/v bias) in Q8_0,
    llama with one matrix in Q5_1 (no packed kernel), and llama in Q5_0 (kept as q8_0 blocks)."""
    root = tmp_path_factory.mktemp("packed")
    models = {arch: hf_model(arch) for arch in ("llama", "qwen2")}
    paths = {}
    for fmt, qtype in FORMATS:
        paths[fmt] = root / f"llama.{fmt}.gguf"
        write_gguf(paths[fmt], models["llama"], qtype)
    paths["qwen2"] = root / "qwen2.q8_0.gguf"
    write_gguf(paths["qwen2"], models["qwen2"], Q.Q8_0, arch="qwen2")
    paths["q5_1"] = root / "llama.mixed.gguf"
    write_gguf(paths["q5_1"], models["llama"], Q.Q4_1, raw_types={"blk.1.ffn_down.weight": Q.Q5_1})
    paths["q5_0"] = root / "llama.q5_0.gguf"
    write_gguf(paths["q5_0"], models["llama"], Q.Q5_0)
    return paths


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0", "qwen2", "q5_0"])
def test_a_packed_model_holds_exactly_the_dequantized_models_weights(files, name):
    dense = load_model(files[name])
    packed = load_model(files[name], weight_format="packed")
    layers = {n: m for n, m in packed.named_modules() if isinstance(m, (PackedLinear, PackedEmbedding))}
    assert len(layers) == 1 + 2 * 7 + (packed.lm_head is not None)  # embeddings, 7 matrices a layer, the output projection
    for n, layer in layers.items():
        assert torch.equal(layer.dequantized(), dense.get_submodule(n).weight), n  # Q/K rows unpermuted alike
        if isinstance(layer, PackedLinear) and layer.bias is not None:
            assert torch.equal(layer.bias, dense.get_submodule(n).bias), n
    assert is_packed(packed) and not is_packed(dense)
    assert weight_bytes(packed) < weight_bytes(dense) / 2.5  # 4.75 to 9 bits a weight, not 32 (norms stay float32)
    packed.to(torch.bfloat16)  # the activations' dtype; the blocks and scales are integer buffers: untouched
    assert torch.equal(layers["embed_tokens"].dequantized(), dense.embed_tokens.weight) and packed.dtype == torch.bfloat16


def test_packed_buffers_are_made_on_the_models_device(files, monkeypatch):
    """The packed layers' blocks and scales go to `device` with the rest (an H200 run found them left on the
    CPU: the CUDA embedding lookup failed). Run on the meta device, taken as the CPU is for packing."""
    from treeattn.models import gguf as gguf_module

    monkeypatch.setattr(gguf_module, "packed_tensors", lambda plan, fmt, device, path: packed_tensors(plan, fmt, "cpu", path))
    model = gguf_module.load_gguf_model(files["q4_1"], device="meta", weight_format="packed")
    tensors = dict(model.named_buffers()) | dict(model.named_parameters())
    assert any(n.endswith("m_bits") for n in tensors)
    assert {n: t.device.type for n, t in tensors.items() if t.device.type != "meta"} == {}


def test_greedy_tokens_equal_the_dequantized_models_on_one_and_two_ranks(files):
    prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    options = dict(max_new_tokens=8, ignore_eos=True, block_size=16)
    dense = {}
    for name in ("q4_1", "qwen2"):
        dense[name] = ta.generate(files[name], prompt, weight_format="dequantize", **options)
        chosen = {"weight_format": "packed"} if name == "q4_1" else {}  # qwen2: the default, "auto", packs on the CPU
        packed = ta.generate(files[name], prompt, **chosen, **options)
        assert packed.generated_ids == dense[name].generated_ids, name
        assert packed.weight_format == "packed" and dense[name].weight_format == "dequantize"
        assert 0 < packed.setup_s < packed.prefill_s  # the engine's construction is a part of the time to the first token
        assert (
            0 < packed.weight_bytes_per_rank[0] < dense[name].weight_bytes_per_rank[0] and len(packed.weight_bytes_per_rank) == 1
        )
    with ta.Engine(files["q4_1"], nproc=2, weight_format="packed", block_size=16, max_batch_size=2) as engine:
        two = engine.generate(prompt, max_new_tokens=8, ignore_eos=True)[0].token_ids  # every rank holds the packed weights
    assert two == dense["q4_1"].generated_ids[0]


def test_what_cannot_be_kept_packed_is_refused_in_one_line(files, tmp_path):
    with pytest.raises(ValueError,
                       match=r"weight_format='packed' keeps Q4_0, Q4_1, Q8_0, Q4_K, Q5_0 and Q6_K matrices; .* in Q5_1"):
        load_model(files["q5_1"], weight_format="packed")
    mixed = load_model(files["q5_1"], weight_format="auto")  # auto: what a kernel reads packed, the rest dequantized
    assert isinstance(mixed.layers[0].mlp.down_proj, PackedLinear) and isinstance(mixed.layers[1].mlp.down_proj, torch.nn.Linear)
    with pytest.raises(ConfigError, match="weight_format='packed' keeps .* Q5_1") as info:
        check_weight_format(str(files["q5_1"]), EngineConfig(weight_format="packed", device="cpu"))
    assert info.value.option == "weight_format" and "\n" not in str(info.value)
    tensors = {t.name: t for t in open_gguf(files["q4_1"]).tensors}
    with pytest.raises(ValueError,
                       match="weight_format='packed' runs on the CPU .* and on CUDA with triton installed .*, got device 'mps'"):
        packed_tensors(tensors, "packed", "mps", files["q4_1"])
    assert packed_tensors(tensors, "packed", "cuda", files["q4_1"])  # CUDA: the Triton kernel (tests/test_packed_triton.py)
    assert packed_tensors(tensors, "auto", "cuda", files["q4_1"]) == set()  # auto on a GPU: dequantized
    with pytest.raises(ConfigError, match="not a .gguf file"):
        check_weight_format(str(tmp_path), EngineConfig(weight_format="packed", device="cpu"))
    with pytest.raises(ConfigError, match="weight_format must be one of"):
        EngineConfig(weight_format="int4")
    with pytest.raises(ConfigError, match="the loaded model's weights are dequantized"):
        ta.generate(load_model(files["q4_1"]), [5, 6], max_new_tokens=1, weight_format="packed")


def test_cli_reports_weight_bytes_per_rank_and_the_format(files, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([5, 9, 14, 3, 7]))
    reports = {}
    for fmt in ("packed", "dequantize"):
        result = CliRunner().invoke(app, ["generate", str(files["q8_0"]), "--prompt-ids", str(ids), "--max-new-tokens", "4",
                                          "--weight-format", fmt, "--json"])
        assert result.exit_code == 0, result.output
        reports[fmt] = json.loads(result.stdout)
    assert reports["packed"]["weight_format"] == "packed" and reports["dequantize"]["weight_format"] == "dequantize"
    assert reports["packed"]["prefill_dtype"] == "float32" and reports["dequantize"]["prefill_dtype"] is None
    assert 0 < reports["packed"]["weight_bytes_per_rank"][0] < reports["dequantize"]["weight_bytes_per_rank"][0]
    assert reports["packed"]["generated_ids"] == reports["dequantize"]["generated_ids"]
    result = CliRunner().invoke(app, ["generate", str(files["q8_0"]), "--prompt-ids", str(ids), "--weight-format", "int4"])
    assert result.exit_code == 2 and "--weight-format" in result.output


def test_bench_profile_takes_the_weight_format_and_kv_cache_dtype(files, tmp_path):
    out = {}
    for fmt in ("packed", "dequantize"):
        path = tmp_path / f"{fmt}.json"
        result = CliRunner().invoke(app, ["bench", "profile", str(files["q8_0"]), "-p", "1", "--context", "24",
                                          "--max-new-tokens", "4",
                                          "--warmup", "1", "--weight-format", fmt, "--kv-cache-dtype", "bfloat16", "-o",
                                          str(path)])
        assert result.exit_code == 0, result.output
        out[fmt] = json.loads(path.read_text())[0]
    assert out["packed"]["generated_ids"] == out["dequantize"]["generated_ids"] and len(out["packed"]["generated_ids"]) == 4
    result = CliRunner().invoke(app, ["bench", "profile", str(files["q8_0"]), "-p", "1", "--weight-format", "int4"])
    assert result.exit_code == 2 and "--weight-format" in result.output


def test_a_bfloat16_prefill_is_within_bfloat16_rounding_and_refused_where_the_cpu_lacks_it(files, monkeypatch):
    """prefill_dtype="bfloat16": prefill-sized calls multiply the weight and x rounded to bfloat16 (float32 accumulation),
    so the logits move by about bfloat16's unit (2**-8) relative; decode-sized calls stay exact. Refused in one line
    naming prefill_dtype where torch's CPU has no fast bfloat16."""
    from gemma3_files import ours_logits

    from treeattn.models.packed import set_prefill_dtype

    model = load_model(files["q4_1"], weight_format="packed")
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()  # 40 rows > MAX_KERNEL_ROWS
    exact = ours_logits(model, ids)
    decode = ours_logits(model, ids[:8])  # 8 rows: the kernel
    if packed_linear.fast_bf16():
        assert set_prefill_dtype(model, "bfloat16") == "bfloat16"
        rounded = ours_logits(model, ids)
        err = (rounded - exact).abs().max().item()
        assert 0 < err <= 0.05 * exact.abs().max().item()  # rounded, but by bfloat16's few units, not garbage
        assert torch.equal(ours_logits(model, ids[:8]), decode)
        set_prefill_dtype(model, "float32")
        assert torch.equal(ours_logits(model, ids), exact)
    with pytest.raises(ConfigError, match="prefill_dtype must be one of"):
        EngineConfig(prefill_dtype="float16")
    monkeypatch.setattr(packed_linear, "fast_bf16", lambda: False)
    with pytest.raises(ConfigError, match="prefill_dtype='bfloat16' needs torch's oneDNN with native bfloat16"):
        check_weight_format(model, EngineConfig(prefill_dtype="bfloat16"))


def test_float32_kernel_loops_are_512_bit_where_the_cpu_has_avx512():
    """issue 50 (session 20): LLVM's default for Intel's AVX-512 server CPUs is 256-bit loops; the packed float32 kernel asks
    for 512 (ymm only before, on an emeraldrapids host)."""
    kernel = packed_linear.kernel_module()
    if kernel is None:
        pytest.skip("numba is not installed")
    from llvmlite import binding

    if not binding.get_host_cpu_features().get("avx512f", False):
        pytest.skip("this CPU has no AVX-512F: its widest vectors are used, nothing to check")
    from numba import njit

    @njit  # compiled here, not loaded from the kernels' cache (whose entries carry no assembly to inspect)
    def rows(x, qs, d, m, out):
        kernel._q4_rows(x, qs, d, m, out, 0, qs.shape[0], 0, True)

    d = np.ones((8, 2), np.float32)
    rows(np.ones((1, 64), np.float32), np.zeros((8, 2, 16), np.uint8), d, d.copy(), np.zeros((1, 8), np.float32))
    assert "zmm" in rows.inspect_asm(rows.signatures[0])


def test_float32_kernel_loops_prefetch_the_blocks_ahead():
    """issue 50 (session 21): the float32 kernel asks for the weight blocks PREFETCH_BYTES ahead, as the int8 kernel does (an
    output projection larger than the caches waited for memory row by row without it); a hint only, no value changes."""
    kernel = packed_linear.kernel_module()
    if kernel is None:
        pytest.skip("numba is not installed")
    from numba import njit

    @njit(fastmath=kernel._FASTMATH)  # compiled here, not loaded from the kernels' cache (no assembly there)
    def rows8(x, qs, d, out):
        kernel._q8_rows(x, qs, d, out, 0, qs.shape[0])

    @njit(fastmath=kernel._FASTMATH)
    def rows4(x, qs, d, m, out):
        kernel._q4_rows(x, qs, d, m, out, 0, qs.shape[0], 0, True)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    d = rng.random((8, 2), dtype=np.float32)
    q8 = rng.integers(-127, 128, (8, 2, 32), dtype=np.int8)
    out = np.zeros((1, 8), np.float32)
    rows8(x, q8, d, out)
    w = d[:, :, None].astype(np.float64) * q8  # exact
    np.testing.assert_allclose(out[0], w.reshape(8, 64) @ x[0].astype(np.float64), rtol=1e-5, atol=1e-5)
    rows4(x, rng.integers(0, 256, (8, 2, 16), dtype=np.uint8), d, d.copy(), out)
    for f in (rows8, rows4):
        asm = f.inspect_asm(f.signatures[0])
        assert "prefetch" in asm or "prfm" in asm  # x86's prefetcht0, ARM's prfm
