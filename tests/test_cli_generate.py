"""`treeattn generate` and `treeattn demo` on the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from test_model import VOCAB, make_checkpoint  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from treeattn.cli import app  # noqa: E402
from treeattn.generate import generate  # noqa: E402
from treeattn.models import load_model  # noqa: E402

PROMPT = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(20)).tolist()
runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A llama checkpoint with a word-level tokenizer.json ("w0" ... "w127")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("cli") / "llama"
    make_checkpoint("llama", directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def expected(checkpoint):
    return generate(load_model(checkpoint), PROMPT, max_new_tokens=6).generated_ids[0]


@pytest.fixture
def ids_file(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(PROMPT))
    return path


def test_json_output_is_one_object_with_the_tokens(checkpoint, ids_file, expected):
    result = runner.invoke(app, ["generate", str(checkpoint), "--prompt-ids", str(ids_file), "--max-new-tokens", "6", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["prompt_tokens"] == len(PROMPT) and report["generated_ids"] == expected
    assert report["text"] == " ".join(f"w{i}" for i in expected)
    assert report["timings"]["decode_steps"] == 5 and report["timings"]["time_per_token_s"] > 0
    assert report["kv_bytes_per_rank"][0] > 0 and report["run"]["world_size"] == 1


def test_two_ranks_ring_decode_interleaved(checkpoint, ids_file, expected):
    result = runner.invoke(app, ["generate", str(checkpoint), "--prompt-ids", str(ids_file), "--max-new-tokens", "6", "--nproc", "2",
                                 "--decode", "ring", "--placement", "interleaved", "--block-size", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["generated_ids"] == expected
    assert report["run"] == {"world_size": 2, "decode": "ring", "method": "allreduce", "prefill": "ring", "placement": "interleaved"}
    assert len(report["kv_bytes_per_rank"]) == 2 and report["comm"]["bytes_per_token"] > 0


def test_text_prompt_prints_text_and_a_summary(checkpoint, expected):
    prompt = " ".join(f"w{i}" for i in PROMPT)
    result = runner.invoke(app, ["generate", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "6", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == " ".join(f"w{i}" for i in expected)
    assert "time per token" in result.stderr and "KV cache per rank" in result.stderr and "comm per token" in result.stderr


def test_python_dash_m_works(checkpoint, ids_file, expected):
    out = subprocess.run([sys.executable, "-m", "treeattn", "generate", str(checkpoint), "--prompt-ids", str(ids_file),
                          "--max-new-tokens", "6", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["generated_ids"] == expected


@pytest.mark.parametrize(
    "args, match",
    [
        (["--prompt", "w1 w2"], "no tokenizer.json"),
        (["--prompt-ids", "IDS", "--prompt", "w1"], "give exactly one of --prompt, --prompt-file, --prompt-ids"),
        (["--prompt-ids", "IDS", "--capacity", "12"], "prompt of 10 tokens \\+ --max-new-tokens 64 does not fit in --capacity 12"),
        (["--prompt-ids", "BAD_IDS"], "outside the model's vocabulary"),
    ],
)
def test_bad_input_exits_with_a_clear_message(checkpoint, tmp_path, ids_file, args, match):
    import re

    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes((checkpoint / name).read_bytes())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([1, 2, 100000]))
    args = [str(ids_file) if a == "IDS" else str(bad) if a == "BAD_IDS" else a for a in args]
    result = runner.invoke(app, ["generate", str(directory), *args])
    assert result.exit_code == 2
    assert re.search(match, " ".join(result.stderr.split())), result.stderr


def test_missing_model_directory(tmp_path, ids_file):
    result = runner.invoke(app, ["generate", str(tmp_path / "missing"), "--prompt-ids", str(ids_file)])
    assert result.exit_code == 2 and "not a directory" in result.stderr


def test_demo_runs_tree_and_ring_and_checks_them(tmp_path):
    result = runner.invoke(app, ["demo", "--context", "300", "--nproc", "2", "--new-tokens", "3"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    for name in ("tree (allreduce)", "ring (pass-KV)", "single process (local)"):
        assert name in text
    assert text.count("yes") == 3 and "NO" not in text
