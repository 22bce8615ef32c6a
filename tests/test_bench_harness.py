"""treeattn.bench.harness, the benchmark scripts' shared flags, timing and raw output: its docstring
examples run, and a script's parser spells the common flags as the `treeattn` commands do."""

from __future__ import annotations

import doctest
import json

import pytest

from treeattn.bench import harness


def test_docstring_examples_run():
    failures, tried = doctest.testmod(harness, optionflags=doctest.ELLIPSIS)
    assert tried >= 8 and failures == 0


def test_common_flags_and_a_sweep():
    p = harness.parser("x", model="required", nproc=[1, 2], kv_cache_dtype="auto", repeats=3)
    args = p.parse_args(["m", "--nproc", "4", "--kv-cache-dtype", "float8_e4m3"])
    assert (args.model, args.nproc, args.kv_cache_dtype, args.repeats) == ("m", [4], "float8_e4m3", 3)


def test_unknown_flag_and_bad_output_are_refused():
    with pytest.raises(ValueError, match="defaults: expected flags among"):
        harness.parser("x", world_size=2)
    with pytest.raises(ValueError, match="model: expected one of"):
        harness.parser("x", model="gguf")
    with pytest.raises(SystemExit):
        harness.parser("x").parse_args(["--output", "results.csv"])


def test_output_holds_the_command_and_the_machine(tmp_path):
    harness.write_output(tmp_path / "r.jsonl", [{"a": 1}, {"a": 2}])
    head, *rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert rows == [{"a": 1}, {"a": 2}] and "load_average" in head["machine"] and head["command"].startswith("python3")
    harness.write_output(tmp_path / "r.txt", None, text="| a |\n")
    assert (tmp_path / "r.txt").read_text().splitlines()[2] == "| a |"
    harness.write_output(None, [1])  # no --output: nothing written, no error
