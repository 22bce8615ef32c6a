"""Per-rank measurements of ta.Engine (engine.rank_measurements, treeattn.engine.measure).

On 2 spawned ranks with tree_decode "allreduce", every decode step of one sequence sends, per
layer, the paper's eq. 14 volume 2 (p-1)/p (Hq Dv + 2 Hq) float32 bytes; the counters split
prefill from decode steps, start again at a reset, and report the cache arena's bytes. On one
rank nothing is communicated.
"""

from __future__ import annotations

import threading

import pytest
import torch

from helpers.llama_checkpoints import VOCAB, make_checkpoint

import treeattn as ta
from treeattn.engine import EngineError

PROMPT = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(5)).tolist()
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("measure") / "llama"
    make_checkpoint("llama", directory)
    return directory


@pytest.mark.parametrize("nproc", [1, 2])
def test_rank_measurements_count_each_steps_bytes(checkpoint, nproc, monkeypatch):
    from treeattn.engine import transport

    released = []  # one rank: the thread that built it frees its OpenMP pool, as the steps run in the driver thread
    monkeypatch.setattr(transport, "release_thread_pool", lambda: released.append(threading.current_thread()))
    config = ta.load_model(str(checkpoint)).config
    with ta.Engine(str(checkpoint), nproc=nproc, method="allreduce", block_size=4, cache_tokens=64,
                   prefill_chunk=8, prefill="split", threads_per_rank=1) as engine:  # split: chunks of 8 (ring steps take more)
        engine.generate(PROMPT, max_new_tokens=2, ignore_eos=True)  # warm-up: counted before the reset only
        before = engine.rank_measurements(reset=True)
        assert all(m.steps["prefill"] >= 1 for m in before)
        engine.clear_prefix_cache()
        engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        after = engine.rank_measurements()

    assert released == ([threading.current_thread()] if nproc == 1 else [])  # 2 ranks: spawned, none built here
    assert [m.rank for m in after] == list(range(nproc))
    arena = config.num_layers * 2 * (engine.pool.blocks_per_rank + 1) * 4 * config.num_kv_heads * config.head_dim * 4
    for m in after:
        assert m.steps == {"prefill": 2, "decode": NEW_TOKENS - 1}  # 13 tokens in chunks of 8
        assert m.kv_bytes == arena
        assert len(m.step_s["decode"]) == NEW_TOKENS - 1 and all(t > 0 for t in m.step_s["decode"])
        for phases, step in zip(m.step_phases["decode"], m.step_s["decode"]):  # the parts add up to no more than the step
            assert phases["attention"] > 0 and ("sampling" in phases) == (m.rank == 0)
            assert sum(phases.values()) < step
        assert set(m.peak_rss_bytes) == set(m.start_rss_bytes) == {"prefill", "decode"}
        assert all(m.peak_rss_bytes[kind] >= m.start_rss_bytes[kind] > 0 for kind in ("prefill", "decode"))
        if nproc == 1:
            assert m.bytes_sent("decode") == m.bytes_sent("prefill") == 0
            continue
        p, hq, dv = nproc, config.num_heads, config.head_dim
        per_layer = 2 * (p - 1) / p * (hq * dv + 2 * hq) * 4
        assert m.bytes_sent("decode") == pytest.approx((NEW_TOKENS - 1) * config.num_layers * per_layer)
        assert m.comm["decode"]["rounds"] == (NEW_TOKENS - 1) * config.num_layers * 2  # two allreduces a layer
        assert m.bytes_sent("prefill") > 0


def test_rank_measurements_after_close_raise(checkpoint):
    engine = ta.Engine(str(checkpoint), nproc=1, block_size=4, cache_tokens=64)
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.rank_measurements()
