"""Command-line flags derived from the configuration they fill: one name, type, choice list, default and help per concept.

    decode: Decode = config_flag(EngineConfig, "decode")       # --decode <tree|ring|local>, help from the field's docs
    top_p: float = config_flag(SamplingParams, "top_p")        # --top-p, default 1.0, help from SamplingParams
    dtype: str = dtype_flag()                                  # --dtype <auto|float32|bfloat16|float16>

A flag is named after its field (block_size -> --block-size; a bool field gives --name/--no-name),
its default is the field's, its choices are the tuple the field is checked against (the parameter's
annotation, Decode, Method, ...: Literal types of the same tuples EngineConfig validates with), and its help is the field's entry
in the class
docstring's "Attributes:" section. `treeattn generate`, `serve`, `chat`, `demo`, `eval needle`, `eval ruler` and `bench profile`
take their engine flags
(EngineConfig) and sampling flags (SamplingParams) from here, so a concept has one flag everywhere. Old spellings stay accepted
as hidden aliases:
treeattn.cli rewrites them (ALIASES) before the command parses its arguments. A configuration error
reaches the user in flag words (cli_message: "top_p must ..." -> "--top-p must ..."); device_and_dtype
resolves --device and --dtype auto the same way for every command.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from pathlib import Path
from typing import Literal

import typer

from treeattn.cache.placement import PLACEMENTS
from treeattn.engine.config import KV_CACHE_DTYPES
from treeattn.engine.device import DEVICES
from treeattn.engine.request import MAX_LOGPROBS
from treeattn.engine.config import PREFILL_KINDS, RING_ROWS_PER_RANK
from treeattn.engine.speculate import MAX_DRAFT_TOKENS, SPECULATE_KINDS
from treeattn.engine.config import DECODE_STEPS
from treeattn.models.attention import DECODE_KINDS
from treeattn.models.packed import WEIGHT_FORMATS
from treeattn.ops.packed_linear import ACTIVATION_FORMATS, PREFILL_DTYPES
from treeattn.parallel.tree_decode import METHODS

DTYPES = ("float32", "bfloat16", "float16")
"""Model dtypes on the command line, spelled as torch spells them (torch.bfloat16)."""

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
"""Short spellings accepted for --dtype (not listed in the help)."""

# The choice lists of the command line: the tuples the configuration itself checks against.
Decode = Literal[DECODE_KINDS]
Method = Literal[METHODS]
Placement = Literal[PLACEMENTS]
Prefill = Literal[PREFILL_KINDS]
Speculate = Literal[SPECULATE_KINDS]
DecodeStep = Literal[DECODE_STEPS]
KvCacheDtype = Literal[KV_CACHE_DTYPES]
WeightFormat = Literal[WEIGHT_FORMATS]
ActivationFormat = Literal[ACTIVATION_FORMATS]
PrefillDtype = Literal[PREFILL_DTYPES]
Device = Literal[DEVICES]


# The command line's type of every field a command takes as a flag: the one definition config_options
# reads (choices: the tuples the configuration itself checks against; a path field: a Path).
FLAG_TYPES = {
    "nproc": int | None, "tp": int | None, "decode": Decode, "method": Method | None, "placement": Placement,
    "max_batch_size": int, "cache_tokens": int | None, "prefix_cache": bool, "block_size": int, "prefill_chunk": int,
    "prefill": Prefill, "kv_cache_dtype": KvCacheDtype, "weight_format": WeightFormat,
    "activation_format": ActivationFormat, "prefill_dtype": PrefillDtype, "device": Device,
    "timeout_s": float, "threads_per_rank": int | None, "speculate": Speculate | None, "draft_tokens": int,
    "draft_model": Path | None, "shared_memory": bool, "decode_step": DecodeStep, "max_context": int | None,
    "linear_maps": Path | None, "kv_store": Path | None, "kv_store_bytes": int,
    "max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
    "stop_token_ids": list[int], "stop": list[str], "ignore_eos": bool,
}
# Bounds and spellings of a field's flag that are the same in every command (config_flag's keywords).
FLAG_OPTIONS = {
    "nproc": {"min": 1}, "tp": {"min": 1}, "prefill_chunk": {"min": 1}, "max_context": {"min": 1},
    "threads_per_rank": {"min": 1, "flag": "--threads"}, "kv_store_bytes": {"min": 1}, "max_new_tokens": {"min": 1},
    "max_batch_size": {"min": 1}, "cache_tokens": {"min": 1},
    "timeout_s": {"min": 0.001, "max": 1e6, "flag": "--timeout"},
    "stop_token_ids": {"flag": "--stop-id", "default": [],
                       "help": "Token id that ends a sequence (repeatable), besides the model's eos ids."},
    "stop": {"default": [],
             "help": "String that ends a sequence (repeatable): the text is cut before it (needs the model's tokenizer)."},
}


MODEL_HELP = "A .gguf file or a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)"
"""The model argument's help, the same words in every command (a command adds what it needs of the model)."""


def model_argument(needs: str = "", default=...):
    """The MODEL positional argument: MODEL_HELP, then `needs` (e.g. " with a chat template.")."""
    return typer.Argument(default, metavar="MODEL", help=MODEL_HELP + (needs or "."))


# Help of the fields whose documentation's first sentence speaks of the code (a constant's name, a class):
# the command line says the same in a user's words.
FLAG_HELP = {
    "method": 'How tree decoding combines the ranks\' partial results: "onepass" (the default: one collective per layer; '
              'allreduce with static decode steps), '
              '"allreduce" (two), "tree" (send/recv over a binary tree) or "twolevel" (inside each node, then across nodes).',
    "prefill_chunk": "Prompt tokens per step at most (chunked prefill) while some sequence decodes; with no sequence decoding, "
                     f"ring prefill steps take up to {RING_ROWS_PER_RANK} tokens per rank.",
    "draft_tokens": f"The most tokens drafted per sequence per step, 1 to {MAX_DRAFT_TOKENS}.",
    "draft_model": 'With --speculate draft (and only then): the draft model\'s checkpoint (a .gguf file or a Hugging Face '
                   'directory of the same tokenizer), loaded on every rank in the model\'s dtype.',
    "logprobs": f"None, or k in [0, {MAX_LOGPROBS}]: every generated token comes with its log-probability and the k most likely "
                f"tokens with theirs.",
}
_MODULE_NOTE = re.compile(r"\s*\(treeattn\.[\w.]+\)|(?<=\()treeattn\.[\w.]+[:;,] |[:;,] treeattn\.[\w.]+(?=\))")


def field_help(cls, name: str) -> str:
    """The first sentence of field `name`'s entry in the "Attributes:" section of `cls`'s docstring,
    on one line (an entry may name several fields: "temperature, top_k, top_p: ..."), without the
    module names it cites for a reader of the code (FLAG_HELP replaces the entries that need more)."""
    if name in FLAG_HELP:
        return FLAG_HELP[name]
    doc = (cls.__doc__ or "").split("Attributes:", 1)[-1]
    entries = re.split(r"\n {8}(?=[a-z_][a-z_0-9, ]*:)", "\n" + doc)
    for entry in entries:
        head, _, text = entry.partition(":")
        if name in [n.strip() for n in head.split(",")]:
            text = " ".join(text.split())
            first = re.split(r"(?<=[.)])\s+(?=[A-Z\"])", text, maxsplit=1)[0]
            return _MODULE_NOTE.sub("", first)
    raise ValueError(f"{cls.__name__} documents no field {name!r} under Attributes")


def config_flag(cls, name: str, *, flag: str | None = None, help: str | None = None, default=dataclasses.MISSING, **options):
    """A typer.Option for field `name` of the dataclass `cls`: `flag` (default --name; --name/--no-name
    for a bool), the field's default and its docs as help; `options` go to typer.Option. The choices
    come from the parameter's annotation (Decode, Method, ...)."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if default is dataclasses.MISSING:
        default = field.default
    flag = flag or "--" + name.replace("_", "-")
    decls = [f"{flag}/--no-{flag.removeprefix('--')}"] if isinstance(default, bool) else [flag]
    return typer.Option(default, *decls, help=help or field_help(cls, name), **options)


def config_options(cls, names, *, into: str, **changed):
    """Decorator: the command takes one flag per field of `cls` in `names` (FLAG_TYPES's type, the field's
    default and help, FLAG_OPTIONS's bounds; `changed`: per field, config_flag keywords this command
    says otherwise) and receives their values as one dict, its parameter `into` (field -> value; a
    repeated flag as a tuple, a path as a str), ready for `cls(**values)`.

        >>> from treeattn.engine.request import SamplingParams
        >>> @config_options(SamplingParams, ["top_k", "seed"], into="sampling")
        ... def command(prompt: str, sampling: dict = None):
        ...     return prompt, sampling
        >>> list(inspect.signature(command).parameters)
        ['prompt', 'top_k', 'seed']
        >>> command("hi", top_k=5, seed=1)
        ('hi', {'top_k': 5, 'seed': 1})
    """
    def decorate(command):
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.name != into]
        flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=FLAG_TYPES[name],
                                   default=config_flag(cls, name, **{**FLAG_OPTIONS.get(name, {}), **changed.get(name, {})}))
                 for name in names]

        @functools.wraps(command)
        def run(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in names}
            values = {n: tuple(v) if isinstance(v, list) else str(v) if isinstance(v, Path) else v for n, v in values.items()}
            return command(*args, **kwargs, **{into: values})

        run.__signature__ = signature.replace(parameters=own + flags)
        run.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != into},
                               **{name: FLAG_TYPES[name] for name in names}}
        return run

    return decorate


def _dtype(value: str) -> str:
    value = DTYPE_ALIASES.get(value, value)
    if value not in DTYPES:
        raise typer.BadParameter(f"expected one of {', '.join(DTYPES)}, got {value!r}")
    return value


def _dtype_or_auto(value: str) -> str:
    return value if value == "auto" else _dtype(value)


def dtype_flag(default: str = "auto", help: str = "The model's dtype (weights, activations, KV cache); auto: bfloat16 "
               "on CUDA, float32 on the CPU.") -> str:
    """--dtype: auto (when it is the default), float32, bfloat16 or float16 (bf16, fp16, fp32 accepted too)."""
    names = ("auto", *DTYPES) if default == "auto" else DTYPES
    return typer.Option(default, "--dtype", metavar="<" + "|".join(names) + ">",
                        callback=_dtype_or_auto if default == "auto" else _dtype, help=help)


def torch_dtype(name: str):
    """A --dtype value as EngineConfig.dtype takes it: a torch.dtype, or None for "auto"."""
    import torch

    return None if name == "auto" else getattr(torch, name)


# EngineConfig / SamplingParams field -> command-line option, where the two names differ.
FIELD_FLAGS = {"stop_token_ids": "--stop-id", "prompts": "the prompt", "timeout_s": "--timeout", "threads_per_rank": "--threads"}


def flag_of(field: str) -> str:
    """The command-line flag of an EngineConfig / SamplingParams field (max_new_tokens -> --max-new-tokens)."""
    return FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))


def cli_message(exc) -> str:
    """A configuration error's message in the command line's words: "top_p must ..." -> "--top-p must ...",
    "decode='ring'" -> "--decode ring"."""
    from treeattn.engine.config import EngineConfig
    from treeattn.engine.request import SamplingParams

    text = str(exc)
    names = {f.name for f in dataclasses.fields(EngineConfig)} | {f.name for f in dataclasses.fields(SamplingParams)} | {"num_s"
                                                                                                                         "amples"}
    for name in sorted(names, key=len, reverse=True):
        text = re.sub(rf"\b{name}='?([^\s',;:)]*)'?", lambda m, n=name: f"{flag_of(n)} {m.group(1)}", text)
        text = re.sub(rf"^{name}\b", flag_of(name), text)
    return text


def device_and_dtype(device: str, dtype: str, world: int) -> tuple[str, str]:
    """(--device resolved to "cpu" or "cuda", --dtype resolved to a dtype name: auto is bfloat16 on CUDA,
    float32 on the CPU) for `world` ranks. ConfigError naming device (no CUDA) or nproc (more ranks on
    this machine than GPUs); cli_message turns it into the flags' words."""
    import torch

    from treeattn.engine.device import check_gpus, resolve_device, resolve_dtype
    from treeattn.parallel.spawn import local_ranks

    kind = resolve_device(device)
    check_gpus(kind, local_ranks(world))
    return kind, str(resolve_dtype(None if dtype == "auto" else getattr(torch, dtype), kind)).removeprefix("torch.")


__all__ = ["FLAG_HELP", "FLAG_OPTIONS", "FLAG_TYPES", "config_options", "MODEL_HELP", "model_argument", "DTYPES", "DTYPE_ALIASES",
           "Decode", "DecodeStep", "Device", "KvCacheDtype", "Method", "Placement", "Prefill", "Speculate", "WeightFormat",
           "FIELD_FLAGS", "cli_message", "config_flag",
           "device_and_dtype", "dtype_flag", "field_help", "flag_of", "torch_dtype"]
