"""One vocabulary across the commands (treeattn.cli, treeattn.commands.flags); no command runs here.

- every option of every command has help, and bool flags show no type;
- one name per concept: no visible --world-size, --gpus, --new-tokens, --capacity, -p; the
  engine's flags carry the choices, defaults and docs of its configuration's fields;
- the old spellings still work as hidden aliases (rewritten before parsing);
- a usage error is one `error:` line on stderr with exit status 2.
"""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from treeattn.cli import ALIASES, app, rewrite_aliases
from treeattn.engine.config import EngineConfig
from treeattn.engine.request import SamplingParams
from treeattn.commands.flags import DTYPES, config_flag, field_help

runner = CliRunner()

COMMANDS = [["generate"], ["serve"], ["chat"], ["demo"], ["simulate"], ["eval", "needle"], ["bench", "decode"],
            ["bench", "calibrate"],
            ["bench", "validate"], ["bench", "plot"], ["bench", "profile"], ["linearize"]]
RETIRED = {"--world-size", "--gpus", "--new-tokens", "--capacity", "--model", "-p"}


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    out = {}
    for command in COMMANDS:
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0, result.output
        out[" ".join(command)] = result.output
    return out


def _options(command: list[str]):
    import typer

    group = typer.main.get_command(app)
    ctx = group.make_context("treeattn", [*command, "--help"], resilient_parsing=True)
    cmd = group
    for name in command:
        cmd = cmd.get_command(ctx, name)
    return [p for p in cmd.params if p.param_type_name == "option"]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_option_has_help_and_no_retired_spelling_is_shown(helps, command):
    for option in _options(command):
        assert option.help, f"treeattn {' '.join(command)} {option.opts[0]} has no help"
        assert not RETIRED & {*option.opts, *option.secondary_opts}, f"treeattn {' '.join(command)} still has {option.opts}"
    text = helps[" ".join(command)]
    assert "<bool>" not in text and "╭" not in text



def test_json_is_a_switch_and_a_results_file_is_output():
    """--json prints one JSON object on stdout in every command (never a file name); a file of
    results is --output PATH (benchmarks/*.py spell it so too, tests/test_benchmark_flags.py)."""
    switches = outputs = 0
    for command in COMMANDS:
        for option in _options(command):
            if "--json" in option.opts:
                assert option.is_flag, f"treeattn {' '.join(command)} --json takes a value; name a results file --output"
                switches += 1
            if "--output" in option.opts:
                assert not option.is_flag, f"treeattn {' '.join(command)} --output takes no PATH"
                outputs += 1
    assert switches >= 3 and outputs >= 3

def test_engine_flags_come_from_the_configuration(helps):
    generate, serve = helps["generate"], helps["serve"]
    for text in (generate, serve):
        assert "--decode <local|tree|ring>" in text and "--placement <contiguous|interleaved>" in text
    for text in (generate, serve, helps["demo"], helps["eval needle"], helps["bench profile"]):  # every command that runs a model
        assert "--dtype <auto|" + "|".join(DTYPES) + ">" in text and "--device <auto|cpu|cuda>" in text
    assert " ".join(field_help(EngineConfig, "max_batch_size").split()) in " ".join(serve.split())
    option = config_flag(EngineConfig, "block_size")
    assert option.default == 256 and option.param_decls == ("--block-size",)
    assert config_flag(EngineConfig, "prefix_cache").param_decls == ("--prefix-cache/--no-prefix-cache",)
    for cls in (EngineConfig, SamplingParams):  # every field is documented, so every flag gets help
        for field in dataclasses.fields(cls):
            assert field_help(cls, field.name)


def test_old_spellings_are_rewritten():
    assert rewrite_aliases(["simulate", "-p", "8", "--gpus=16"]) == ["simulate", "--nproc", "8", "--nproc=16"]
    assert rewrite_aliases(["demo", "--model", "m.gguf", "--new-tokens", "3"]) == ["demo", "m.gguf", "--max-new-tokens", "3"]
    assert rewrite_aliases(["generate", "M", "--capacity", "12"]) == ["generate", "M", "--max-context", "12"]
    assert rewrite_aliases(["generate", "M", "--no-stop"]) == ["generate", "M", "--ignore-eos"]
    assert rewrite_aliases(["bench", "decode", "--threads-per-rank", "2"]) == ["bench", "decode", "--threads", "2"]
    assert rewrite_aliases(["serve", "-p", "2"]) == ["serve", "-p", "2"]  # only the commands that spelled it so
    assert rewrite_aliases(["serve", "M", "--speculate", "none", "--speculate=none"]) == ["serve", "M"]  # the default's old name
    assert set(ALIASES) <= {" ".join(c).split()[0] for c in COMMANDS}


def test_usage_errors_are_one_line():
    for args in (["generate", "model", "--nope"], ["serve"], ["simulate", "--dtype", "fp8"], ["generate", "m", "--decode", "x"]):
        result = runner.invoke(app, args)
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    result = runner.invoke(app, ["simulate", "--dtype", "bf16", "-p", "8", "-n", "1000", "--json"])
    assert result.exit_code == 0, result.output  # an old spelling of a value and of a flag


def field_flags() -> dict[str, dict[str, list[str]]]:
    """EngineConfig / SamplingParams field -> {visible flag: the commands that use it}, over every
    command: an option is a field's when its parameter is named after the field or its flag is the
    field's (flags.flag_of)."""
    from treeattn.commands.flags import flag_of

    fields = [f.name for cls in (EngineConfig, SamplingParams) for f in dataclasses.fields(cls)]
    found: dict[str, dict[str, list[str]]] = {}
    for command in COMMANDS:
        for option in _options(command):
            for field in fields:
                if option.name == field or flag_of(field) in option.opts:
                    for flag in (o for o in option.opts if o.startswith("--")):  # a one-letter short form (-m) is no second name
                        found.setdefault(field, {}).setdefault(flag, []).append(" ".join(command))
    return found


def test_one_flag_per_configuration_field_in_every_command():
    """No two names for one concept: every command that sets a field of EngineConfig or
    SamplingParams spells it as flags.flag_of(field) and nothing else."""
    from treeattn.commands.flags import flag_of

    found = field_flags()
    assert {"nproc", "max_new_tokens", "device", "threads_per_rank", "placement", "dtype"} <= set(found)
    for field, flags in found.items():
        assert set(flags) == {flag_of(field)}, f"{field} has several names: {flags}"
    # one spelling of the values too: torch's names (bf16 & co. are hidden aliases)
    for command in (c for c in COMMANDS if any("--dtype" in o.opts for o in _options(c))):
        (option,) = [o for o in _options(command) if "--dtype" in o.opts]
        assert option.metavar in ("<auto|float32|bfloat16|float16>", "<float32|bfloat16|float16>"), (command, option.metavar)
