"""The cost model says when the K/V cache cannot fit in the devices' memory."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from treeattn.cli import app
from treeattn.sim import PRESETS, DecodeShape, load_cluster, memory_shortfall, predict_decode

H100 = PRESETS["dgx-h100"]


def kv_bytes_per_device(n: int, p: int, heads: int = 16, head_dim: int = 128, element_bytes: int = 2) -> int:
    return 2 * (n // p) * heads * head_dim * element_bytes


@pytest.mark.parametrize("method", ["allreduce", "tree", "ring-kv", "local"])
def test_a_configuration_fits_when_its_peak_memory_does(method):
    p = 8
    # K/V shard ~60 % of a device: ring-kv holds two
    shard_fits = int(H100.memory_capacity * 0.6) // kv_bytes_per_device(p, p) * p
    for n in (shard_fits, 4 * shard_fits):
        prediction = predict_decode(H100, DecodeShape(seq_len=n, heads=16, head_dim=128), p, method)
        shortfall = memory_shortfall(H100, prediction)
        assert prediction.fits_memory is (shortfall is None) is (prediction.peak_memory_bytes <= H100.memory_capacity)
        if shortfall is not None:
            assert f"{method} p={p} N={n}" in shortfall and "of one dgx-h100 device" in shortfall
    small = predict_decode(H100, DecodeShape(seq_len=shard_fits, heads=16, head_dim=128), p, method)
    large = predict_decode(H100, DecodeShape(seq_len=4 * shard_fits, heads=16, head_dim=128), p, method)
    assert small.fits_memory is (method in ("allreduce", "tree")) and large.fits_memory is False


def test_ranks_on_one_host_share_its_memory():
    host = H100.with_overrides(host_cores=2, host_memory_bandwidth=1e10, memory_capacity=float(2**30))
    shape = DecodeShape(seq_len=3 * 2**30 // kv_bytes_per_device(1, 1) // 4, heads=16, head_dim=128)  # ~0.75 GiB of K/V
    one = predict_decode(host, shape, 1, "tree")
    assert one.fits_memory
    # ring-kv on 4 ranks: each holds its shard and the one in flight: 2 x 0.75 GiB in all
    ring = predict_decode(host, shape, 4, "ring-kv")
    assert not ring.fits_memory and "on 4 rank(s)" in memory_shortfall(host, ring)


def test_unknown_capacity_says_nothing():
    unknown = H100.with_overrides()
    object.__setattr__(unknown, "memory_capacity", None)
    prediction = predict_decode(unknown, DecodeShape(seq_len=10**12, heads=16, head_dim=128), 8, "tree")
    assert prediction.fits_memory is None and memory_shortfall(unknown, prediction) is None


def test_calibrated_cluster_takes_this_machines_memory(tmp_path):
    data = H100.with_overrides(host_cores=2, host_memory_bandwidth=1e10).to_dict()
    del data["memory_capacity"]  # calibration files written before the field existed
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"cluster": data}))
    assert load_cluster("cpu-local", path).memory_capacity > 0


def test_simulate_says_what_does_not_fit():
    result = CliRunner().invoke(app, ["simulate", "-p", "8", "-n", "5120000", "-n", "1000000000", "-m", "tree", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["fits_memory"] for r in rows] == [True, False]
    lines = [line for line in result.stderr.splitlines() if line.startswith("does not fit in memory:")]
    assert len(lines) == 1 and "tree p=8 N=1000000000" in lines[0] and "80 GiB of one dgx-h100 device" in lines[0]
    result = CliRunner().invoke(app, ["simulate", "-p", "8", "-n", "1000000000", "-m", "tree", "--memory-gib", "1024"])
    assert result.exit_code == 0 and "does not fit" not in result.output
