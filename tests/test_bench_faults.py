"""`treeattn bench` under faults: a failing case is a row, the rest still run and are written;
output paths, the backend and the memory are checked before anything runs; bad files get one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from itertools import product
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import treeattn.parallel as par
from treeattn.bench import runner
from treeattn.bench.config import SweepConfig
from treeattn.bench.runner import check_resources, run_decode_sweep, write_records
from treeattn.cli import app

cli = CliRunner()
TINY = dict(world_sizes=(2,), heads=2, head_dim=8, warmup=0, repeats=1, timeout=30.0)


# ------------------------------------------------------------------ a case fails, the sweep goes on


def flaky_rank(rank: int, world_size: int, config_json: str, records_path: str, faults: dict) -> list[dict] | None:
    """runner.run_rank, except that the cases in `faults` ("N/method" -> "raise") raise on every rank."""
    run_case = runner.run_case

    def failing_case(config, rank, world_size, seq_len, method):
        if faults.get(f"{seq_len}/{method}") == "raise":
            raise RuntimeError(f"injected failure at N={seq_len} {method}")
        return run_case(config, rank, world_size, seq_len, method)

    runner.run_case = failing_case
    return runner.run_rank(rank, world_size, config_json, records_path)


def flaky_launcher(faults: dict):
    def launch(config: SweepConfig, world_size: int, records_path: str) -> list[dict]:
        return par.spawn(flaky_rank, world_size, config.to_json(), records_path, faults, timeout=config.timeout)[0]

    return launch


def test_a_failed_case_is_a_record_and_the_later_cases_still_run(tmp_path):
    config = SweepConfig(methods=("allreduce", "tree"), seq_lens=(32, 48), **TINY)
    faults = {"32/tree": "raise"}
    path = tmp_path / "records.jsonl"
    records = run_decode_sweep(config, path, launcher=flaky_launcher(faults))
    assert [(r["seq_len"], r["method"]) for r in records] == list(product((32, 48), ("allreduce", "tree")))
    failed = {f"{r['seq_len']}/{r['method']}": r["error"] for r in records if "error" in r}
    assert set(failed) == set(faults)
    assert (
        failed["32/tree"].startswith("SpawnError: rank ") and "RuntimeError: injected failure at N=32 tree" in failed["32/tree"]
    )
    assert "\n" not in failed["32/tree"]
    for r in records:
        assert ("error" in r) == ("median_seconds" not in r)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records  # the file has every case too


def test_remaining_cases_after_a_failure_cover_the_rest_in_order():
    config = SweepConfig(methods=("allreduce", "tree", "ring-q"), seq_lens=(8, 16, 32), **TINY)
    cases = runner._cases(config)
    for k in range(len(cases) + 1):
        rest = [case for part in runner._after(config, k) for case in runner._cases(part)]
        assert rest == cases[k:]


# ---------------------------------------------------------------------------------------- the CLI


def test_bench_decode_writes_every_case_and_exits_1_when_one_failed(tmp_path, monkeypatch):
    def launch(config: SweepConfig, world_size: int, records_path: str) -> list[dict]:
        done = []
        for seq_len, method in runner._cases(config):
            if seq_len == 48:
                raise par.SpawnError({1: "ValueError: injected\nTraceback ..."}, {})
            record = {"method": method, "gpus": world_size, "seq_len": seq_len, "median_seconds": 1e-3, "p10_seconds": 1e-3,
                      "p90_seconds": 1e-3, "bytes": 10, "rounds": 2, "by_op_per_rank": [], "peak_memory_bytes": None}
            with open(records_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            done.append(record)
        return done

    monkeypatch.setattr(runner, "spawn_launcher", launch)
    out_json, out_csv = tmp_path / "out" / "r.json", tmp_path / "out" / "r.csv"
    result = cli.invoke(app, ["bench", "decode", "-m", "tree", "-n", "32", "-n", "48", "-n", "64", "-o", str(out_json), "-o",
                              str(out_csv)])
    assert result.exit_code == 1, result.output
    records = json.loads(out_json.read_text())
    assert [(r["seq_len"], "error" in r) for r in records] == [(32, False), (48, True), (64, False)]
    assert records[1]["error"] == "SpawnError: rank 1: ValueError: injected"
    header = out_csv.read_text().splitlines()[0].split(",")
    assert "error" in header and "median_seconds" in header
    assert "1 of 3 cases failed; first: tree p=2 N=48: SpawnError: rank 1: ValueError: injected" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args, expected", [
    (["decode", "-o", "out.txt"], "--output out.txt: expected a .json or .csv file"),
    (["decode", "-o", "/proc/none/r.json"], "--output /proc/none/r.json: cannot create folder"),
    (["decode", "--plot", "/proc/none"], "--plot /proc/none: cannot create folder"),
    (["calibrate", "-o", "/proc/none/c.json"], "--output /proc/none/c.json: cannot create folder"),
    (["validate", "--markdown", "table.txt"], "--markdown table.txt: expected a .md file"),
    (["decode", "-n", "1000000000"], "--seq-len 1000000000: the K/V cache needs"),
])
def test_bad_outputs_and_impossible_sizes_are_refused_before_running(args, expected, monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("ran although the arguments were bad")

    monkeypatch.setattr("treeattn.bench.cli.run_with_progress", must_not_run)
    monkeypatch.setattr("treeattn.bench.calibrate.write_calibration", must_not_run)
    result = cli.invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"]  # one line
    assert expected in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_nccl_without_cuda_is_refused_naming_the_option():
    result = cli.invoke(app, ["bench", "decode", "--backend", "nccl", "-n", "64"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --backend nccl needs one CUDA device per rank") and result.stderr.count("\n") == 1


def test_check_resources_counts_both_ring_kv_shards():
    config = SweepConfig(methods=("tree",), world_sizes=(2,), seq_lens=(1024,), heads=4, head_dim=8)
    kv = 2 * 1024 * 4 * 8 * 4  # K and V, fp32
    check_resources(config, memory_bytes=kv)
    with pytest.raises(ValueError, match="--seq-len 1024"):
        check_resources(config, memory_bytes=kv - 1)
    ring = SweepConfig(methods=("tree", "ring-kv"), world_sizes=(2,), seq_lens=(1024,), heads=4, head_dim=8)
    with pytest.raises(ValueError, match="twice for ring-kv"):
        check_resources(ring, memory_bytes=kv)


@pytest.mark.parametrize("content, expected", [
    (None, "no such file"),
    ("not json", "not JSON"),
    ('{"rows": []}', 'an object without a "records" list'),
    ("[]", "expected a non-empty list"),
    ('[{"method": "tree", "gpus": 2}]', "record 0 has no seq_len, median_seconds"),
    ('[{"method": "tree", "gpus": 2, "seq_len": "long", "median_seconds": 1}]', "record 0: seq_len must be a number"),
])
def test_bench_plot_refuses_bad_files_in_one_line(tmp_path, content, expected):
    path = tmp_path / "records.json"
    if content is not None:
        path.write_text(content)
    result = cli.invoke(app, ["bench", "plot", str(path), "--plot", str(tmp_path / "figures")])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: RECORDS {path}: ") and result.stderr.count("\n") == 1
    assert expected in result.stderr


def test_plots_and_csv_leave_failed_cases_out(tmp_path):
    ok = {"method": "tree", "gpus": 2, "seq_len": 64, "median_seconds": 1e-3, "bytes": 8, "peak_memory_bytes": 2**20}
    records = [ok, {**ok, "seq_len": 128}, {"method": "tree", "gpus": 2, "seq_len": 256, "error": "SpawnError: rank 0: boom"}]
    from treeattn.sim.plots import make_figures

    paths = make_figures(records, tmp_path, "t", "median_seconds", "title")
    assert all(p.exists() for p in paths) and len(paths) == 3  # latency, memory, comm
    write_records(records, tmp_path / "r.csv")
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[0].split(",")[-1] == "error" and lines[3].endswith("SpawnError: rank 0: boom")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_keeps_the_finished_cases_and_leaves_no_rank_or_temp_dir(tmp_path):
    from helpers.processes import SRC, alive, descendants, wait_for_ranks, wait_gone

    # TMPDIR short: the fork server's Unix socket goes there (at most 107 bytes; pytest's tmp_path is too deep once its
    # run counter reaches three digits)
    tmp = Path(tempfile.mkdtemp(prefix="ta-"))
    out = tmp_path / "records.json"
    lengths = [str(n) for n in range(64, 64 + 400)]
    command = [sys.executable, "-m", "treeattn", "bench", "decode", "-m", "tree", "-p", "2", "--heads", "2", "--head-dim", "8",
               "--warmup", "0", "--repeats", "1", "-o", str(out), *[x for n in lengths for x in ("-n", n)]]
    parent = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        ranks += wait_for_ranks(parent, 2)
        time.sleep(2.0)
        started = descendants(parent.pid)  # the ranks, and the fork server that started them
        parent.send_signal(signal.SIGTERM)
        _, err = parent.communicate(timeout=30)
        assert parent.returncode == 130, err[-2000:]
        assert not wait_gone(ranks + started, 10.0)
        records = json.loads(out.read_text())
        assert "interrupted: keeping the" in err and len(records) < len(lengths)
        assert [r["seq_len"] for r in records] == [int(n) for n in lengths[: len(records)]]
        assert list(tmp.iterdir()) == []
    finally:
        for pid in [parent.pid, *ranks, *descendants(parent.pid)]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait()
        shutil.rmtree(tmp, ignore_errors=True)
