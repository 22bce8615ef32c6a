"""The sampling settings a checkpoint ships with: generation_config.json of a Hugging Face directory,
general.sampling.* of a GGUF file.

    settings = read_generation_config("model.gguf")   # e.g. {"temperature": 0.6, "top_p": 0.95}; {} when it ships none

Hugging Face writes the model authors' recommended decoding into generation_config.json
(temperature, top_k, top_p, repetition_penalty; do_sample false means greedy); llama.cpp's converter
writes the same into a GGUF file's general.sampling.temp / top_k / top_p / penalty_repeat when the
source has them (gguf-py's Keys.General.SAMPLING_*). Only the keys a checkpoint holds come back, under
SamplingParams' field names; `treeattn chat` fills the others with its own defaults and says which
value came from where.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty")
"""The settings read, as SamplingParams names them."""
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k", "top_p": "general.sampling.top_p",
             "repetition_penalty": "general.sampling.penalty_repeat"}
"""GGUF metadata key of each field (llama.cpp's names)."""
GENERATION_CONFIG = "generation_config.json"


def _number(field: str, value):
    """`value` as the field's type, or None when it is not a number (a damaged or unusual file: ignored)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if field == "top_k" else float(value)


def read_generation_config(model: str | os.PathLike) -> dict:
    """The FIELDS `model` (an HF directory or a .gguf file) ships values for: {field: value}; {} when
    none (no generation_config.json, or one with only token ids). do_sample false in
    generation_config.json is greedy decoding: {"temperature": 0.0}.

    >>> import pathlib, tempfile
    >>> directory = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (directory / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}')
    >>> read_generation_config(directory)
    {'temperature': 0.6, 'top_p': 0.9}
    >>> read_generation_config(tempfile.mkdtemp())
    {}
    """  # noqa: E501
    from treeattn.models.gguf import is_gguf

    if is_gguf(model):
        from treeattn.models.gguf import metadata, open_gguf

        reader = open_gguf(model, tokenizer=False)
        found = {field: _number(field, metadata(reader, key, None)) for field, key in GGUF_KEYS.items()}
        return {k: v for k, v in found.items() if v is not None}
    path = Path(model) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    if data.get("do_sample") is False:
        return {"temperature": 0.0}
    found = {field: _number(field, data.get(field)) for field in FIELDS}
    return {k: v for k, v in found.items() if v is not None}


__all__ = ["FIELDS", "GGUF_KEYS", "read_generation_config"]
