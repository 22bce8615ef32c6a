"""One engine configuration: EngineConfig (how it runs) and SamplingParams (how to sample), every field
checked once where it lives, each error naming its option; generate() takes the same two, sized to
its batch, and the one memory check (engine.memory.check_memory_fit) speaks for every caller."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from treeattn.engine.checks import check_memory
from treeattn.engine.config import ConfigError, ConfigTypeError, EngineConfig
from treeattn.engine.generate import RENAMED, batch_config, check_generation, split_options
from treeattn.engine.memory import kv_cache_bytes_per_rank
from treeattn.engine.request import SamplingParams
from treeattn.engine.config import resolve_prefill
from treeattn.models.llama import LlamaConfig, random_model

MODEL = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, max_position_embeddings=64, layer_windows=(None, 4))


def test_the_config_is_frozen_normalized_and_picklable():
    config = EngineConfig(nproc=2, block_size=16, decode_step="static")
    assert config.method == "allreduce"  # static steps may not read the host: not onepass
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8
    assert pickle.loads(pickle.dumps(config)) == config
    params = SamplingParams(stop_token_ids=[3, torch.tensor(4).item()], stop="\n\n", top_p=0.5, temperature=1)
    assert params.stop_token_ids == (3, 4) and params.stop == ("\n\n",)
    assert pickle.loads(pickle.dumps(params)) == params


@pytest.mark.parametrize(
    "cls, field, value",
    [
        (SamplingParams, "max_new_tokens", 0), (SamplingParams, "max_new_tokens", 2.0), (SamplingParams, "seed", -1),
        (SamplingParams, "temperature", math.inf), (SamplingParams, "temperature", math.nan), (SamplingParams, "temperature",
                                                                                               True),
        (SamplingParams, "top_p", 0.0), (SamplingParams, "top_p", 1.5), (SamplingParams, "top_k", -1),
        (SamplingParams, "stop_token_ids", [2.7]), (SamplingParams, "stop_token_ids", [True]), (SamplingParams, "seed", 2**64),
        (SamplingParams, "stop", [""]), (EngineConfig, "decode", "flash"), (EngineConfig, "method", "ring"),
        (EngineConfig, "prefill", "tree"), (EngineConfig, "placement", "striped"), (EngineConfig, "block_size", 0),
        (EngineConfig, "max_context", 0), (EngineConfig, "prefill_chunk", None), (EngineConfig, "decode_step", "graphs"),
        (EngineConfig, "shared_memory", 1),
    ],
)
def test_each_bad_field_is_named(cls, field, value):
    with pytest.raises(ValueError) as info:
        cls(**{field: value})
    assert str(info.value).startswith(field) and "\n" not in str(info.value)


def test_combinations_are_refused_without_a_model():
    with pytest.raises(ConfigError, match="decode='local' runs on one rank, but nproc=2") as info:
        EngineConfig(decode="local", nproc=2)
    assert info.value.option == "decode"
    with pytest.raises(ConfigError, match="decode_step='static' runs fixed one-token steps") as info:
        EngineConfig(speculate="ngram", decode_step="static")
    assert info.value.option == "speculate"


def test_generate_takes_the_engine_names_and_names_the_new_one_for_an_old():
    config, params = split_options(None, None, dict(block_size=8, max_context=40, prefill_chunk=16, top_k=3, stop=["x"]))
    assert (config.block_size, config.max_context, config.prefill_chunk) == (8, 40, 16)
    assert (params.top_k, params.stop) == (3, ("x",))
    for old, new in RENAMED.items():
        with pytest.raises(TypeError, match=f"^{old} is no longer an option of generate\\(\\): use {new.split()[0]}") as info:
            split_options(None, None, {old: 1})
        assert info.value.option == old
    with pytest.raises(TypeError, match="^chunks is not an option of generate"):
        split_options(None, None, dict(chunks=3))
    with pytest.raises(TypeError, match=r"give either config or its fields as keywords, not both \(got \['block_size'\]\)"):
        split_options(EngineConfig(), None, dict(block_size=8))
    with pytest.raises(TypeError, match="sampling must be a SamplingParams, got dict"):
        split_options(None, {"top_k": 3}, {})


def test_batch_config_sizes_the_engine_to_the_batch():
    prompts = [[1] * 13, [2] * 5]
    for world in (1, 3):
        sized = batch_config(EngineConfig(block_size=4), SamplingParams(max_new_tokens=7), 1, prompts, world)
        assert (sized.nproc, sized.max_batch_size, sized.max_context) == (world, 2, 20)
        assert sized.decode == ("local" if world == 1 else "tree")
        span = -(-20 // (4 * world))  # blocks of one sequence on each rank
        assert sized.blocks_per_rank(MODEL.max_position_embeddings) == 2 * span
        assert sized.max_context_tokens(MODEL.max_position_embeddings) == 20
    given = batch_config(EngineConfig(max_context=30, cache_tokens=256), SamplingParams(), 3, prompts[:1], 2)
    assert (given.max_context, given.cache_tokens, given.max_batch_size) == (30, 256, 3)


def test_generation_checks_name_the_option():
    prompts = [[1] * 10]
    check_generation(batch_config(EngineConfig(), SamplingParams(max_new_tokens=4), 1, prompts, 2),
                     SamplingParams(max_new_tokens=4),
                     1, MODEL, prompts)
    for config, params, samples, batch, option, match in [
        (EngineConfig(max_context=12), SamplingParams(max_new_tokens=32), 1, 1, "max_context",
         "prompt of 10 tokens \\+ max_new_tokens=32 needs 42 positions, more than max_context=12"),
        (EngineConfig(), SamplingParams(stop_token_ids=[64]), 1, 1, "stop_token_ids",
         r"token id 64 is outside the vocabulary \[0, 64\)"),
        (EngineConfig(), SamplingParams(), 2, 2, "num_samples", "got 2 prompts"),
        (EngineConfig(speculate="ngram"), SamplingParams(), 3, 1, "speculate",
         "decodes one sequence; num_samples=3 asks for several"),
        (EngineConfig(speculate="ngram"), SamplingParams(), 1, 2, "speculate", "decodes one prompt at a time, got 2 prompts"),
    ]:
        batch = prompts * batch
        with pytest.raises(ConfigError, match=match) as info:
            check_generation(batch_config(config, params, samples, batch, 1), params, samples, MODEL, batch)
        assert info.value.option == option


def test_kv_estimate_is_what_the_engine_allocates():
    """MODEL is hybrid (a global layer, a window-4 layer): the paged arena holds the global layer
    (and its pad block), and every rank keeps a ring of W - 1 + SPARE_ROWS rows of the window layer
    per sequence (treeattn.cache.window), and with the prefix cache as many window checkpoints at most
    (treeattn.cache.prefix)."""
    from treeattn.cache.paged import PagedKVCache
    from treeattn.cache.window import SPARE_ROWS

    for placement, world in (("contiguous", 3), ("interleaved", 2)):
        config = batch_config(EngineConfig(block_size=4, placement=placement), SamplingParams(max_new_tokens=7), 1,
                              [[1] * 13, [2] * 9], world)
        blocks = config.blocks_per_rank(MODEL.max_position_embeddings)
        assert blocks == 2 * -(-20 // (4 * world))  # 20 slots a sequence, dealt over the ranks
        arena = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=blocks, block_size=4)
        windows = 2 * ((3 + SPARE_ROWS) * 2 * 2 * 8 * 4)  # 2 sequences x (rows x K and V x 2 heads x 8 x float32)
        assert config.prefix_cache
        assert kv_cache_bytes_per_rank(config, MODEL, torch.float32) == arena.nbytes() + 2 * windows  # + 2 checkpoints
        no_prefix = dataclasses.replace(config, prefix_cache=False)
        assert kv_cache_bytes_per_rank(no_prefix, MODEL, torch.float32) == arena.nbytes() + windows


def test_one_memory_check_names_the_option_that_sized_the_cache():
    model = random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                     num_kv_heads=1, head_dim=16, max_position_embeddings=2**62))
    huge = batch_config(EngineConfig(), SamplingParams(max_new_tokens=2**50), 1, [[1] * 10], 1)
    for option in ("max_new_tokens", "max_context", "cache_tokens"):
        with pytest.raises(ConfigError,
                           match=rf"^{option}: 1 rank\(s\) x \(.* of weights \+ .* of KV cache\) = .*, more than the .* "
                                              "of memory of this machine$") as info:
            check_memory(model, model.config, huge, cache_option=option)
        assert info.value.option == option


def test_generate_refuses_a_cache_beyond_memory_before_any_work():
    import treeattn as ta

    model = random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                     num_kv_heads=1, head_dim=16, max_position_embeddings=128))
    with pytest.raises(ConfigError, match=r"^max_context: 1 rank\(s\) x .* of KV cache\) = ") as info:
        ta.generate(model, [1, 2, 3], max_new_tokens=4, max_context=2**50)
    assert info.value.option == "max_context"
    with pytest.raises(ConfigTypeError, match="^capacity is no longer an option of generate\\(\\): use max_context"):
        ta.generate(model, [1, 2, 3], capacity=10)


def test_prefill_resolution():
    assert resolve_prefill("auto", 1, (None,)) == "split"  # one rank: nothing to split, the replicated step
    assert resolve_prefill("auto", 2, (None,)) == "ring"
    assert resolve_prefill("auto", 2, (None, 4)) == "split"  # a window: split (ring is exact there too, but masked)
    assert resolve_prefill("ring", 2, (None, 4)) == "ring"
