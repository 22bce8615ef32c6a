"""`treeattn bench profile`: the per-rank split of a decode step, on real gloo ranks."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from treeattn.bench.profile import PHASES, ProfileSpec, run_profile, variant_name
from treeattn.cli import app
from treeattn.eval.synthetic import DEMO_CONFIG


@pytest.fixture(scope="module")
def two_ranks():
    # 2048 tokens: 1024 keys a rank, read run by run, so that the combine is timed on its own
    spec = ProfileSpec(model="demo", context=2048, new_tokens=5, methods=("allreduce", "onepass"), threads=1, warmup=1,
                       transports=("shm", "gloo"))
    reports = run_profile(spec, 2)
    # the shared-memory runs under the method's name, the gloo runs under "<method> gloo"
    return [
        {
            **{m: r[variant_name(m, "shm")] for m in spec.methods},
            **{f"{m} gloo": r[variant_name(m, "gloo")] for m in spec.methods},
        }
        for r in reports
    ]


def test_phases_add_up_to_the_step_on_every_rank(two_ranks):
    for report in two_ranks:
        for method in ("allreduce", "onepass", "allreduce gloo", "onepass gloo"):
            phases = report[method]["phases"]
            assert set(phases) == {*PHASES, "step"}
            assert all(phases[p] >= 0 for p in PHASES) and phases["step"] > 0
            assert sum(phases[p] for p in PHASES) == pytest.approx(phases["step"])
            assert phases["attention"] > 0 and phases["combine"] > 0 and phases["model"] > 0
    assert two_ranks[0]["onepass"]["phases"]["sampling"] > 0 and two_ranks[1]["onepass"]["phases"]["sampling"] == 0


def test_onepass_rounds_and_tokens_against_allreduce(two_ranks):
    layers = DEMO_CONFIG["num_layers"]
    for report in two_ranks:
        assert report["onepass"]["rounds_per_step"] == layers  # one collective a layer (the plan's broadcast is not counted)
        assert report["allreduce"]["rounds_per_step"] == 2 * layers
        assert report["onepass gloo"]["rounds_per_step"] == layers
        ids = two_ranks[0]["onepass"]["generated_ids"]
        assert all(report[name]["generated_ids"] == ids for name in ("allreduce", "onepass", "allreduce gloo", "onepass gloo"))


def test_cli_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["bench", "profile", "demo", "-p", "1", "--context", "32", "--new-tokens", "4",
                                      "--warmup", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "combine" in result.output
    records = json.loads(out.read_text())
    assert [(r["p"], r["rank"]) for r in records] == [(1, 0)] and records[0]["phases"]["combine"] == 0


def test_cli_refuses_an_unknown_method():
    result = CliRunner().invoke(app, ["bench", "profile", "demo", "-p", "1", "--method", "ring"])
    assert result.exit_code == 2 and "--method" in result.output


def test_cli_refuses_an_unknown_transport():
    result = CliRunner().invoke(app, ["bench", "profile", "demo", "-p", "1", "--transport", "nccl"])
    assert result.exit_code == 2 and "--transport" in result.output and "nccl" in result.output


def test_cli_refuses_cuda_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["bench", "profile", "demo", "-p", "1", "--device", "cuda"])
    assert result.exit_code == 2 and "--device cuda needs a CUDA device" in result.output, result.output


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cli_profiles_on_the_gpu(tmp_path):
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["bench", "profile", "demo", "-p", "1", "--device", "cuda", "--context", "64",
                                      "--max-new-tokens", "6", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists()
