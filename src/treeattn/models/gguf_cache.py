"""A converted copy of a GGUF file's model: its dequantized weights, config, tokenizer and chat template
in one safetensors file, so that loading the same file again costs what a safetensors checkpoint costs.

    model = load_model("model.gguf")   # first load: reads the GGUF file, then writes the copy
    model = load_model("model.gguf")   # later loads (any process, every rank): read the copy
    TREEATTN_GGUF_CACHE=0              # neither read nor write copies
    TREEATTN_CACHE_DIR=/some/dir       # where (default $XDG_CACHE_HOME/treeattn, else ~/.cache/treeattn)

What is cached: every load of a file with its tokenizer, one entry per (file, dtype, weight format):
dequantized weights (weight_format "dequantize"; "auto" on a GPU) in the dtype, and packed weights
("packed", and "auto" on the CPU, each its own entry) as the packed layers hold them (their block
codes and the scales' float32 bits, exactly the file's values; treeattn.models.packed) with the rest
in the dtype. A packed copy skips what a packed load from the file costs besides the weights:
parsing the GGUF metadata and building the tokenizer.

Never stale: an entry is found by the file's identity -- its resolved path, size, modification time
(ns) and inode -- with the dtype and this module's FORMAT version; a file written again gets a new
key, and writing the new entry deletes the path's older ones (one entry per file and dtype). A file
changed in place with its size and mtime kept (touch -r) would not be noticed: remove the copy or set
TREEATTN_GGUF_CACHE=0. An entry is written to a temporary file and renamed, so a reader sees a whole
entry or none; one that cannot be read is converted and written again. Nothing is written when the
cache directory's disk would keep less free space than the entry's size.

Entry: <cache dir>/gguf/<path key>-<file key>.safetensors; tensors: the model's state dict and
"inv_freq" (RoPE inverse frequencies, after a file's rope_freqs); metadata (strings): "config" (JSON
of the config dataclass and its class), "tokenizer" (tokenizers' JSON, absent without one),
"chat_template" (JSON [template, bos_token, eos_token], absent without one), "packed" (JSON
{module name: [kind, block format]} of the packed layers, absent for a dequantized copy), "source",
"format".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# 2: "packed" and "auto" keep Q4_K, Q5_0 and Q6_K matrices packed too (session 8); a copy of format 1 holds them dequantized
FORMAT = "2"
ENV_SWITCH = "TREEATTN_GGUF_CACHE"
ENV_DIR = "TREEATTN_CACHE_DIR"
_OFF = ("0", "off", "false", "no")


def enabled() -> bool:
    """Whether copies are read and written (TREEATTN_GGUF_CACHE is not 0/off/false/no)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF


def cache_dir() -> Path:
    """$TREEATTN_CACHE_DIR, else $XDG_CACHE_HOME/treeattn, else ~/.cache/treeattn; GGUF copies go in gguf/."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]) / "gguf"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "treeattn" / "gguf"


def entry_path(path: str | os.PathLike, dtype: torch.dtype, weight_format: str = "dequantize") -> Path:
    """The copy's file for GGUF file `path` loaded as `dtype` with `weight_format` ("dequantize", or
    "packed" / "auto" as they load on the CPU; see the module doc for the key)."""
    source = Path(path).resolve()
    stat = source.stat()
    kept = "" if weight_format == "dequantize" else f"\0{weight_format}"  # dequantized copies keep their old keys
    path_key = hashlib.sha256(f"{source}\0{dtype}{kept}".encode()).hexdigest()[:16]
    file_key = hashlib.sha256(f"{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}\0{FORMAT}".encode()).hexdigest()[:16]
    return cache_dir() / f"{path_key}-{file_key}.safetensors"


def load(path: str | os.PathLike, dtype: torch.dtype, device: torch.device, weight_format: str = "dequantize"):
    """The model of `path`'s copy in `dtype` on `device` with `weight_format` (as entry_path takes it),
    with its tokenizer and chat template; None when there is no copy (or it cannot be read: it is then
    logged and left to be written again)."""
    entry = entry_path(path, dtype, weight_format)
    if not entry.is_file():
        return None
    try:
        return _read(entry, path, dtype, device)
    except Exception as exc:  # noqa: BLE001 -- a damaged copy is a cache miss, not an error
        logger.warning("%s: the converted copy %s cannot be read (%s: %s); converting the file again", path, entry,
                       type(exc).__name__, exc)
        return None


def store(path: str | os.PathLike, model, weight_format: str = "dequantize") -> Path | None:
    """Write `model` (loaded from GGUF file `path` with `weight_format`, as entry_path takes it) as the
    file's copy; returns the entry, or None when the disk would keep less free space than its size, or
    writing failed (logged)."""
    from treeattn.models.packed import PackedEmbedding, PackedLinear

    entry = entry_path(path, model.dtype, weight_format)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    state["inv_freq"] = model.inv_freq.detach().to("cpu").contiguous()
    size = sum(t.numel() * t.element_size() for t in state.values())
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(entry.parent).free
        if free < 2 * size:
            logger.info("%s: no converted copy written: %d bytes free in %s, the copy needs %d", path, free, entry.parent, size)
            return None
        metadata = {"format": FORMAT, "source": str(Path(path).resolve()), "config": _config_json(model.config)}
        if model.tokenizer is not None:
            metadata["tokenizer"] = model.tokenizer.to_str()
        if model.chat_template is not None:
            t = model.chat_template
            metadata["chat_template"] = json.dumps([t.template, t.bos_token, t.eos_token])
        packed = {name: ["embedding" if isinstance(module, PackedEmbedding) else "linear", module.fmt]
                  for name, module in model.named_modules() if isinstance(module, (PackedLinear, PackedEmbedding))}
        if packed:
            metadata["packed"] = json.dumps(packed)
        from safetensors.torch import save_file

        handle, temporary = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(handle)
        try:
            save_file(state, temporary, metadata=metadata)
            os.replace(temporary, entry)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except OSError as exc:
        logger.warning("%s: no converted copy written to %s: %s", path, entry.parent, exc)
        return None
    prefix = entry.name.split("-")[0] + "-"
    for stale in entry.parent.glob(prefix + "*.safetensors"):
        if stale != entry:
            stale.unlink(missing_ok=True)
    logger.info("%s: converted copy written to %s (%d bytes)", path, entry, size)
    return entry


def _read(entry: Path, path, dtype: torch.dtype, device: torch.device):
    from safetensors import safe_open

    from treeattn.models.chat import GGUF_TEMPLATE_KEY, ChatTemplate
    from treeattn.models.families import model_class

    where = (
        f"cuda:{torch.cuda.current_device() if device.index is None else device.index}" if device.type == "cuda" else str(device)
    )
    with safe_open(str(entry), framework="pt", device=where) as f:
        metadata = f.metadata()
        if metadata.get("format") != FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
        config = _config_from_json(metadata["config"])
        model = model_class(config)(config, dtype=dtype, device="meta")
        state = {name: f.get_tensor(name) for name in f.keys() if name != "inv_freq"}
        inv_freq = f.get_tensor("inv_freq")
    if "packed" in metadata:  # the packed layers replace their modules, as the GGUF loader places them
        from treeattn.models.packed import PackedEmbedding, PackedLinear

        for name, (kind, fmt) in json.loads(metadata["packed"]).items():
            qs, d = state[f"{name}.qs"], state[f"{name}.d_bits"].view(torch.float32)
            m = state[f"{name}.m_bits"].view(torch.float32) if f"{name}.m_bits" in state else None
            layer = PackedEmbedding(fmt, qs, d, m) if kind == "embedding" else PackedLinear(fmt, qs, d, m,
                                                                                            bias=state.get(f"{name}.bias"))
            model.set_submodule(name, layer)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = inv_freq
    tokenizer = None
    if "tokenizer" in metadata:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(metadata["tokenizer"])
    template = None
    if "chat_template" in metadata:
        text, bos, eos = json.loads(metadata["chat_template"])
        template = ChatTemplate(f"{path}:{GGUF_TEMPLATE_KEY}", text, bos, eos)
    model.tokenizer, model.chat_template = tokenizer, template
    logger.info("loaded %s from its converted copy %s as %s on %s", path, entry, dtype, device)
    return model.eval()


def _config_json(config) -> str:
    return json.dumps({"class": type(config).__name__, "fields": dataclasses.asdict(config)})


def _config_from_json(text: str):
    from treeattn.models.gemma3 import Gemma3Config
    from treeattn.models.llama import LlamaConfig

    raw = json.loads(text)
    cls = {c.__name__: c for c in (LlamaConfig, Gemma3Config)}[raw["class"]]
    fields = raw["fields"]
    for f in dataclasses.fields(cls):  # JSON has lists where the config has tuples
        if isinstance(fields.get(f.name), list) and f.default is not dataclasses.MISSING and isinstance(f.default, tuple):
            fields[f.name] = tuple(fields[f.name])
    return cls(**fields)
