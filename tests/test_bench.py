"""The benchmark runner: a tiny real sweep on 2 gloo ranks, config checks, netns, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import treeattn.parallel as par
from treeattn.bench import netns
from treeattn.bench.config import SweepConfig, shard_bounds
from treeattn.bench.runner import PeakMemory, run_decode_sweep, run_rank, write_records
from treeattn.bench.validate import compare, markdown_table
from treeattn.cli import app
from treeattn.sim import PRESETS, DecodeShape, predict_decode

ALL_METHODS = ("allreduce", "tree", "twolevel", "ring-kv", "ring-q", "local")


@pytest.fixture(scope="module")
def tiny_sweep():
    """One spawn of 2 ranks running every method at two lengths (shared by several tests)."""
    config = SweepConfig(
        methods=ALL_METHODS, world_sizes=(2,), seq_lens=(64, 37), heads=4, head_dim=8, warmup=1, repeats=3,
        ranks_per_node=1, timeout=60.0,
    )
    return config, run_decode_sweep(config)


def test_sweep_records_are_complete_and_ordered(tiny_sweep):
    config, records = tiny_sweep
    assert [(r["seq_len"], r["method"]) for r in records] == [(n, m) for n in (64, 37) for m in ALL_METHODS]
    for r in records:
        assert r["gpus"] == 2 and r["repeats"] == 3 and len(r["slowest_rank_seconds"]) == 3
        assert 0 < r["p10_seconds"] <= r["median_seconds"] <= r["p90_seconds"]
        assert len(r["bytes_per_rank"]) == 2 and len(r["peak_memory_per_rank"]) == 2
        assert r["devices"] == (1 if r["method"] == "local" else 2)


def test_measured_comm_matches_the_cost_model(tiny_sweep):
    """comm_stats on real gloo ranks and the cost model agree on bytes and rounds (per busiest rank)."""
    config, records = tiny_sweep
    cluster = PRESETS["dgx-h100"].with_overrides(gpus_per_node=config.ranks_per_node)
    for r in records:
        shape = DecodeShape(seq_len=r["seq_len"], heads=4, head_dim=8, dtype="fp32")
        predicted = predict_decode(cluster, shape, 2, r["method"])
        assert r["rounds"] == predicted.rounds, r["method"]
        if r["method"] == "ring-kv":
            # uneven shards (37 tokens): the busiest rank sends the larger block
            assert r["bytes"] == predicted.bytes
        else:
            assert r["bytes"] == pytest.approx(predicted.bytes), r["method"]


def test_ring_kv_moves_kv_and_tree_moves_states(tiny_sweep):
    _, records = tiny_sweep
    by = {(r["seq_len"], r["method"]): r for r in records}
    kv_bytes = 64 // 2 * 4 * 8 * 4 * 2  # the other rank's K and V shard, fp32
    assert by[(64, "ring-kv")]["by_op_per_rank"][0]["p2p"]["bytes_sent"] == kv_bytes
    state = 4 * (8 + 1) * 4  # out + lse of 4 heads, float32
    assert by[(64, "allreduce")]["bytes"] == pytest.approx(2 * (2 - 1) / 2 * (state + 4 * 4))  # eq. 14 x 4 bytes
    assert by[(64, "local")]["bytes"] == 0


def _disagreeing_rank(rank, world_size, config_json):
    config = SweepConfig.from_json(config_json)
    if rank == 1:
        config = SweepConfig(**{**json.loads(config_json), "seq_lens": [128], "repeats": 7})
    return run_rank(rank, world_size, config.to_json())


def test_ranks_that_disagree_refuse_to_start():
    config = SweepConfig(methods=("allreduce",), world_sizes=(2,), seq_lens=(64,), heads=2, head_dim=8, repeats=1, timeout=30.0)
    with pytest.raises(par.SpawnError) as info:
        par.spawn(_disagreeing_rank, 2, config.to_json(), timeout=30.0)
    text = str(info.value)
    assert "disagree on the configuration" in text and "repeats" in text and "seq_lens" in text


def test_bad_sweeps_are_rejected_before_any_process_starts():
    with pytest.raises(ValueError, match="not divisible by ranks_per_node"):
        SweepConfig(world_sizes=(6,), ranks_per_node=4)
    with pytest.raises(ValueError, match="shorter than world size"):
        SweepConfig(methods=("ring-kv",), world_sizes=(4,), seq_lens=(3,))
    SweepConfig(methods=("allreduce",), world_sizes=(4,), seq_lens=(3,))  # empty shards are fine for the tree
    with pytest.raises(ValueError, match="method must be one of"):
        SweepConfig(methods=("ring",))
    with pytest.raises(ValueError, match="repeats"):
        SweepConfig(repeats=0)
    with pytest.raises(ValueError, match="dtype"):
        SweepConfig(dtype="int8")


def test_shards_cover_the_sequence():
    for n, p in [(10, 3), (3, 4), (64, 2)]:
        bounds = [shard_bounds(n, p, r) for r in range(p)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


def test_peak_memory_sees_a_large_allocation():
    """In a fresh process, as the bench's rank workers run it: in a long-lived one (the test suite's)
    a 16 MiB block is served from freed heap memory that is resident already, and the RSS does not grow."""
    code = ("import torch\nfrom treeattn.bench.runner import PeakMemory\n"
            "with PeakMemory(torch.device('cpu')) as memory:\n    block = torch.ones(16 * 2**20 // 4)\n    del block\n"
            "print(memory.peak_bytes)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert int(out) >= 15 * 2**20, out


def test_records_round_trip_and_validation_table(tiny_sweep, tmp_path):
    _, records = tiny_sweep
    write_records(records, tmp_path / "r.json")
    write_records(records, tmp_path / "r.csv")
    assert json.loads((tmp_path / "r.json").read_text()) == records
    header = (tmp_path / "r.csv").read_text().splitlines()[0].split(",")
    assert {"method", "gpus", "seq_len", "median_seconds", "bytes", "rounds"} <= set(header)
    rows = compare(records, PRESETS["dgx-h100"])
    for row, r in zip(rows, records):
        assert row["error"] == pytest.approx((row["predicted_seconds"] - r["median_seconds"]) / r["median_seconds"])
    table = markdown_table(rows, tolerance=0.35)
    assert table.count("\n") == len(rows) + 1 and "**miss**" in table  # a GPU preset cannot predict a CPU


# -------------------------------------------------------------------------------------- netns


def test_network_spec_rejects_nonsense():
    with pytest.raises(ValueError, match="nodes"):
        netns.NetworkSpec(nodes=1)
    with pytest.raises(ValueError, match="inter_mbit"):
        netns.NetworkSpec(nodes=2, inter_mbit=-10)
    with pytest.raises(ValueError, match="inter_delay_ms"):
        netns.NetworkSpec(nodes=2, inter_delay_ms=-1)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(netns.netns_unavailable_reason() is not None, reason="needs root and iproute2 (network namespaces)")
def test_two_tier_network_is_built_shaped_and_always_removed():
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with netns.two_tier_network(netns.NetworkSpec(nodes=2, inter_mbit=50)) as net:
            assert set(net.namespaces) | {net.switch} <= _namespaces()
            qdisc = subprocess.run(["ip", "netns", "exec", net.namespaces[0], "tc", "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "50Mbit" in qdisc
            route = subprocess.run(["ip", "-n", net.namespaces[1], "route", "get", net.addresses[0]], capture_output=True,
                                   text=True)
            assert "dev eth0" in route.stdout  # node 1 reaches node 0 through its shaped link
            raise RuntimeError("boom")
    assert _namespaces() == before


@pytest.mark.skipif(netns.netns_unavailable_reason() is not None, reason="needs root and iproute2 (network namespaces)")
def test_twolevel_across_namespaces_sends_inter_node_bytes_from_leaders_only():
    config = SweepConfig(methods=("twolevel",), world_sizes=(4,), seq_lens=(64,), heads=2, head_dim=8, warmup=0, repeats=1,
                         ranks_per_node=2, timeout=60.0)
    with netns.two_tier_network(netns.NetworkSpec(nodes=2)) as net:
        (record,) = run_decode_sweep(config, launcher=net.launcher(2))
    by_op = record["by_op_per_rank"]
    # leaders (ranks 0, 2) run the cross-node allreduce; the others only talk inside their node
    assert [op["allreduce"]["bytes_sent"] > 0 for op in by_op] == [True, False, True, False]
    assert [op["p2p"]["bytes_sent"] > 0 for op in by_op] == [False, True, False, True]


def test_topology_without_namespaces_exits_cleanly(monkeypatch):
    monkeypatch.setattr(netns, "netns_unavailable_reason", lambda: "network namespaces need root")
    result = CliRunner().invoke(app, ["bench", "decode", "--topology", "2x1", "-m", "allreduce", "-n", "64", "--repeats", "1"])
    assert result.exit_code == 0
    assert "need root" in result.output


def test_bench_cli_rejects_bad_input():
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "decode", "-p", "3", "--ranks-per-node", "2"])
    assert result.exit_code != 0 and "not divisible" in result.output
    result = runner.invoke(app, ["bench", "decode", "-m", "ring-kv", "-p", "4", "-n", "2"])
    assert result.exit_code != 0 and "shorter than world size" in result.output
    result = runner.invoke(app, ["bench", "decode", "--topology", "2y2"])
    assert result.exit_code != 0 and "NODESxRANKS" in result.output


def test_best_of_passes_keeps_the_least_disturbed_run():
    from treeattn.bench.validate import best_of_passes

    def rec(m, t):
        return {"method": m, "gpus": 2, "seq_len": 64, "median_seconds": t}

    kept = best_of_passes([[rec("tree", 3.0), rec("ring-kv", 1.0)], [rec("tree", 2.0), rec("ring-kv", 5.0)]])
    assert [(r["method"], r["median_seconds"], r["pass_medians"]) for r in kept] == [
        ("tree", 2.0, [3.0, 2.0]), ("ring-kv", 1.0, [1.0, 5.0])
    ]


def test_calibration_passes_keep_the_fastest_and_a_consistent_ring_step():
    from treeattn.bench.calibrate import cluster_from_measurements, fastest_of_passes

    base = {
        "p2p_small_one_way_seconds": 5e-5, "p2p_large_one_way_seconds": 0.02, "p2p_large_bytes": 64 * 2**20,
        "allreduce_small_seconds": 8e-5, "attention_tokens": [4096, 32768, 131072],
        "attention_alone_seconds": [0.01, 0.06, 0.24], "attention_concurrent_seconds": [0.01, 0.07, 0.28],
        "merge_seconds": 3e-5, "ring_step_seconds": 0.07, "ring_step_attention_seconds": 0.01,
        "copy_bandwidth_1_thread": 2e10, "copy_bandwidth_all_threads": 3e10, "matmul_flops_1_thread": 5e10,
    }
    slow = {**base, "attention_alone_seconds": [0.02, 0.03, 0.5], "ring_step_seconds": 0.2, "ring_step_attention_seconds": 0.001,
            "copy_bandwidth_1_thread": 4e10}
    combined = fastest_of_passes([slow, base])
    assert combined["attention_alone_seconds"] == [0.01, 0.03, 0.24]
    assert (combined["ring_step_seconds"], combined["ring_step_attention_seconds"]) == (0.07, 0.01)
    assert combined["copy_bandwidth_1_thread"] == 4e10
    cluster = cluster_from_measurements(combined)
    assert cluster.intra.bandwidth == pytest.approx(
        64 * 2**20 / (0.07 - 0.01 - cluster.collective_overhead - cluster.intra.latency), rel=1e-6
    )
    assert cluster.host_cores >= 1 and cluster.p2p_overlap == 0.0


def test_busy_round_term_comes_from_the_busy_rounds_of_the_quietest_pass(monkeypatch):
    from treeattn.bench import calibrate as cal

    monkeypatch.setattr(cal.os, "cpu_count", lambda: 2)
    base = {
        "p2p_small_one_way_seconds": 5e-5, "p2p_large_one_way_seconds": 0.02, "p2p_large_bytes": 64 * 2**20,
        "allreduce_small_seconds": 8e-5, "attention_tokens": [4096, 32768, 131072],
        "attention_alone_seconds": [0.01, 0.06, 0.24], "attention_concurrent_seconds": [0.01, 0.07, 0.28],
        "merge_seconds": 3e-5, "ring_step_seconds": 0.07, "ring_step_attention_seconds": 0.01,
        "copy_bandwidth_1_thread": 2e10, "copy_bandwidth_all_threads": 3e10, "matmul_flops_1_thread": 5e10,
        "busy_world_sizes": [2, 4], "busy_compute_seconds": [0.006, 0.012], "busy_p2p_seconds": [0.0061, 0.015],
        "busy_allreduce_seconds": [0.0062, 0.0125], "busy_p2p_pair_seconds": [0.0063, 0.02],
        "busy_allreduce_pair_seconds": [0.0064, 0.016],
    }
    loud = {**base, "busy_compute_seconds": [0.02, 0.05], "busy_p2p_seconds": [0.02, 0.05]}
    combined = cal.fastest_of_passes([loud, base])
    assert combined["busy_p2p_seconds"] == [0.0061, 0.015]  # differences are kept within one pass
    cluster = cal.cluster_from_measurements(combined)
    message = cal.BUSY_MESSAGE_ELEMENTS * 4  # the busy rounds carry one decode state
    idle_p2p = cluster.collective_overhead + cluster.intra.latency + message / cluster.intra.bandwidth
    idle_allreduce = cluster.collective_overhead + 2 * 3 * (cluster.intra.latency + message / (4 * cluster.intra.bandwidth))
    assert [p for p, _ in cluster.busy_round_p2p] == [2, 4]
    assert cluster.busy_round_p2p[1][1] == pytest.approx(0.003 - idle_p2p)
    assert cluster.busy_round_collective[1][1] == pytest.approx(0.0005 - idle_allreduce)
    assert cluster.busy_round_p2p[0][1] == pytest.approx(max(0.0, 1e-4 - idle_p2p))
    # each further back-to-back round: (two rounds) - (one round) - its idle cost
    assert cluster.busy_next_round_p2p[1] == (4, pytest.approx(0.005 - idle_p2p))
    assert cluster.busy_next_round_collective[1] == (4, pytest.approx(0.0035 - idle_allreduce))
    assert cluster.busy_next_round_p2p[0] == (2, pytest.approx(max(0.0, 2e-4 - idle_p2p)))
    old_file = {k: v for k, v in combined.items() if "pair" not in k}  # a calibration made before the pairs
    assert cal.cluster_from_measurements(old_file).busy_next_round_p2p == ()


def test_compare_predicts_each_record_from_its_own_calibration():
    h100 = PRESETS["dgx-h100"]
    slow = h100.with_overrides(memory_bandwidth=h100.memory_bandwidth / 10)
    record = {"method": "local", "gpus": 1, "seq_len": 100_000, "heads": 16, "kv_heads": 16, "head_dim": 128, "batch": 1,
              "dtype": "fp32", "median_seconds": 1.0, "p10_seconds": 1.0, "p90_seconds": 1.0, "bytes": 0, "rounds": 0}
    (fast_row,) = compare([record], h100)
    (own_row,) = compare([{**record, "calibration_cluster": slow.to_dict()}], h100)
    assert own_row["predicted_seconds"] > 5 * fast_row["predicted_seconds"]


def test_busy_rounds_are_measured_on_real_ranks():
    from treeattn.bench.calibrate import _busy_round_measurements

    measured = _busy_round_measurements((2,), repeats=2)
    assert measured["busy_world_sizes"] == [2]
    for key in ("busy_compute_seconds", "busy_p2p_seconds", "busy_allreduce_seconds", "busy_p2p_pair_seconds",
                "busy_allreduce_pair_seconds"):
        assert len(measured[key]) == 1 and 0 < measured[key][0] < 10
    with pytest.raises(ValueError, match="world_sizes must be integers >= 2"):
        from treeattn.bench.calibrate import calibrate

        calibrate(world_sizes=(1,))
