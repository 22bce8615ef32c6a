"""`treeattn generate` and `treeattn demo` on the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llama_checkpoints import VOCAB, make_checkpoint  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from treeattn.cli import app  # noqa: E402
from treeattn.engine.generate import generate  # noqa: E402
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
    assert len(report["timings"]["step_times_s"]) == 5
    assert sum(report["timings"]["step_times_s"]) == pytest.approx(report["timings"]["decode_s"])
    assert report["kv_bytes_per_rank"][0] > 0 and report["run"]["world_size"] == 1


def test_kv_cache_dtype_halves_the_kv_bytes_per_token_in_the_json(checkpoint, ids_file, expected):
    """--kv-cache-dtype bfloat16: the cache stores bfloat16 (half float32's bytes per token, reported
    with the dtype; fp8_e4m3 a quarter plus its scales); the greedy tokens are the model's own, which a bfloat16 rounding of the
    keys may
    legitimately change, so only their number is checked here (tests/test_kv_cache_dtype.py checks
    the attention exactly). An unknown dtype is refused before any work."""
    base = ["generate", str(checkpoint), "--prompt-ids", str(ids_file), "--max-new-tokens", "6", "--json"]
    reports = {}
    for kv in ("auto", "bfloat16", "fp8_e4m3"):
        result = runner.invoke(app, base + ["--kv-cache-dtype", kv])
        assert result.exit_code == 0, result.output
        reports[kv] = json.loads(result.stdout)
    assert reports["auto"]["kv_cache_dtype"] == "float32" and reports["bfloat16"]["kv_cache_dtype"] == "bfloat16"
    assert reports["auto"]["kv_bytes_per_token"] == 2 * reports["bfloat16"]["kv_bytes_per_token"] > 0
    assert reports["auto"]["generated_ids"] == expected and len(reports["bfloat16"]["generated_ids"]) == len(expected)
    # fp8: one byte per channel and a float32 scale per token and KV head: (D + 4) / (4 D) of float32's bytes
    D = load_model(checkpoint).config.head_dim
    assert reports["fp8_e4m3"]["kv_cache_dtype"] == "fp8_e4m3" and len(reports["fp8_e4m3"]["generated_ids"]) == len(expected)
    assert reports["fp8_e4m3"]["kv_bytes_per_token"] * 4 * D == reports["auto"]["kv_bytes_per_token"] * (D + 4)
    result = runner.invoke(app, base + ["--kv-cache-dtype", "fp8"])
    assert result.exit_code == 2 and "--kv-cache-dtype" in result.output


def test_stop_strings_end_the_text_before_them(checkpoint, ids_file, expected):
    """--stop STR (repeatable) ends a sequence at the token that completes STR and cuts the text
    before it, as the engine and the server do; a string that never appears changes nothing."""
    k = expected.index(expected[3])  # the first time the 4th token appears
    args = ["generate", str(checkpoint), "--prompt-ids", str(ids_file), "--max-new-tokens", "6", "--json"]
    result = runner.invoke(app, args + ["--stop", "never-said", "--stop", f"w{expected[3]}"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["generated_ids"] == expected[:k + 1] and report["finish_reason"] == "stop"
    assert report["text"].split() == [f"w{i}" for i in expected[:k]]
    plain = runner.invoke(app, args + ["--stop", "never-said"])
    assert json.loads(plain.stdout)["generated_ids"] == expected


def test_stop_strings_stream_the_text_holding_back_a_possible_start(checkpoint, ids_file, expected, monkeypatch):
    """With --stop the answer still streams to stdout token by token; the word that could begin the
    stop string is held back (it is written neither when it comes nor after, since the stop string
    completes), so stdout gets exactly the engine's text, cut before the stop string."""
    import treeattn.commands.console as console

    i = next(i for i in range(2, 5) if expected[i] not in expected[:i])  # a word the text has not had yet
    stop = f"w{expected[i]} w{expected[i + 1]}"
    writes: list[str] = []
    monkeypatch.setattr(console, "write_stdout", writes.append)
    args = ["generate", str(checkpoint), "--prompt-ids", str(ids_file), "--max-new-tokens", "6", "--stop", stop]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    assert report["generated_ids"] == expected[:i + 2] and report["finish_reason"] == "stop"
    assert writes[:i] == [t.split()[0] if j == 0 else " " + t.split()[0] for j, t in enumerate(f"w{e}" for e in expected[:i])]
    # token i adds " w<e_i>": the space goes out, "w<e_i>" (the stop string's start) is held; token i + 1 completes it: cut
    assert writes[i:] == [" ", "", "\n"]
    assert "".join(writes) == report["text"] + "\n" and stop not in report["text"]


def test_two_ranks_ring_decode_interleaved(checkpoint, ids_file, expected):
    result = runner.invoke(app, ["generate", str(checkpoint), "--prompt-ids", str(ids_file), "--max-new-tokens", "6", "--nproc",
                                 "2",
                                 "--decode", "ring", "--placement", "interleaved", "--block-size", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["generated_ids"] == expected
    assert report["run"] == {"world_size": 2, "decode": "ring", "method": "onepass", "prefill": "ring",
                             "placement": "interleaved"}
    assert len(report["kv_bytes_per_rank"]) == 2 and report["comm"]["bytes_per_token"] > 0


def test_default_method_is_one_round_per_layer(checkpoint, ids_file, expected):
    """The default combine (onepass) issues one round per layer per decode step; the two-collective
    allreduce 2 x layers (the engine's plan broadcast carries the tokens and is not counted); the
    greedy tokens are the same. The allreduce run also takes --no-shared-memory: its collectives go
    through gloo, with the same tokens and rounds (tests/test_shared_memory.py compares generate's
    tokens and rounds with and without shared memory on the default method; a run of its own here
    cost a 2-rank start)."""
    layers = load_model(checkpoint).config.num_layers
    reports = {}
    for extra in ([], ["--method", "allreduce", "--no-shared-memory"]):
        args = ["generate", str(checkpoint), "--prompt-ids", str(ids_file), "--max-new-tokens", "6", "--nproc", "2", "--json"]
        result = runner.invoke(app, args + extra)
        assert result.exit_code == 0, result.output
        reports[bool(extra)] = json.loads(result.stdout)
    default, two_round = reports[False], reports[True]
    steps = default["timings"]["decode_steps"]
    assert default["run"]["method"] == "onepass" and two_round["run"]["method"] == "allreduce"
    assert default["generated_ids"] == two_round["generated_ids"] == expected
    assert default["comm"]["decode_rounds_rank0"] == steps * layers
    assert two_round["comm"]["decode_rounds_rank0"] == two_round["timings"]["decode_steps"] * 2 * layers


def test_text_prompt_prints_text_and_a_summary(checkpoint, expected):
    prompt = " ".join(f"w{i}" for i in PROMPT)
    result = runner.invoke(app, ["generate", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "6", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == " ".join(f"w{i}" for i in expected)
    assert "time per token" in result.stderr and "KV cache per rank" in result.stderr and "comm per token" in result.stderr
    # the 6 tokens ran out before a stop token: the summary says the answer was cut and by which flag
    assert "the answer was cut at --max-new-tokens 6 (finish_reason length): raise it for a longer one" in result.stderr


def test_text_streams_to_stdout_and_plain_status_lines_to_a_piped_stderr(checkpoint, expected):
    """Two spawned ranks, stdout and stderr both pipes: stdout is exactly the answer (rank 0 writes it
    as it is decoded), stderr says what happens in plain lines: no escape codes, no spinner frames."""
    prompt = " ".join(f"w{i}" for i in PROMPT)
    out = subprocess.run([sys.executable, "-m", "treeattn", "generate", str(checkpoint), "--prompt", prompt, "--max-new-tokens",
                          "6",
                          "--nproc", "2"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout == " ".join(f"w{i}" for i in expected) + "\n"
    lines = out.stderr.splitlines()
    assert lines[0] == f"loading {checkpoint.name} on 2 rank(s) (starting them)"
    assert re.fullmatch(r"model loaded in \d+\.\d\d s", lines[1])
    assert f"prefill {len(PROMPT)} tokens on 2 rank(s), then up to 6 new tokens" in lines
    done = [i for i, line in enumerate(lines) if re.fullmatch(rf"prefill {len(PROMPT)}/{len(PROMPT)} tokens \(\d+\.\d\d s\)",
                                                              line)]
    # the one ring step's progress, layer by layer (the tiny model's 2 layers: a line after the first)
    within = [i for i,
              line in enumerate(lines) if re.fullmatch(rf"prefill 0/{len(PROMPT)} tokens, this step at layer 1/2 \(\d+\.\d\d s\)",
                                                       line)]
    assert len(done) == 1 and len(within) == 1 and within[0] < done[0], out.stderr
    assert "total wall time (whole command)" in out.stderr
    assert "\x1b" not in out.stderr and "\r" not in out.stderr
    assert not set(out.stderr) & set("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏") and "0:00:" not in out.stderr  # no spinner frames, no progress bars


def test_prefill_progress_is_reported_chunk_by_chunk(checkpoint):
    """on_prefill sees every chunk of a chunked prefill; the prompt's tokens found in the prefix cache count as done."""
    model = load_model(checkpoint)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    seen = []
    generate(model, prompt, max_new_tokens=2, prefill_chunk=16, block_size=8, on_prefill=lambda done,
             total: seen.append((done, total)))
    assert seen == [(16, 40), (32, 40), (40, 40)]
    seen.clear()  # two samples of one prompt: the second finds its full blocks in the prefix cache
    generate(model, prompt, max_new_tokens=2, prefill_chunk=64, block_size=8, num_samples=2,
             on_prefill=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (80, 80)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--prompt", "w1 w2"], "has no tokenizer"),
        (["--prompt-ids", "IDS", "--prompt", "w1"], "give exactly one of --prompt, --prompt-file, --prompt-ids"),
        (["--prompt-ids", "IDS", "--capacity", "12"],
         "prompt of 10 tokens \\+ --max-new-tokens 64 needs 74 positions, more than --max-context 12"),
        (["--prompt-ids", "IDS", "--stop", "x"], "--stop: .* has no tokenizer to find stop strings with; use --stop-id"),
        (["--prompt-ids", "BAD_IDS"], r"prompt 0: token id 100000 is outside the vocabulary \[0, 128\)"),
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
    """--device cpu --dtype auto (the defaults on a machine without CUDA, spelled out) give the tokens of
    the synthetic demo's reference with its defaults (float32 on the CPU)."""
    from treeattn.eval.synthetic import run_reference

    result = runner.invoke(app, ["demo", "--synthetic", "--context", "300", "--nproc", "2", "--new-tokens", "3",
                                 "--device", "cpu", "--dtype", "auto"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    for name in ("tree (onepass)", "ring (pass-KV)", "single process (local)"):
        assert name in text
    assert text.count("yes") == 3 and "NO" not in text
    assert "gloo ranks on cpu" in result.stderr and "float32" in result.stderr
    tokens = run_reference(context=300, new_tokens=3).result.generated_ids[0]
    assert f"Tokens: {tokens}" in " ".join(result.stderr.split())


def test_demo_takes_kv_cache_dtype_and_weight_format(monkeypatch):
    """`treeattn demo --kv-cache-dtype --weight-format` hands both to the runs (stand-ins that record them
    and stop, so no rank starts): the document demo both, the synthetic one the KV dtype."""
    import treeattn.eval.demo
    import treeattn.eval.synthetic

    seen = {}

    def record(**options):
        seen.update(options)
        raise ValueError("stand-in")

    monkeypatch.setattr(treeattn.eval.demo, "run_document_demo", lambda model, **options: record(**options))
    result = runner.invoke(app, ["demo", "--kv-cache-dtype", "float16", "--weight-format", "dequantize"])
    assert result.exit_code == 2 and "stand-in" in result.stderr
    assert seen["kv_cache_dtype"] == "float16" and seen["weight_format"] == "dequantize"
    assert seen["tp"] == 1  # the Helix layout by default (eval.demo.DEFAULT_TP; dequantized weights split on any nproc)
    for args, tp in ((["--nproc", "3", "--tp", "3"], 3), (["--sequence-only"], None)):
        seen.clear()
        assert runner.invoke(app, ["demo", *args]).exit_code == 2 and seen["tp"] == tp
    result = runner.invoke(app, ["demo", "--tp", "1", "--sequence-only"])
    assert result.exit_code == 2 and "give only one" in result.stderr
    seen.clear()
    monkeypatch.setattr(treeattn.eval.synthetic, "run_demo", record)
    result = runner.invoke(app, ["demo", "--synthetic", "--kv-cache-dtype", "bfloat16"])
    assert isinstance(result.exception, ValueError) and seen["kv_cache_dtype"] == "bfloat16"
    result = runner.invoke(app, ["demo", "--weight-format", "int4"])
    assert result.exit_code == 2 and "--weight-format" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-p", "0", "--temperature", "1"], r"--top-p must be a number in \(0, 1\], got 0.0"),
        (["--temperature", "inf"], r"--temperature must be a finite number >= 0 \(0 = greedy\), got inf"),
        (["--decode", "local", "--nproc", "2"],
         "--decode local runs on one rank, but --nproc 2; use --decode tree or --decode ring"),
        (["--max-context", "1000000000000"],
         r"^error: --max-context: 1 rank\(s\) x \([0-9.]+ KiB of weights \+ [0-9.]+ TiB of KV cache\) = "
                                          r"[0-9.]+ TiB, more than the [0-9.]+ GiB of memory of this machine$"),
        (["--max-new-tokens", "1000000000000", "--nproc", "2"],
         r"^error: --max-new-tokens: 2 rank\(s\) x \(.* TiB of KV cache\)"),
        (["--stop-id", "-3"], r"--stop-id must be a sequence of ints >= 0, got \(-3,\)"),
        (["--block-size", "0"], "--block-size must be an int >= 1, got 0"),
        (["--top-k", "-1"], r"--top-k must be an int >= 0 \(0 = all tokens\), got -1"),
    ],
)
def test_option_errors_are_one_line_before_any_rank_starts(checkpoint, ids_file, args, message):
    result = runner.invoke(app, ["generate", str(checkpoint), "--prompt-ids", str(ids_file), *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(message, lines[0]), lines[0]


def test_binary_prompt_file_is_named(checkpoint, tmp_path):
    path = tmp_path / "prompt.bin"
    path.write_bytes(bytes(range(256)))
    result = runner.invoke(app, ["generate", str(checkpoint), "--prompt-file", str(path)])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: --prompt-file {path}: not UTF-8 text (byte 0x80 at offset 128); a binary file? "
                                     f"Pass token ids with --prompt-ids")
    path.write_bytes(b"w1 w2\x00w3")
    result = runner.invoke(app, ["generate", str(checkpoint), "--prompt-file", str(path)])
    assert result.exit_code == 2 and "holds NUL bytes (offset 5)" in result.stderr
    path.write_bytes(b"\xff\xfe[1, 2]")
    result = runner.invoke(app, ["generate", str(checkpoint), "--prompt-ids", str(path)])
    assert result.exit_code == 2 and f"--prompt-ids {path}: cannot read a JSON list of token ids" in result.stderr


def test_ranks_beyond_the_memory_are_refused_and_beyond_the_cores_warned(checkpoint, ids_file, monkeypatch, capsys):
    from treeattn.engine import memory
    from treeattn.commands.generate import _check_before_spawning
    from treeattn.engine.config import EngineConfig
    from treeattn.engine.request import SamplingParams

    weights = (checkpoint / "model.safetensors").stat().st_size  # the weights, and a header of a few KiB
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: int(3.5 * weights))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    config, sampling = EngineConfig(block_size=4), SamplingParams(max_new_tokens=4)
    _check_before_spawning(config, sampling, 1, checkpoint, [PROMPT[:2]], 2, "float32")
    assert capsys.readouterr().err == ""
    _check_before_spawning(config, sampling, 1, checkpoint, [PROMPT[:2]], 3, "float32")
    err = " ".join(capsys.readouterr().err.split())
    assert "--nproc 3 ranks on 2 cores: they will time-share the cores" in err
    assert "--nproc 3 ranks for a 2-token prompt: some ranks start with no tokens" in err
    with pytest.raises(ValueError,
                       match=r"^nproc: 4 rank\(s\) x \(.* of weights \+ .* of KV cache\) = .*, more than the .* of memory of "
                             r"this machine$"):
        _check_before_spawning(config, sampling, 1, checkpoint, [PROMPT], 4, "float32")
    # under torchrun: the ranks of this machine (LOCAL_WORLD_SIZE) count, and only rank 0 warns
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    _check_before_spawning(config, sampling, 1, checkpoint, [PROMPT[:2]], 8, "float32")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    _check_before_spawning(config, sampling, 1, checkpoint, [PROMPT[:2]], 8, "float32")
    err = " ".join(capsys.readouterr().err.split())
    assert "--nproc 3 ranks on 2 cores" in err and "--nproc 8 ranks for a 2-token prompt" in err


def test_two_ranks_say_the_max_position_warning_once(checkpoint, tmp_path, ids_file, expected):
    """Also `python -m treeattn generate --prompt-ids --json` in a process of its own: the tokens, as JSON on
    stdout; and (python -X importtime) generate imports neither treeattn.bench nor treeattn.sim nor matplotlib."""
    directory = tmp_path / "short-positions"
    directory.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    config["max_position_embeddings"] = 8
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "treeattn", "generate", str(directory), "--prompt-ids",
                          str(ids_file), "--max-new-tokens", "6", "--nproc", "2", "--json", "--allow-beyond-context"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["generated_ids"] == expected
    # the engine's warning
    assert out.stderr.count("max_context=16 exceeds the model's max_position_embeddings=8") == 1, out.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "treeattn.engine.client" in imported  # importtime's lines were read (the Engine)
    assert sorted(m for m in imported if m.split(".")[:2] in (["treeattn", "bench"], ["treeattn",
                                                                                      "sim"]) or m == "matplotlib") == []


def test_a_broken_checkpoint_is_reported_once_before_spawning(checkpoint, tmp_path, ids_file):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "broken"
    directory.mkdir()
    (directory / "config.json").write_text((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, directory / "model.safetensors")
    result = runner.invoke(app, ["generate", str(directory), "--prompt-ids", str(ids_file), "--nproc", "2"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {directory}: missing 1 tensors, e.g. model.layers.1.mlp.up_proj.weight"
    ]
