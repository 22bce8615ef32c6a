"""GenerationConfig: one frozen object, every field checked once, each error naming its option."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from treeattn.engine.config import (
    ConfigError,
    GenerationConfig,
    check_against_model,
    kv_cache_bytes_per_rank,
)
from treeattn.engine.ring_prefill import resolve_prefill
from treeattn.models.llama import LlamaConfig

MODEL = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, max_position_embeddings=64, layer_windows=(None, 4))


def test_the_config_is_frozen_normalized_and_picklable():
    config = GenerationConfig(stop_tokens=[3, torch.tensor(4).item()], top_p=0.5, temperature=1)
    assert config.stop_tokens == (3, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_p = 1.0
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.sampling_params(0, ()).top_p == 0.5 and config.decode_step == "dynamic"
    assert GenerationConfig(cuda_graph=True).decode_step == "graph"


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("max_new_tokens", 0, ValueError), ("max_new_tokens", 2.0, TypeError), ("seed", -1, ValueError),
        ("temperature", math.inf, ValueError), ("temperature", math.nan, ValueError), ("temperature", True, ValueError),
        ("top_p", 0.0, ValueError), ("top_p", 1.5, ValueError), ("top_k", 0, ValueError), ("stop_tokens", [2.7], ValueError),
        ("stop_tokens", [True], ValueError), ("decode", "flash", ValueError), ("method", "ring", ValueError),
        ("prefill", "tree", ValueError), ("placement", "striped", ValueError), ("block_size", 0, ValueError),
        ("capacity", 0, ValueError), ("seed", 2**64, ValueError), ("chunk", None, TypeError), ("static_decode", 1, TypeError),
    ],
)
def test_each_bad_field_is_named(field, value, error):
    with pytest.raises(error) as info:
        GenerationConfig(**{field: value})
    assert isinstance(info.value, ConfigError) and info.value.option == field
    assert str(info.value).startswith(field) and "\n" not in str(info.value)


def test_combinations_are_refused_without_a_model():
    with pytest.raises(ConfigError, match="speculate='ngram' decodes one sequence; num_samples=3 asks for several") as info:
        GenerationConfig(num_samples=3, speculate="ngram")
    assert info.value.option == "speculate"
    with pytest.raises(ConfigError, match="static_decode=True runs fixed one-token steps"):
        GenerationConfig(speculate="ngram", static_decode=True)


def test_checks_against_the_model():
    prompts = [[1] * 10]
    assert check_against_model(GenerationConfig(max_new_tokens=4), MODEL, prompts, 2) == []
    assert check_against_model(GenerationConfig(max_new_tokens=60), MODEL, prompts, 2) == [
        "70 positions exceed the model's max_position_embeddings=64"]
    for config, world, option, match in [
        (GenerationConfig(decode="local"), 2, "decode", "decode='local' runs on one rank, but the group has 2"),
        (GenerationConfig(capacity=12), 1, "capacity", "needs 42 cache slots, more than capacity=12"),
        (GenerationConfig(stop_tokens=[64]), 1, "stop_tokens", r"token id 64 is outside the vocabulary \[0, 64\)"),
        (GenerationConfig(num_samples=2), 1, "num_samples", "got 2 prompts"),
        (GenerationConfig(capacity=2**50), 4, "capacity", "per rank on 4 rank"),
        (GenerationConfig(max_new_tokens=2**50), 1, "max_new_tokens", r"max_new_tokens=1125899906842624: the KV cache of "
                                                                       r"1125899906842634 slots x 1 sequences \(blocks of 256\) would take"),
        (GenerationConfig(block_size=2**50), 1, "block_size", "block_size=1125899906842624: the KV cache of 42 slots"),
        (GenerationConfig(num_samples=2**45, max_new_tokens=8), 1, "num_samples", "and 35184372088832 samples"),
    ]:
        with pytest.raises(ConfigError, match=match) as info:
            check_against_model(config, MODEL, prompts * (2 if "got 2 prompts" in match else 1), world)
        assert info.value.option == option


def test_prefill_resolution():
    assert resolve_prefill("auto", 1, (None,)) == "split"  # one rank: nothing to split, the replicated step
    assert resolve_prefill("auto", 2, (None,)) == "ring"
    assert resolve_prefill("auto", 2, (None, 4)) == "split"  # a window: split (ring is exact there too, but masked)
    assert resolve_prefill("ring", 2, (None, 4)) == "ring"


def test_kv_estimate_is_what_the_engine_allocates():
    """MODEL is hybrid (a global layer, a window-4 layer): the paged arena holds the global layer,
    and every rank keeps W - 1 = 3 positions of the window layer per sequence."""
    from treeattn.cache.paged import PagedKVCache

    for placement, world in (("contiguous", 3), ("interleaved", 2)):
        config = GenerationConfig(max_new_tokens=7, block_size=4, placement=placement, num_samples=1)
        blocks = config.blocks_per_rank(13, 2, world)
        assert blocks == 2 * -(-20 // (4 * world))  # 20 slots a sequence, dealt over the ranks
        arena = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=blocks, block_size=4)
        windows = 2 * (3 * 2 * 2 * 8 * 4)  # 2 sequences x (3 positions x K and V x 2 heads x 8 x float32)
        assert kv_cache_bytes_per_rank(config, MODEL, 2, 13, world, torch.float32) == arena.nbytes() + windows
