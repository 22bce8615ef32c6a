"""No numba kernel is compiled (or loaded from numba's cache) inside an engine's first request.

Each case runs in fresh rank processes (ta.spawn), whose kernels start with no signature: the rank's
warm-up at engine start (treeattn.engine.worker.warmup, called by RankRunner) must leave every signature the
first generate then calls already present, so the set of signatures of every dispatcher of the
kernel modules is the same before and after it. The control runs the same ranks with the warm-up
turned off and sees the first generate add signatures: the check can fail.
"""

from __future__ import annotations

import doctest

import pytest
import torch

pytest.importorskip("numba")
transformers = pytest.importorskip("transformers")

from gguf_files import VOCAB, write_gguf  # noqa: E402
from helpers.gguf_models import hf_model  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.engine.worker import warmup as engine_warmup  # noqa: E402
from treeattn.ops import warmup as ops_warmup  # noqa: E402

KERNEL_MODULES = ("paged_cpu_kernel", "packed_cpu_kernel", "packed_int8_kernel", "combine_cpu_kernel", "rowwise_cpu_kernel",
                  "logits_cpu_kernel", "decode_layer_cpu")


def signatures() -> dict[str, list[str]]:
    """Every numba dispatcher of the kernel modules and the signatures it holds now."""
    import importlib

    from numba.core.registry import CPUDispatcher

    found = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"treeattn.ops.{name}")
        for attr, f in vars(module).items():
            if isinstance(f, CPUDispatcher):
                found[f"{name}.{attr}"] = sorted(str(s) for s in f.signatures)
    return found


def first_request(rank, world_size, path, warm, activation_format="auto", kv_cache_dtype="bfloat16", tp=None):
    """On every rank: ta.generate (an engine inside the group); (signatures right after the runner's
    warm-up, signatures after the first generate, the warm-up's lines)."""
    import treeattn.engine.worker.runner as runner

    seen = {}

    def warm_up_rank(*args, **kwargs):
        seen["warmed"] = engine_warmup.warm_up_rank(*args, **kwargs) if warm else []
        seen["start"] = signatures()
        return seen["warmed"]

    runner.warm_up_rank = warm_up_rank
    prompt = list(range(3, 23))
    ta.generate(path, prompt, max_new_tokens=4, ignore_eos=True, block_size=16, weight_format="packed",
                kv_cache_dtype=kv_cache_dtype, activation_format=activation_format, tp=tp)
    return seen["start"], signatures(), seen["warmed"]


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    import gguf

    path = tmp_path_factory.mktemp("warm") / "llama.q4_1.gguf"
    write_gguf(path, hf_model("llama"), gguf.GGMLQuantizationType.Q4_1)
    assert VOCAB > 0
    return str(path)


@pytest.mark.parametrize("world_size,tp", [(1, None), (2, None), (2, 1)], ids=["1", "2", "2-tp1"])
def test_the_first_request_after_engine_start_compiles_no_kernel(q4_1_file, world_size, tp):
    """tp=1 on 2 ranks: the Helix layout's compiled segments (HelixCompiledDecode) too."""
    runs = ta.spawn(first_request, world_size, q4_1_file, True, "auto", "bfloat16", tp)
    for rank, (start, after, warmed) in enumerate(runs):
        assert warmed and any(start.values()), rank  # the warm-up ran kernels
        assert after == start, (rank, {k: v for k, v in after.items() if v != start.get(k)})
        if world_size > 1:
            assert any("combine" in line for line in warmed), warmed


@pytest.mark.skipif(__import__("treeattn.ops.packed_linear", fromlist=["x"]).int8_module() is None,
                    reason="the int8 kernel needs AVX-512 VNNI/BW/VL; this CPU has not")
def test_the_int8_activation_path_is_warmed_too(q4_1_file):
    [(start, after, warmed)] = ta.spawn(first_request, 1, q4_1_file, True, "int8")
    assert any("packed int8 q4_1" in line for line in warmed), warmed
    assert after == start, {k: v for k, v in after.items() if v != start.get(k)}


def test_head_dim_64_kernels_are_warmed_in_the_models_head_shape(tmp_path):
    """Head dim 64 is compiled into the paged kernel (head_dim_tag), and with float16 blocks the heads
    too (score tiles, head_shape_tag): the warm-up calls it in the model's own head shape, so the first
    request compiles nothing (it did inside the first decode steps: SmolLM2's 2-rank 4K step measured
    113.5 ms against 27.4 on 1 rank in session 16's quiet run)."""
    import gguf

    from helpers.gguf_models import COMMON

    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1},
                                      tie_word_embeddings=False)
    path = tmp_path / "llama.hd64.gguf"
    write_gguf(path, transformers.LlamaForCausalLM(config).eval(), gguf.GGMLQuantizationType.Q4_1)
    [(start, after, warmed)] = ta.spawn(first_request, 1, str(path), True, "auto", "float16")
    assert any("heads=(1, 3, 64)" in line for line in warmed), warmed
    assert after == start, {k: v for k, v in after.items() if v != start.get(k)}


@pytest.mark.parametrize("activation_format", ["float32", "int8"])
def test_gemma3_decode_segments_are_warmed(tmp_path, activation_format):
    """A packed Gemma 3 decodes through its compiled segments (decode_layer_cpu.gemma_*, window_store): the rank's
    warm-up compiles them for the engine's activation format and cache dtype, so the first request compiles nothing."""
    from gemma3_files import hf_gemma3, write_gemma3_gguf

    from treeattn.ops.packed_linear import int8_module

    if activation_format == "int8" and int8_module() is None:
        pytest.skip("the int8 kernel needs AVX-512 VNNI/BW/VL; this CPU has not")
    path = tmp_path / "gemma3.gguf"
    write_gemma3_gguf(path, hf_gemma3())
    [(start, after, warmed)] = ta.spawn(first_request, 1, str(path), True, activation_format, "float16")
    assert any(line.startswith("gemma3 decode segments torch.float16") for line in warmed), warmed
    assert start["decode_layer_cpu.gemma_mlp_output"], start
    assert after == start, {k: v for k, v in after.items() if v != start.get(k)}


def test_without_the_warm_up_the_first_request_adds_signatures(q4_1_file):
    [(start, after, warmed)] = ta.spawn(first_request, 1, q4_1_file, False)
    assert warmed == [] and after != start


def test_packed_kinds_names_the_formats_a_model_holds(q4_1_file):
    model = ta.load_model(q4_1_file, weight_format="packed")
    assert engine_warmup.packed_kinds(model) == [("q4_1", torch.uint8)]
    assert engine_warmup.packed_kinds(ta.load_model(q4_1_file, weight_format="dequantize")) == []


def test_the_docstring_examples_run():
    for module in (ops_warmup,):
        failures, tried = doctest.testmod(module)
        assert tried and not failures, module.__name__


def test_shipped_heads_are_the_installed_models_head_shapes():
    """scripts/install.sh runs warm_all: the attention kernel in SmolLM2's and Gemma 3's head shapes is compiled then,
    not in the first answer (Gemma 3's first engine start compiled for 20-22 s before, session 20)."""
    from treeattn.models.installed import gemma3_path, smollm2_path
    from treeattn.models.loader import read_config

    shapes = set()
    for path in (smollm2_path(), gemma3_path()):
        c = read_config(path)
        shapes.add((c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim))
    assert shapes == set(ops_warmup.SHIPPED_HEADS)
