"""A rank takes its KV arena's memory when it starts, as a GPU engine does (issue 49's soak).

The paged arena is allocated with torch.empty, whose pages on Linux become resident only when
first written; RankRunner writes every block once at start (engine.worker.warmup.pretouch_cache),
so a rank's RSS right after the engine starts already covers the arena, and serving later writes
no new page of it. Read from /proc/<pid>/status (VmRSS) and /proc/<pid>/smaps (the arena's own
mapping: glibc maps an allocation this large on its own), with no request run: deterministic, no
time bound.
"""

from __future__ import annotations

import multiprocessing
import sys

import pytest

import treeattn as ta
from treeattn.models.llama import LlamaConfig, random_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, max_position_embeddings=32768)
TOKENS_PER_RANK = 1 << 17  # 512 blocks of 256, and the pad block: x 2 layers x K and V x 2 heads x 16 x float32
ARENA_BYTES = (TOKENS_PER_RANK + 256) * 2 * 2 * 2 * 16 * 4  # 64.1 MiB a rank


def _vm_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def _largest_resident_anonymous_mapping(pid: int, at_least: int) -> int:
    """The resident bytes of the most resident anonymous mapping (no file behind it: heap memory) of
    `pid` that is at least `at_least` bytes large; 0 if none."""
    best, anonymous, size = 0, False, 0
    for line in open(f"/proc/{pid}/smaps"):
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode [path]
            anonymous, size = len(fields) == 5, 0
        elif fields[0] == "Size:":
            size = int(fields[1]) * 1024
        elif fields[0] == "Rss:" and anonymous and size >= at_least:
            best = max(best, int(fields[1]) * 1024)
    return best


def test_each_rank_holds_its_whole_kv_arena_right_after_start():
    with ta.Engine(random_model(CONFIG, seed=3), nproc=2, block_size=256, cache_tokens=2 * TOKENS_PER_RANK,
                   threads_per_rank=1) as engine:
        measured = engine.rank_measurements()
        assert [m.kv_bytes for m in measured] == [ARENA_BYTES] * 2
        ranks = [p for p in multiprocessing.active_children() if p.name.startswith("treeattn-rank")]
        assert len(ranks) == 2
        for rank in ranks:
            # without the pre-touch this mapping is allocated but not resident (Rss 0 kB); the pad block is
            # zeroed at construction, so 1 of its 513 blocks would be
            assert _largest_resident_anonymous_mapping(rank.pid, ARENA_BYTES) >= ARENA_BYTES, rank.name
            assert _vm_rss(rank.pid) >= ARENA_BYTES, rank.name
    assert not multiprocessing.active_children()
