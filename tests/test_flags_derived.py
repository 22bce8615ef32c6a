"""The command line derived from the configuration (issue 53): flags.config_options gives a command one
flag per named EngineConfig / SamplingParams field, with the field's default, help and choices, and
hands the command their values as one dict. No model is loaded: the commands' signatures are read."""

from __future__ import annotations

import dataclasses
import inspect

import typer
from typer.testing import CliRunner

from treeattn.engine.config import EngineConfig
from treeattn.commands.flags import FLAG_TYPES, config_options, field_help
from treeattn.engine.request import SamplingParams


def test_a_decorated_command_gets_one_flag_per_field_and_their_values_as_one_dict():
    seen = {}

    @config_options(EngineConfig, ["decode", "block_size", "kv_store"], into="engine")
    def command(name: str = typer.Option("x", "--name"), engine: dict | None = None) -> None:
        seen.update(name=name, engine=engine)

    app = typer.Typer()
    app.command()(command)
    result = CliRunner().invoke(app, ["--decode", "ring", "--kv-store", "/tmp/store"])
    assert result.exit_code == 0, result.output
    assert seen == {"name": "x", "engine": {"decode": "ring", "block_size": EngineConfig.block_size, "kv_store": "/tmp/store"}}
    result = CliRunner().invoke(app, ["--decode", "pipe"])  # the field's choices, from the tuple the config checks
    assert result.exit_code == 2 and "--decode" in result.output


def _options(command) -> dict:
    app = typer.Typer()
    app.command()(command)
    return {p.name: p for p in typer.main.get_command(app).params if p.param_type_name == "option"}


def test_generate_serve_and_chat_take_their_engine_flags_from_the_fields():
    from treeattn.commands.chat import CHAT_ENGINE_FLAGS, chat_command
    from treeattn.commands.generate import ENGINE_FLAGS, SAMPLING_FLAGS, generate_command
    from treeattn.serve.cli import SERVE_ENGINE_FLAGS, serve_command

    engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for command, names in ((generate_command, ENGINE_FLAGS), (serve_command, SERVE_ENGINE_FLAGS), (chat_command,
                                                                                                   CHAT_ENGINE_FLAGS)):
        options = _options(command)
        for name in names:
            assert name in options and name in FLAG_TYPES, (command.__name__, name)
            if name not in ("nproc", "max_context"):  # each command says what its ranks are; generate sizes max_context
                assert options[name].help == field_help(EngineConfig, name), (command.__name__, name)
            if name not in ("nproc", "stop_token_ids", "stop"):
                assert options[name].default == engine_fields[name].default, (command.__name__, name)
    assert set(SAMPLING_FLAGS) <= set(_options(generate_command))
    assert len(inspect.signature(generate_command.__wrapped__.__wrapped__).parameters) == 14  # was 42 loose parameters
    assert {f.name for f in dataclasses.fields(SamplingParams)} >= set(SAMPLING_FLAGS)
