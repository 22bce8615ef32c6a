"""Tensor parallelism beside the sharded KV cache (EngineConfig.tp, the Helix layout: treeattn.engine.worker.tensor_parallel).

Greedy tokens of tiny random checkpoints (Llama with biases and Llama 3 rope scaling, Qwen2 with qkv
biases and tied embeddings, Mistral's sliding window, Gemma 3's hybrid cache and single KV head,
DeepSeek-V2/V3's latent attention and MoE)
on real gloo ranks in the layouts tp x kv = 1x2, 2x1, 2x2 and 4x1 equal transformers' uncached
greedy recomputation. The collectives per step are counted; each rank's weight bytes are at most
the layout's share + 5 %; a GGUF file's packed blocks split on block boundaries give the one-rank
engine's tokens; what the layout does not run is refused in one line before any rank starts.

Process start-up dominates the cost on a 2-core machine, so every multi-rank case but two runs in ONE
spawn per world size (2 and 4 ranks: the `runs` fixture): each case's engine joins the spawned world
group (nproc = the group's size, as a rank of `treeattn generate` under torchrun does), one case after
the other, and the tests assert on what each case's ranks sent back. Engines that start their own
ranks with the layout (Engine(nproc=2, tp=2): the spawn and the adoption of started ranks) are
test_prompt_lookup_speculation_in_the_layout and test_serve_passes_tp_through.
"""

from __future__ import annotations

import pytest
import torch

import treeattn as ta
from treeattn.engine.config import EngineConfig
from treeattn.engine.errors import ConfigError
from treeattn.engine.worker.tensor_parallel import (HelixLayout, check_tensor_parallel, local_heads, split_bounds,
                                                    tensor_parallel_cuts)
from treeattn.models.llama import random_model
from treeattn.models.packed import weight_bytes
from treeattn.models.shards import Cut
from treeattn.parallel.spawn import SpawnError

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 5
PROMPTS = [[5, 17, 33, 2, 9, 100, 64, 3, 8, 21, 7], [1, 2, 3]]
ENGINE = dict(cache_tokens=128, block_size=4, prefill_chunk=5)  # the options of every case's engine unless it says


def _uncached_greedy(hf, prompts, new_tokens=NEW_TOKENS) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                logits = hf(torch.tensor([ids]), use_cache=False).logits[0, -1].double()
                top2 = logits.topk(2).values
                assert top2[0] - top2[1] > 1e-4, "near-tie in the oracle: choose another seed"
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt):])
    return out


# ------------------------------------------------------------------ the checkpoints and their oracles (parent)


def _gemma3_four_heads():
    """tests/gemma3_files.hf_gemma3's tiny Gemma 3 (1 KV head, window and global layers) with 4 query heads, so
    that tp = 4 divides them (its 2 heads refuse tp=4 in one line): the one KV head on every TP rank."""
    from gemma3_files import hf_gemma3

    return hf_gemma3(layers=3, window=4, heads=4, head_dim=64)


def _make(name: str, path):
    """Write checkpoint `name` to `path`; return its transformers model (the oracle)."""
    if name in ("v2", "v3"):
        from helpers.deepseek_checkpoints import make_checkpoint

        return make_checkpoint(name, path)
    if name in ("gemma3", "gemma3-4h"):
        from gemma3_files import hf_gemma3

        hf = hf_gemma3(layers=3, window=4) if name == "gemma3" else _gemma3_four_heads()
        hf.save_pretrained(path)
        return hf
    from helpers.llama_checkpoints import make_checkpoint

    return make_checkpoint("mistral", path, seed=1) if name == "draft" else make_checkpoint(name, path)


def _prompts(name: str) -> list[list[int]]:
    if name in ("v2", "v3"):
        from helpers.deepseek_checkpoints import PROMPT

        return [PROMPT]
    if name == "gemma3":
        return [[p % 250 for p in prompt] for prompt in PROMPTS]
    return PROMPTS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (directory, transformers model)}, each written once for the module."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tp_checkpoints")
    names = ("llama", "qwen2", "mistral", "draft", "v2", "v3", "gemma3", "gemma3-4h")
    return {name: (root / name, _make(name, root / name)) for name in names}


@pytest.fixture(scope="module")
def oracle(checkpoints):
    """oracle(name): transformers' uncached greedy tokens of the checkpoint's prompts (computed once)."""
    found = {}

    def tokens(name: str) -> list[list[int]]:
        if name not in found:
            found[name] = _uncached_greedy(checkpoints[name][1], _prompts(name))
        return found[name]

    return tokens


# ------------------------------------------------------------------ every multi-rank case: one spawn per world size


def _case_table(int8: bool) -> dict[str, tuple]:
    """{case: (world size, what runs, its arguments)}. "engine": (checkpoint, tp, options): an Engine joined
    to the world; "counts", "static": tp; "row": a seed; "packed": (GGUF file, tp, activation_format, logprobs)."""
    cases = {}
    for name, tp, kv in [("llama", 1, 2), ("llama", 2, 1), ("llama", 2, 2), ("llama", 4, 1), ("qwen2", 1, 2), ("qwen2", 2, 1),
                         ("qwen2", 2, 2), ("qwen2", 4, 1), ("mistral", 1, 2), ("mistral", 2, 1), ("mistral", 2, 2),
                         ("mistral", 4, 1), ("v3", 2, 1), ("v3", 2, 2), ("v2", 1, 2), ("v2", 4, 1), ("gemma3", 2, 1),
                         ("gemma3", 2, 2), ("gemma3-4h", 1, 2), ("gemma3-4h", 4, 1)]:
        cases[f"{name} {tp}x{kv}"] = (tp * kv, "engine", (name, tp, ENGINE))
    cases["llama 1x2 ring"] = (2, "engine", ("llama", 1, dict(ENGINE, decode="ring")))
    cases["llama 1x2 tree combine"] = (2, "engine", ("llama", 1, dict(ENGINE, method="tree")))
    for kv_cache_dtype in ("bfloat16", "fp8_e4m3"):
        cases[f"llama 2x1 {kv_cache_dtype}"] = (2, "engine", ("llama", 2, dict(ENGINE, kv_cache_dtype=kv_cache_dtype)))
    cases["llama 1x2 draft"] = (2, "engine", ("llama", 1, dict(speculate="draft", draft_model="draft", cache_tokens=128,
                                                               block_size=4)))
    for tp in (1, 2):
        cases[f"counts tp={tp}"] = (2, "counts", tp)
        cases[f"static tp={tp}"] = (2, "static", tp)
    cases["row parallel"] = (2, "row", 3)
    for tp, tied in [(1, False), (2, False), (2, True)]:
        cases[f"packed tp={tp} tied={tied}"] = (2, "packed", ("q8_gguf_tied" if tied else "q8_gguf", tp, "auto", None))
    if int8:
        for tp in (1, 2):
            cases[f"int8 tp={tp}"] = (2, "packed", ("q8_gguf", tp, "int8", 0))
    return cases


def _run_engine(rank: int, world_size: int, paths: dict, name: str, tp: int, options: dict):
    """The case's Engine joined to the world group: its tokens and speculation counts on the driver, None elsewhere."""
    options = dict(options)
    if "draft_model" in options:
        options["draft_model"] = str(paths[options["draft_model"]])
    engine = ta.Engine(paths[name], tp=tp, timeout_s=300, **options)
    if not engine.is_driver:  # served the driver's steps until it closed
        return None
    with engine:
        results = engine.generate(_prompts(name), max_new_tokens=NEW_TOKENS)
    return {"tokens": [r.token_ids for r in results], "speculation": results[0].speculation}


def _layout_cases(rank: int, world_size: int, cases: dict, paths: dict) -> dict:
    """Every case of this world size, one after the other: {case: what this rank's run returned}."""
    torch.set_num_threads(1)
    out = {}
    for case, (_, what, args) in cases.items():
        try:
            if what == "engine":
                out[case] = _run_engine(rank, world_size, paths, *args)
            elif what == "counts":
                out[case] = _counts(rank, world_size, args)
            elif what == "static":
                out[case] = _static(rank, world_size, args, "static")
            elif what == "row":
                out[case] = _row_parallel(rank, world_size, args)
            else:
                path, tp, activation_format, logprobs = args
                out[case] = _packed_run(rank, world_size, paths[path], tp, activation_format, logprobs)
        except Exception as error:
            raise RuntimeError(f"case {case!r}: {error}") from error
    return out


class _Runs:
    """runs[case]: every rank's result of the case (index = rank). The first case asked of a world size
    spawns that world once and runs all its cases (a failed spawn fails every case of its world)."""

    def __init__(self, cases: dict, paths: dict) -> None:
        self.cases, self.paths, self.worlds = cases, paths, {}

    def __getitem__(self, case: str) -> list:
        world = self.cases[case][0]
        if world not in self.worlds:
            mine = {name: c for name, c in self.cases.items() if c[0] == world}
            try:
                self.worlds[world] = ta.spawn(_layout_cases, world, mine, self.paths, timeout=300)
            except SpawnError as error:  # every later case of this world fails with it, without a spawn of its own
                self.worlds[world] = error
        if isinstance(self.worlds[world], Exception):
            raise self.worlds[world]
        return [rank[case] for rank in self.worlds[world]]


@pytest.fixture(scope="module")
def runs(checkpoints, q8_gguf, q8_gguf_tied):
    from treeattn.ops.packed_linear import int8_module

    paths = {name: path for name, (path, _) in checkpoints.items()}
    paths.update(q8_gguf=q8_gguf, q8_gguf_tied=q8_gguf_tied)
    return _Runs(_case_table(int8_module() is not None), paths)


def _tokens(runs, case: str) -> list[list[int]]:
    return runs[case][0]["tokens"]


@pytest.mark.parametrize("arch,tp,kv", [("llama", 1, 2), ("llama", 2, 1), ("llama", 2, 2), ("llama", 4, 1),
                                        ("qwen2", 2, 1), ("qwen2", 2, 2), ("mistral", 1, 2), ("mistral", 2, 1)])
def test_greedy_tokens_equal_transformers_uncached(runs, oracle, arch, tp, kv):
    assert _tokens(runs, f"{arch} {tp}x{kv}") == oracle(arch)


def test_ring_decode_and_a_16_bit_cache_in_the_layout(runs, oracle, checkpoints):
    """decode="ring" and tree_decode's "tree" combine over the KV group (1 x 2), and a bfloat16 and an fp8
    KV cache (2 x 1) giving the tokens of the same cache on one rank."""
    expected = oracle("llama")
    assert _tokens(runs, "llama 1x2 ring") == expected
    assert _tokens(runs, "llama 1x2 tree combine") == expected
    for kv_cache_dtype in ("bfloat16", "fp8_e4m3"):  # fp8: a scale per token and (local) KV head
        two = _tokens(runs, f"llama 2x1 {kv_cache_dtype}")
        with ta.Engine(checkpoints["llama"][0], nproc=1, cache_tokens=128, block_size=4, prefill_chunk=5,
                       kv_cache_dtype=kv_cache_dtype) as engine:
            assert two == [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)], kv_cache_dtype


def test_prompt_lookup_speculation_in_the_layout(checkpoints):
    """speculate="ngram" at 2 x 1 in an engine that starts its own ranks: drafts verified in the same
    replicated step, the tokens of decoding without speculation (transformers' greedy), and drafts were
    accepted."""
    path, hf = checkpoints["llama"]
    prompts = [[5, 6, 7, 8] * 3 + [5, 6], PROMPTS[1]]
    with ta.Engine(path, nproc=2, tp=2, speculate="ngram", cache_tokens=128, block_size=4, timeout_s=300) as engine:
        results = engine.generate(prompts, max_new_tokens=8)
        with pytest.raises(ValueError, match="^prompt_logprobs: not with tp=2"):  # refused in one line, before any step
            engine.submit(prompts[0], ta.SamplingParams(max_new_tokens=1, prompt_logprobs=1))
    assert [r.token_ids for r in results] == _uncached_greedy(hf, prompts, 8)
    assert results[0].speculation["accepted"] > 0


def test_draft_model_speculation_in_the_layout(runs, oracle):
    """speculate="draft" at 1 x 2 (a Mistral draft for a Llama target of the same vocabulary): the draft
    model stays whole on every rank, its cache sharded over the KV group; the target's greedy tokens."""
    driver = runs["llama 1x2 draft"][0]
    assert driver["tokens"] == oracle("llama")
    assert driver["speculation"]["drafted"] > 0


@pytest.mark.parametrize("arch,tp,kv", [("v3", 2, 1), ("v2", 1, 2)])
def test_deepseek_mla_heads_split_latent_cache_shared(runs, oracle, arch, tp, kv):
    """DeepSeek-V3 (q compression, MoE experts split by columns, one all-reduce of their sum) at 2 x 1 and
    V2 at 1 x 2: the query heads and up-projections split, the latent cache on every TP rank."""
    assert _tokens(runs, f"{arch} {tp}x{kv}") == oracle(arch)


@pytest.mark.parametrize("tp,kv", [(2, 1), (2, 2)])
def test_gemma3_window_layers_and_one_kv_head(runs, oracle, tp, kv):
    """Gemma 3 (1 KV head, replicated on both TP ranks; window layers kept whole on every rank, global
    layers sharded over the KV ranks): transformers' tokens."""
    assert _tokens(runs, f"gemma3 {tp}x{kv}") == oracle("gemma3")


@pytest.mark.parametrize("family,tp,kv", [("qwen2", 1, 2), ("qwen2", 4, 1), ("mistral", 2, 2), ("mistral", 4, 1),
                                          ("v3", 2, 2), ("v2", 4, 1), ("gemma3", 1, 2), ("gemma3", 4, 1)])
def test_every_family_in_every_layout(runs, oracle, family, tp, kv):
    """With the tests above, every family the engine loads (Llama, Qwen2, Mistral, DeepSeek MLA as V2 and V3,
    Gemma 3) runs every layout tp x kv of 1x2, 2x1, 2x2 and 4x1: transformers' uncached greedy tokens
    (Gemma 3 here with 4 query heads: _gemma3_four_heads)."""
    name = "gemma3-4h" if family == "gemma3" else family
    assert _tokens(runs, f"{name} {tp}x{kv}") == oracle(name)


def _counts(rank: int, world_size: int, tp: int) -> dict:
    torch.set_num_threads(1)
    config = ta.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=16, qkv_bias=True, o_bias=True, mlp_bias=True)
    model = random_model(config, seed=1, std=0.2)
    whole, share = weight_bytes(model), _layout_share(model, world_size, tp)
    result = ta.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, block_size=4,
                         tp=tp if world_size > 1 else None)
    calls = {op: c["calls"] for op, c in result.comm["by_op"].items()}
    return {"ids": result.generated_ids, "calls": calls, "steps": result.decode_steps, "bytes": weight_bytes(model),
            "share": share, "whole": whole, "reported": result.weight_bytes_per_rank}


def _layout_share(model, n: int, tp: int) -> float:
    """Bytes of the layout's share: attention's q/k/v (weights and biases) and o_proj / tp; everything else
    split / n; norms and the row-parallel biases whole."""
    share = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if "norm" in name or name.endswith(("o_proj.bias", "down_proj.bias")):
            share += size
        elif any(k in name for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
            share += size / tp
        else:
            share += size / n
    return share


@pytest.mark.parametrize("tp", [1, 2])
def test_collectives_per_step_and_weight_bytes(runs, tp):
    """Per decode step on 2 ranks: the embedding's all-reduce, per layer the KV combine (when the KV
    group has 2 ranks), o_proj's all-reduce (when the TP group has 2) and down_proj's, then the logits'
    all-gather: 2 collectives a layer either way. Each rank holds at most the layout's share + 5 % (q/k/v
    and o_proj over tp, the rest over both ranks), and the result reports every rank's bytes (gathered on
    rank 0)."""
    one = _counts(0, 1, tp)  # one process: the whole model
    ranks = runs[f"counts tp={tp}"]
    assert ranks[0]["ids"] == one["ids"]
    steps, layers, kv = ranks[0]["steps"], 2, 2 // tp
    assert steps == NEW_TOKENS - 1
    assert ranks[0]["calls"]["allreduce"] == steps * (1 + layers * (1 + (kv > 1) + (tp > 1)))
    assert ranks[0]["calls"]["allgather"] == steps
    assert ranks[0]["reported"] == [rank["bytes"] for rank in ranks] and one["reported"] == [one["whole"]]
    for rank, reported in zip(ranks, ranks[0]["reported"]):
        assert reported <= 1.05 * rank["share"] and reported < 0.7 * one["whole"]


def _row_parallel(rank: int, world_size: int, seed: int) -> tuple:
    """A model's o_proj/MLP/embedding through the layout's collectives against float64 on one process."""
    from treeattn.engine.worker.tensor_parallel import connect, shard_model

    torch.set_num_threads(1)
    config = ta.LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                            head_dim=16, mlp_bias=True, o_bias=True)
    model = random_model(config, seed=seed, std=0.3)
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(seed))
    layout = HelixLayout(world_size, 2, rank)
    with torch.no_grad():
        want_mlp = model.layers[0].mlp.double()(x.double())
        model.float()
        cuts = tensor_parallel_cuts(config, layout)
        shard_model(model, cuts)
        connect(model, layout, cuts, None)
        got_mlp = model.layers[0].mlp(x)
        rows = model.embed_tokens(torch.tensor([[0, 24, 25, 49]]))
    return (got_mlp - want_mlp).abs().max().item(), want_mlp.abs().max().item(), rows


def test_row_parallel_collectives_against_float64(runs):
    results = runs["row parallel"]
    reference = random_model(ta.LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                                            num_kv_heads=2, head_dim=16, mlp_bias=True, o_bias=True), seed=3, std=0.3)
    for err, scale, rows in results:
        assert err <= 1e-5 * max(1.0, scale)
        assert torch.equal(rows, reference.embed_tokens(torch.tensor([[0, 24, 25, 49]])))  # one addend per row: exact


def test_layout_and_cuts():
    layout = HelixLayout(world_size=4, tp=2, rank=3)
    assert (layout.kv, layout.kv_index, layout.tp_index) == (2, 1, 1)
    assert split_bounds(96, 4, 32) == [0, 24, 48, 72, 96]  # 3 blocks over 4 ranks: not on blocks
    assert split_bounds(128, 4, 32) == [0, 32, 64, 96, 128]
    config = ta.LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8, num_kv_heads=2,
                            head_dim=16)
    cuts = tensor_parallel_cuts(config, layout)
    assert cuts["layers.0.self_attn.q_proj.weight"] == Cut(0, 64, 128)  # heads 4..7
    assert cuts["layers.0.self_attn.k_proj.weight"] == Cut(0, 16, 32)  # KV head 1
    assert cuts["layers.0.self_attn.o_proj.weight"] == Cut(1, 64, 128)  # slice 1's columns, whole on its KV ranks
    assert cuts["layers.0.mlp.down_proj.weight"] == Cut(1, 96, 128)
    assert cuts["embed_tokens.weight"] == Cut(0, 9, 10)  # shares of ceil(10 / 4) = 3 ids
    assert local_heads(config, HelixLayout(world_size=8, tp=8, rank=5)) == (1, 1)  # KV head 2 replicated 4 ways


@pytest.mark.parametrize("options,option", [
    (dict(nproc=4, tp=3), "tp"),
    (dict(nproc=2, tp=2, decode_step="graph"), "decode_step"), (dict(nproc=2, tp=1, prefill="ring"), "prefill"),
    (dict(nproc=2, tp=2, method="twolevel"), "method"), (dict(nproc=2, tp=0), "tp")])
def test_config_refusals_are_one_line(options, option):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**options)
    assert info.value.option == option and "\n" not in str(info.value)


def test_model_refusals_are_one_line():
    config = ta.LlamaConfig(vocab_size=10, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=6, num_kv_heads=3,
                            head_dim=8)
    for tp, nproc, what in ((4, 4, "query heads"), (2, 2, "KV heads"), (2, 3, "divide")):
        with pytest.raises(ConfigError, match=what) as info:
            check_tensor_parallel(config, tp, nproc)
        assert "\n" not in str(info.value)


def _q8_gguf(tmp_path_factory, arch: str):
    pytest.importorskip("transformers")
    import gguf

    from gguf_files import write_gguf
    from helpers.gguf_models import hf_model

    path = tmp_path_factory.mktemp("tp_gguf") / f"{arch}.q8_0.gguf"
    write_gguf(path, hf_model(arch, seed=4), gguf.GGMLQuantizationType.Q8_0, arch=arch)
    return path


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    return _q8_gguf(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def q8_gguf_tied(tmp_path_factory):
    return _q8_gguf(tmp_path_factory, "qwen2")  # tied embeddings: the packed table is the LM head too


def _packed_run(rank: int, world_size: int, path, tp, activation_format: str = "auto", logprobs: int | None = None) -> tuple:
    torch.set_num_threads(1)
    from treeattn.commands.generate_rank import GenerateJob, generate_rank
    from treeattn.engine.request import SamplingParams

    config = EngineConfig(nproc=world_size, tp=tp, block_size=4, weight_format="packed", max_context=64,
                          activation_format=activation_format)
    job = GenerateJob(model_dir=str(path), prompts=tuple(tuple(p) for p in PROMPTS), config=config,
                      sampling=SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs))
    return generate_rank(rank, world_size, job)


@pytest.mark.parametrize("tp,tied", [(1, False), (2, False), (2, True)])
def test_packed_gguf_shares_keep_the_files_blocks(runs, q8_gguf, q8_gguf_tied, tp, tied):
    """A Q8_0 file (Llama; Qwen2 with its tied table) loaded packed on 2 ranks, each reading its rows
    and its whole blocks of columns: the one-rank packed engine's tokens; each rank holds about half
    the packed bytes (tp=1: a third of this tiny model's weights, q/k/v and o_proj, stay whole on both
    ranks: 0.62 of them a rank)."""
    path = q8_gguf_tied if tied else q8_gguf
    one = _packed_run(0, 1, path, None)
    two = runs[f"packed tp={tp} tied={tied}"]
    assert two[0]["generated_ids"] == one["generated_ids"]
    assert two[0]["weight_format"] == "packed" and two[0]["tp"] == tp
    bound = 0.6 if tp == 2 else 0.65
    held = two[0]["weight_bytes_per_rank"]
    assert len(held) == 2 and max(held) < bound * one["weight_bytes_per_rank"][0]


@pytest.mark.parametrize("tp", [1, 2])
def test_int8_activations_in_the_layout(runs, q8_gguf, tp):
    """activation_format="int8" (llama.cpp's arithmetic: 8-bit activations per block of 32) with the packed
    file split over 2 ranks: o_proj and down_proj split their input columns on whole blocks, so each rank
    quantizes the same blocks of activations the one-rank call does, and only the sum's order changes:
    the one-rank int8 engine's greedy tokens, and the result says int8."""
    from treeattn.ops.packed_linear import int8_module

    if int8_module() is None:
        pytest.skip("the int8 kernel needs numba and AVX-512 VNNI/BW/VL; this CPU has not")
    exact = _packed_run(0, 1, q8_gguf, None, "float32", 0)
    one = _packed_run(0, 1, q8_gguf, None, "int8", 0)
    two = runs[f"int8 tp={tp}"][0]
    assert two["activation_format"] == one["activation_format"] == "int8"
    assert two["generated_ids"] == one["generated_ids"]
    got, want, float32 = (torch.tensor(r["token_logprobs"], dtype=torch.float64) for r in (two, one, exact))
    assert (want - float32).abs().max() > 1e-5  # the int8 path ran: its rounding shows in the logprobs
    assert (got - want).abs().max() <= 1e-4  # the layout changes only the order of float32 sums


def test_packed_split_off_block_boundaries_is_refused_before_ranks_start(q8_gguf):
    # 2 x 4: down_proj's 128 columns over 8 ranks, 16 a rank: half a Q8_0 block
    with pytest.raises(ConfigError, match="not whole blocks") as info:
        ta.Engine(q8_gguf, nproc=8, tp=2, weight_format="packed")
    assert "\n" not in str(info.value)


def test_docstring_examples_of_the_layout_modules():
    import doctest

    from treeattn.engine.worker import tensor_parallel
    from treeattn.models import shards

    for module in (tensor_parallel, shards):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_serve_passes_tp_through(tmp_path):
    """`treeattn serve --nproc 2 --tp 2` (an F16 GGUF file, each rank reading its rows and columns):
    the greedy completions of the one-rank engine."""
    pytest.importorskip("openai")
    from helpers.serve import KEY, NAME, Server, _write_tiny_llama_gguf

    path = _write_tiny_llama_gguf(tmp_path / "tiny.gguf", 0, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    with ta.Engine(str(path), nproc=1, block_size=16, cache_tokens=4096) as engine:
        expected = [r.text for r in engine.generate(["the cat", "hello there"], max_new_tokens=8, ignore_eos=True)]
    server = Server(path, "--nproc", "2", "--tp", "2", "--api-key", KEY, "--served-model-name", NAME)
    try:
        got = [server.client().completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0.0,
                                                  extra_body={"ignore_eos": True}).choices[0].text
               for p in ("the cat", "hello there")]
    finally:
        assert server.stop() == 0
    assert got == expected


def _static(rank: int, world_size: int, tp, decode_step: str) -> dict | None:
    torch.set_num_threads(1)
    config = ta.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=16, qkv_bias=True)
    engine = ta.Engine(random_model(config, seed=2, std=0.2), tp=tp, decode_step=decode_step, block_size=4, cache_tokens=128,
                       max_batch_size=4, timeout_s=300)
    if not engine.is_driver:
        return None
    with engine:
        tokens = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)]
        step = engine._channel.runner.static_step
    return {"tokens": tokens, "static_steps": 0 if step is None else step.steps}


@pytest.mark.parametrize("tp", [1, 2])
def test_static_decode_steps_in_the_layout(runs, tp):
    """decode_step="static" (fixed shapes, no host read inside a step; CPU here) on 2 ranks: every
    decode step static, the one-process dynamic engine's tokens."""
    one = _static(0, 1, None, "dynamic")
    two = runs[f"static tp={tp}"][0]
    assert two["tokens"] == one["tokens"] and two["static_steps"] == NEW_TOKENS - 1


def test_k_quant_superblocks_refuse_a_split_inside_them(tmp_path):
    """Gemma 3's file layout (ffn_down in Q6_K: 256-weight superblocks): an MLP of 256 split over 2 ranks
    would cut a superblock; refused in one line before any rank starts (dequantized, it runs)."""
    pytest.importorskip("transformers")
    from gemma3_files import hf_gemma3, write_gemma3_gguf

    path = tmp_path / "gemma3.gguf"
    write_gemma3_gguf(path, hf_gemma3(layers=2))
    with pytest.raises(ConfigError, match="blocks of 256") as info:
        ta.Engine(path, nproc=2, tp=2, weight_format="packed")
    assert "\n" not in str(info.value)
