"""The cluster cost model: the paper's volumes, the collective models, bad input, the CLI."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from treeattn.cli import app
from treeattn.sim import METHODS, PRESETS, Cluster, DecodeShape, Link, load_cluster, predict_decode, predict_generation
from treeattn.sim import collectives, volumes
from treeattn.sim.hardware import GB, US
from treeattn.sim.model import RING_METADATA_BYTES

H100 = PRESETS["dgx-h100"]


def flat_cluster(**kw) -> Cluster:
    """A simple cluster with round numbers, for hand-checkable predictions."""
    args = dict(
        name="flat",
        gpus_per_node=4,
        memory_bandwidth=1e12,
        memory_efficiency=1.0,
        peak_flops=1e15,
        flops_efficiency=1.0,
        kernel_overhead=0.0,
        merge_seconds=0.0,
        collective_overhead=0.0,
        intra=Link(latency=1e-6, bandwidth=1e11),
        inter=Link(latency=1e-5, bandwidth=1e10),
    )
    args.update(kw)
    return Cluster(**args)


# ------------------------------------------------------------------------- paper's volumes


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 8),
    heads=st.integers(1, 64),
    head_dim=st.sampled_from([16, 64, 128]),
    p=st.integers(1, 256),
    t=st.integers(1, 50_000),
)
def test_volumes_equal_paper_eq10_and_eq14(b, heads, head_dim, p, t):
    shape = DecodeShape(seq_len=t * p, heads=heads, head_dim=head_dim, batch=b, dtype="bf16")
    d = heads * head_dim
    assert volumes.ring_volume_elements(shape, p) == 2 * b * t * d * p  # eq. 10
    assert volumes.tree_volume_elements(shape, p) == pytest.approx(2 * (p - 1) / p * (b * d + 2 * b * heads), rel=1e-15)  # eq. 14
    assert volumes.ring_peak_memory_elements(shape, p) == 4 * b * t * d + 2 * b * d  # eq. 8
    assert volumes.tree_peak_memory_elements(shape, p) == 2 * b * t * d + 2 * b * d + 2 * b * heads  # eq. 9


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("p", [2, 8, 64, 128])
def test_predicted_bytes_are_the_paper_volumes(preset, p):
    cluster = PRESETS[preset].with_overrides(gpus_per_node=8)
    b, heads, head_dim, t = 2, 16, 128, 1000
    shape = DecodeShape(seq_len=t * p, heads=heads, head_dim=head_dim, batch=b, dtype="bf16")
    d = heads * head_dim
    eq14 = 2 * (p - 1) / p * (b * d + 2 * b * heads)
    eq10 = 2 * b * t * d * p
    tree = predict_decode(cluster, shape, p, "allreduce")
    assert tree.paper_elements == pytest.approx(eq14, rel=1e-14)
    # the two allreduces carry n, d and m in float32: eq. 14 elements x 4 bytes exactly
    assert tree.bytes == pytest.approx(eq14 * 4, rel=1e-14)
    ring = predict_decode(cluster, shape, p, "ring-kv")
    assert ring.paper_elements == eq10
    # treeattn's ring stops after p - 1 transfers (eq. 10 counts p: the block travels home too),
    # and first all-gathers the shard lengths (RING_METADATA_BYTES per rank)
    assert ring.bytes == eq10 * (p - 1) / p * shape.element_bytes + (p - 1) * RING_METADATA_BYTES


# ------------------------------------------------------------------------------ collectives


def test_ring_allreduce_is_alpha_beta():
    c = flat_cluster()
    cost = collectives.ring_allreduce(c, 4, 4000)
    assert cost.rounds == 6
    assert cost.bytes_sent == pytest.approx(6 * 1000)
    assert cost.seconds == pytest.approx(6 * 1e-6 + 6000 / 1e11)
    # across nodes every step waits on the inter-node hop
    cost = collectives.ring_allreduce(c, 8, 8000)
    assert cost.seconds == pytest.approx(14 * 1e-5 + 14 * 1000 / 1e10)


def test_nccl_picks_tree_for_small_and_ring_for_large_messages_at_scale():
    small = collectives.nccl_allreduce(H100, 128, 8192)
    assert small.algorithm == "nccl-tree"
    assert small.rounds == 2 * ((8 - 1) + math.ceil(math.log2(16)))
    ring = collectives.ring_allreduce(H100, 128, 8192)
    assert small.seconds < ring.seconds


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 13, 64])
def test_binomial_tree_rounds_and_links(p):
    c = flat_cluster()
    up = collectives.binomial_reduce(c, list(range(p)), 100)
    assert up.rounds == (0 if p == 1 else math.ceil(math.log2(p)))
    # rounds whose stride reaches a node boundary pay the inter-node link
    expected = 0.0
    stride = 1
    while stride < p:
        crosses = any(i // 4 != (i - stride) // 4 for i in range(stride, p, 2 * stride))
        expected += (1e-5 + 100 / 1e10) if crosses else (1e-6 + 100 / 1e11)
        stride *= 2
    assert up.seconds == pytest.approx(expected)


# ---------------------------------------------------------------------------------- methods


@pytest.mark.parametrize("p", [2, 3, 8, 16, 64])
def test_method_rounds_follow_comm_stats_conventions(p):
    c = flat_cluster(gpus_per_node=8)
    if p > 8 and p % 8:
        return
    shape = DecodeShape(seq_len=1024, heads=4, head_dim=16)
    got = {m: predict_decode(c, shape, p, m) for m in METHODS}
    assert got["allreduce"].rounds == 2
    assert got["tree"].rounds == 2 * math.ceil(math.log2(p))
    assert got["ring-kv"].rounds == p  # the shard-length allgather + p - 1 steps
    assert got["ring-q"].rounds == p - 1
    assert got["local"].rounds == 0 and got["local"].bytes == 0 and got["local"].devices == 1
    nodes = max(1, p // 8)
    # binomial merge tree inside the node, two allreduces among leaders, one broadcast collective
    assert got["twolevel"].rounds == math.ceil(math.log2(min(p, 8))) + (2 if nodes > 1 else 0) + 1


def test_ring_kv_step_is_max_of_compute_and_transfer():
    c = flat_cluster()
    shape = DecodeShape(seq_len=4 * 1000, heads=8, head_dim=64, dtype="fp32")
    block = shape.kv_bytes(1000)
    compute = block / 1e12
    transfer = 1e-6 + block / 1e11
    lengths = 3 * 1e-6 + 3 * RING_METADATA_BYTES / 1e11  # ring allgather of the shard lengths
    got = predict_decode(c, shape, 4, "ring-kv")
    assert got.predicted_seconds == pytest.approx(lengths + 3 * max(compute, transfer) + compute)
    no_overlap = predict_decode(c.with_overrides(p2p_overlap=0.0), shape, 4, "ring-kv")
    assert no_overlap.predicted_seconds == pytest.approx(lengths + 3 * (compute + transfer) + compute)


def test_inter_node_bandwidth_matters_only_across_nodes():
    shape = DecodeShape(seq_len=1_000_000, heads=16, head_dim=128)
    slow_ib = H100.with_overrides(inter_bandwidth=1 * GB)
    one_node = [predict_decode(c, shape, 8, "ring-kv").predicted_seconds for c in (H100, slow_ib)]
    assert one_node[0] == one_node[1]
    two_nodes = [predict_decode(c, shape, 16, "ring-kv").predicted_seconds for c in (H100, slow_ib)]
    assert two_nodes[1] > 10 * two_nodes[0]


def test_twolevel_touches_inter_node_link_with_leaders_only():
    # with a very slow inter-node link, twolevel pays it for one allreduce among leaders (2
    # collectives), while tree pays it in every round whose stride crosses nodes
    c = H100.with_overrides(inter_latency=1000 * US)
    shape = DecodeShape(seq_len=1_000_000, heads=16, head_dim=128)
    two = predict_decode(c, shape, 64, "twolevel")
    tree = predict_decode(c, shape, 64, "tree")
    assert two.comm_seconds < tree.comm_seconds


def test_step_overhead_is_paid_once_by_every_method():
    shape = DecodeShape(seq_len=100_000, heads=16, head_dim=128)
    slow = H100.with_overrides(step_overhead=1e-3)
    for m in METHODS:
        assert predict_decode(slow, shape, 16, m).predicted_seconds == pytest.approx(
            predict_decode(H100, shape, 16, m).predicted_seconds + 1e-3
        )


def test_local_is_one_device_roofline():
    c = flat_cluster()
    shape = DecodeShape(seq_len=10_000, heads=8, head_dim=64, dtype="fp16")
    got = predict_decode(c, shape, 4, "local")
    assert got.predicted_seconds == pytest.approx(shape.kv_bytes(10_000) / 1e12)


def test_paper_scale_tree_beats_ring_and_speedup_grows_with_length():
    speedups = []
    for n in (80_000, 640_000, 5_120_000):
        shape = DecodeShape(seq_len=n, heads=16, head_dim=128, dtype="bf16")
        ring = predict_decode(H100, shape, 128, "ring-kv").predicted_seconds
        tree = predict_decode(H100, shape, 128, "allreduce").predicted_seconds
        speedups.append(ring / tree)
    assert speedups == sorted(speedups) and speedups[0] > 1


def test_generation_adds_prefill_and_decode_steps():
    shape = DecodeShape(seq_len=32_000, heads=32, head_dim=128, kv_heads=8)
    gen = predict_generation(H100, shape, 8, "allreduce", new_tokens=10, layers=32)
    step = predict_decode(H100, shape, 8, "allreduce").predicted_seconds
    assert gen.decode_seconds == pytest.approx(32 * 10 * step, rel=1e-3)
    assert gen.prefill_seconds > 0
    assert gen.predicted_seconds == pytest.approx(gen.prefill_seconds + gen.decode_seconds)


# -------------------------------------------------------------------------------- bad input


def test_bad_parameters_are_rejected_with_names():
    with pytest.raises(ValueError, match="bandwidth"):
        Link(latency=1e-6, bandwidth=-1.0)
    with pytest.raises(ValueError, match="inter_bandwidth"):
        H100.with_overrides(inter_bandwidth=-5.0)
    with pytest.raises(ValueError, match="memory_efficiency"):
        H100.with_overrides(memory_efficiency=1.5)
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        predict_decode(H100, DecodeShape(seq_len=1000, heads=1, head_dim=8), 12, "tree")
    with pytest.raises(ValueError, match="seq_len .* must be >= gpus"):
        predict_decode(H100, DecodeShape(seq_len=4, heads=1, head_dim=8), 8, "ring-kv")
    with pytest.raises(ValueError, match="method must be one of"):
        predict_decode(H100, DecodeShape(seq_len=8, heads=1, head_dim=8), 8, "ring")
    with pytest.raises(ValueError, match="dtype"):
        DecodeShape(seq_len=8, heads=1, head_dim=8, dtype="int8")
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        DecodeShape(seq_len=8, heads=6, head_dim=8, kv_heads=4)
    with pytest.raises(ValueError, match="unknown cluster parameter"):
        H100.with_overrides(nvlink_speed=1.0)
    with pytest.raises(ValueError, match="preset must be one of"):
        load_cluster("tpu-v5")


def test_cpu_local_without_calibration_says_how_to_make_one(tmp_path):
    with pytest.raises(ValueError, match="treeattn bench calibrate"):
        load_cluster("cpu-local", tmp_path / "missing.json")


def test_cluster_round_trips_through_json(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"cluster": H100.with_overrides(host_cores=2, host_memory_bandwidth=1e10).to_dict()}))
    loaded = load_cluster("cpu-local", path)
    assert loaded == H100.with_overrides(host_cores=2, host_memory_bandwidth=1e10)


def test_busy_round_term_charges_each_round_on_a_shared_host(tmp_path):
    shape = DecodeShape(seq_len=16384, heads=16, head_dim=128, dtype="fp32")
    plain = flat_cluster(gpus_per_node=1 << 20, host_cores=2, host_memory_bandwidth=1e11)
    busy = plain.with_overrides(busy_round_p2p=((4, 2e-3),), busy_round_collective=((4, 5e-3),))
    # (p2p rounds, collective calls) charged per method at p = 4: the first round after the
    # attention, every ring-kv step
    charged = {"allreduce": (0, 1), "tree": (1, 0), "twolevel": (1, 0), "ring-kv": (3, 0), "ring-q": (1, 0), "local": (0, 0)}
    for method, (p2p, calls) in charged.items():
        base, extra = predict_decode(plain, shape, 4, method), predict_decode(busy, shape, 4, method)
        assert extra.predicted_seconds - base.predicted_seconds == pytest.approx(p2p * 2e-3 + calls * 5e-3, abs=1e-12), method
        assert (extra.bytes, extra.rounds, extra.steps) == (base.bytes, base.rounds, base.steps)
    # one rank has no rounds; p = 2 takes the nearest measured world size (4)
    assert busy.busy_round_seconds(1) == (0.0, 0.0) and busy.busy_round_seconds(2) == (2e-3, 5e-3)
    # an unmeasured world size takes the nearest measured one
    assert busy.busy_round_seconds(8) == (2e-3, 5e-3)
    assert busy.with_overrides(busy_round_p2p=((4, 1.0), (8, 3.0))).busy_round_seconds(7)[0] == 3.0
    # JSON stores the pairs as lists
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"cluster": busy.to_dict()}))
    assert load_cluster("cpu-local", path) == busy


def test_busy_next_round_term_charges_each_back_to_back_round():
    from treeattn.sim.model import rounds_after_attention

    shape = DecodeShape(seq_len=16384, heads=16, head_dim=128, dtype="fp32")
    first = flat_cluster(gpus_per_node=1 << 20, host_cores=2, host_memory_bandwidth=1e11).with_overrides(
        busy_round_p2p=((4, 2e-3),), busy_round_collective=((4, 5e-3),)
    )
    both = first.with_overrides(busy_next_round_p2p=((2, 7e-4), (4, 1e-3)), busy_next_round_collective=((4, 3e-3),))
    # further rounds issued back to back after the first, per method at p = 4 (p2p, collective):
    # allreduce: max then sum allreduce; tree: 2 reduce + 2 broadcast rounds; twolevel on one
    # host: 2 reduce rounds then one broadcast collective; ring-kv: every step follows attention
    further = {"allreduce": (0, 1), "tree": (3, 0), "twolevel": (1, 1), "ring-kv": (0, 0), "ring-q": (2, 0), "local": (0, 0)}
    for method, (p2p, calls) in further.items():
        base, extra = predict_decode(first, shape, 4, method), predict_decode(both, shape, 4, method)
        assert extra.predicted_seconds - base.predicted_seconds == pytest.approx(p2p * 1e-3 + calls * 3e-3, abs=1e-12), method
        kinds = rounds_after_attention(both, 4, method)
        assert sum(not follows for _, follows in kinds) == p2p + calls, method
    assert rounds_after_attention(both, 4, "ring-kv") == [("p2p", True)] * 3
    assert both.busy_next_round_seconds(2) == (7e-4, 3e-3) and both.busy_next_round_seconds(1) == (0.0, 0.0)
    assert load_cluster_roundtrip(both) == both
    with pytest.raises(ValueError, match="busy_next_round_p2p needs host_cores"):
        H100.with_overrides(busy_next_round_p2p=((4, 1e-3),))


def load_cluster_roundtrip(cluster):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cal.json"
        path.write_text(json.dumps({"cluster": cluster.to_dict()}))
        return load_cluster("cpu-local", path)


def test_gpu_presets_have_no_busy_round_term():
    for cluster in PRESETS.values():
        assert cluster.host_cores is None and cluster.busy_round_seconds(128) == (0.0, 0.0)
        assert cluster.busy_next_round_seconds(128) == (0.0, 0.0)
    with pytest.raises(ValueError, match="busy_round_p2p needs host_cores"):
        H100.with_overrides(busy_round_p2p=((16, 1e-3),))
    cpu = flat_cluster(host_cores=2, host_memory_bandwidth=1e11)
    with pytest.raises(ValueError, match=r"busy_round_collective\[p=4\]"):
        cpu.with_overrides(busy_round_collective=((4, -1.0),))
    with pytest.raises(ValueError, match="world_size >= 1, seconds"):
        cpu.with_overrides(busy_round_p2p=((0, 1.0),))


# -------------------------------------------------------------------------------------- CLI


def test_simulate_json_prints_one_line_per_method():
    result = CliRunner().invoke(
        app, ["simulate", "--preset", "dgx-h100", "--gpus", "128", "--seq-len", "5120000", "--heads", "16", "--head-dim", "128",
              "--json"]
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        assert {"method", "gpus", "seq_len", "predicted_seconds", "bytes", "rounds"} <= set(r)
        assert r["gpus"] == 128 and r["seq_len"] == 5_120_000 and r["predicted_seconds"] > 0


def test_cluster_flags_come_from_one_table():
    """Each CLUSTER_FLAGS entry is a `treeattn simulate` flag whose value reaches the Cluster scaled to SI
    units once; the model mode's flags are one group; the decorators' examples hold."""
    import doctest
    import inspect

    from treeattn.sim import cli as sim_cli
    from treeattn.sim import hardware
    from treeattn.sim.hardware import CLUSTER_FLAGS

    args = ["simulate", "--show-preset", "--json"]
    for f in CLUSTER_FLAGS:
        args += ["--" + f.name.replace("_", "-"), "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    raw = json.loads(result.output)
    for f in CLUSTER_FLAGS:
        link, _, part = f.key.partition("_")
        value = raw[link][part] if link in ("intra", "inter") else raw[f.key]
        assert value == f.scale and raw["sources"][f.key].startswith("override"), f
    params = inspect.signature(sim_cli.simulate).parameters
    assert [f.name for f in CLUSTER_FLAGS] == [n for n in params if n in {f.name for f in CLUSTER_FLAGS}]
    assert len(inspect.signature(sim_cli.simulate.__wrapped__.__wrapped__).parameters) == 19  # was 37 loose parameters
    for module in (hardware, sim_cli):
        assert doctest.testmod(module).failed == 0


def test_simulate_overrides_and_errors(tmp_path):
    runner = CliRunner()
    base = ["simulate", "-p", "16", "-n", "1000000", "-m", "ring-kv", "--json"]
    fast = json.loads(runner.invoke(app, base).stdout)
    slow = json.loads(runner.invoke(app, base + ["--inter-bw-gbs", "1"]).stdout)
    assert slow["predicted_seconds"] > fast["predicted_seconds"]
    bad = runner.invoke(app, base + ["--inter-bw-gbs", "-1"])
    assert bad.exit_code != 0 and "inter_bandwidth" in bad.output
    bad = runner.invoke(app, ["simulate", "-p", "12"])
    assert bad.exit_code != 0 and "multiple of gpus_per_node" in bad.output
    out = runner.invoke(app, ["simulate", "-p", "8", "-p", "16", "-n", "100000", "-n", "400000", "--plot", str(tmp_path),
                              "--json"])
    assert out.exit_code == 0, out.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "sim_dgx-h100_comm.png", "sim_dgx-h100_latency.png", "sim_dgx-h100_memory.png", "sim_dgx-h100_speedup.png"
    ]


@pytest.mark.parametrize("gpus", [8, 16, 64])
def test_onepass_is_one_collective_of_float64_state(gpus):
    """onepass: one allreduce of (B*Hq*(Dv+1) + 1) float64 values, half the latency steps of the
    two-collective allreduce, plus one host read; the all-gather alternative is p - 1 steps."""
    from treeattn.sim.model import allgather_combine, allreduce_combine, onepass_combine

    shape = DecodeShape(seq_len=1 << 20, heads=64, kv_heads=8, head_dim=128, dtype="bf16")
    one = predict_decode(H100, shape, gpus, "onepass")
    two = predict_decode(H100, shape, gpus, "allreduce")
    assert one.rounds == 1 and two.rounds == 2 and 2 * one.steps == two.steps
    packed = (shape.batch * shape.heads * (shape.dv + 1) + 1) * 8
    assert one.bytes == pytest.approx(2 * (gpus - 1) / gpus * packed)
    saved = allreduce_combine(H100, shape, gpus).seconds - onepass_combine(H100, shape, gpus).seconds - H100.host_read_seconds
    assert two.predicted_seconds - one.predicted_seconds == pytest.approx(saved)
    assert allgather_combine(H100, shape, gpus).rounds == gpus - 1


def test_units_read_as_people_write_them():
    from treeattn.sim.units import format_bytes, format_flops, format_memory, format_rate, format_seconds

    assert [format_bytes(16_510), format_bytes(512), format_bytes(2.5e9)] == ["16.5 KB", "512 B", "2.5 GB"]
    assert [format_memory(4e4 * 2**20), format_memory(80 * 2**30), format_memory(1536)] == ["39.1 GiB", "80 GiB", "1.5 KiB"]
    assert [format_seconds(0.0123), format_seconds(5e-6), format_seconds(3.4),
            format_seconds(0)] == ["12.3 ms", "5 us", "3.4 s", "0 s"]
    assert [format_rate(4.5e11), format_flops(9.89e14)] == ["450 GB/s", "989 TFLOP/s"]


def test_simulate_table_and_preset_print_human_units():
    import re

    from treeattn.sim import load_cluster

    runner = CliRunner()
    table = runner.invoke(app, ["simulate", "-p", "8", "-n", "5120000", "-n", "1000000000", "-m", "tree", "-m", "ring-kv"])
    assert table.exit_code == 0, table.output
    assert not re.search(r"\de[+-]\d", table.stdout)  # no 1.651e+04
    assert re.search(r"\d (KB|MB|GB) ", table.stdout) and re.search(r"\d (GiB|TiB) ", table.stdout)
    assert re.search(r"\d (us|ms|s) ", table.stdout) and "5,120,000" in table.stdout
    assert re.search(r"more than the 80 GiB of one dgx-h100", table.stderr)
    preset = runner.invoke(app, ["simulate", "--preset", "dgx-h100", "--show-preset"])
    assert preset.exit_code == 0, preset.output
    assert not re.search(r"\de[+-]\d", preset.stdout)
    for shown in ("3.35 TB/s", "989 TFLOP/s", "80 GiB", "80 %", "360 GB/s", "5 us"):
        assert shown in preset.stdout, shown
    raw = runner.invoke(app, ["simulate", "--preset", "dgx-h100", "--show-preset", "--json"])
    assert Cluster.from_dict(json.loads(raw.stdout)) == load_cluster("dgx-h100")
