"""Load a Hugging Face checkpoint directory into a LlamaModel: config.json, safetensors, tokenizer.json.

    model = load_model("path/to/Llama-3.2-1B", dtype=torch.bfloat16)
    tokenizer = load_tokenizer("path/to/Llama-3.2-1B")      # tokenizers.Tokenizer, or None
    model = load_model("model.Q4_K_M.gguf")                  # a GGUF file: treeattn.models.gguf

A directory holds config.json, the weights as *.safetensors (one file, or shards listed by
model.safetensors.index.json), and optionally tokenizer.json and generation_config.json.
Supported architectures: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM (treeattn.models.llama),
DeepseekV2ForCausalLM, DeepseekV3ForCausalLM (treeattn.models.deepseek; its config.json parsing too),
Gemma3ForCausalLM (model_type gemma3_text) and the text model of Gemma3ForConditionalGeneration
(model_type gemma3, its text_config; the vision tower's tensors are skipped) (treeattn.models.gemma3).

Weights are read with safetensors (never unpickled). The model is first built on the "meta"
device (no memory), then each tensor is read once from its file, converted to the requested dtype
and device, checked against the shape the config implies, and placed in the model: no second copy
of the weights exists at any time. Sequence parallelism shards the KV cache, not the weights, so
every rank loads all of them; with tensor parallelism (`shard=`) a rank reads only its share.

Every problem is reported before any weight is read, as a ValueError (or FileNotFoundError)
naming the file, the key and the value at fault.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from treeattn.models.chat import ChatTemplate, gguf_chat_template, read_chat_template
from treeattn.models.families import model_class
from treeattn.models.llama import SUPPORTED_ROPE_TYPES, LlamaConfig, LlamaModel, config_reader
from treeattn.models.packed import WEIGHT_FORMATS
from treeattn.models.shards import shard_model

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                           "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                           "Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3"}
# Checkpoint entries that are not parameters (older exports saved RoPE tables).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_model(model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               weight_format: str = "dequantize", with_tokenizer: bool = True, shard: dict | None = None) -> LlamaModel:
    """Load a Llama-family checkpoint: a Hugging Face directory or a .gguf file.

    The model's tokenizer and chat template come along as model.tokenizer and model.chat_template
    (None where the checkpoint has none). A .gguf file is read from its converted copy in the user
    cache when there is one for this dtype and weight format, and the copy is written after the first
    such load with the tokenizer (treeattn.models.gguf_cache; TREEATTN_GGUF_CACHE=0 turns that off).

    Args:
        model_dir: directory with config.json and *.safetensors (with or without an index), or a
            .gguf file (treeattn.models.gguf).
        dtype: parameter dtype (float32, bfloat16, float16); the weights are converted on load.
        device: where the parameters live.
        weight_format: "dequantize" (every weight in `dtype`), "packed" (a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q5_0/Q6_K
            matrices kept as they ship: treeattn.models.gguf) or "auto" (packed what can be, on the
            CPU; a safetensors checkpoint is loaded in `dtype` either way).
        with_tokenizer: False: the tokenizer and chat template are not read (model.tokenizer and
            model.chat_template are None), for processes that only run the model, such as the
            engine's ranks (building a GGUF file's tokenizer costs about as much as its packed weights).
        shard: parameter name -> treeattn.models.shards.Cut: only that share of each named tensor is
            read (safetensors slices; a GGUF file's rows, or its columns on block boundaries, packed
            blocks kept as the file's bytes) and the model holds only it (model.helix_cuts = shard);
            the engine's tensor-parallel plan gives it (treeattn.engine.worker.tensor_parallel). Every name
            and whole shape is checked first, as without it.

    Returns:
        A LlamaModel in eval mode; model.config holds the parsed configuration.

    Raises:
        FileNotFoundError: no such directory, no config.json, no safetensors file, or a shard named
            by the index that does not exist.
        ValueError: malformed or unsupported config, malformed safetensors file or index, missing or
            unexpected tensors, or a tensor whose shape disagrees with the config.

    Example (a tiny Hugging Face directory written here: config.json and model.safetensors)::

        >>> import json, pathlib, tempfile, torch, treeattn as ta
        >>> from safetensors.torch import save_file
        >>> from treeattn.models.llama import random_model
        >>> config = ta.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
        ...                         num_kv_heads=2, head_dim=8)
        >>> weights = random_model(config).state_dict()         # our names are the checkpoint's without "model."
        >>> directory = pathlib.Path(tempfile.mkdtemp())
        >>> save_file({("" if n == "lm_head.weight" else "model.") + n: t for n, t in weights.items()},
        ...           directory / "model.safetensors")
        >>> (directory / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        ...     "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...     "head_dim": 8})) > 0
        True
        >>> model = ta.load_model(directory, dtype=torch.bfloat16)
        >>> model.dtype, torch.equal(model.embed_tokens.weight, weights["embed_tokens.weight"].bfloat16())
        (torch.bfloat16, True)
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = _check_device(device)
    from treeattn.models.gguf import is_gguf  # here, not on top: `import treeattn` does not load the gguf package

    if is_gguf(model_dir):
        return _load_gguf(Path(model_dir), dtype, device, weight_format, with_tokenizer, shard)
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format == "packed":
        raise ValueError(f"weight_format='packed' keeps a GGUF file's quantized matrices; {model_dir} is not a .gguf file: "
                         "use weight_format='dequantize' or 'auto'")
    model_dir = _check_dir(model_dir)
    model, plan = _plan(model_dir, dtype)  # checks names and shapes before reading any data
    if shard:
        shard_model(model, shard)  # the skeleton's shapes are the shares read below

    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, (path, theirs) in plan.items():
        by_file.setdefault(path, []).append((ours, theirs))
    # Tensor by tensor, straight onto `device` (safetensors reads each one from the file mapping into
    # the device's memory), converted to `dtype` there: no whole float32 copy of the model in host memory.
    where = (
        f"cuda:{torch.cuda.current_device() if device.index is None else device.index}" if device.type == "cuda" else str(device)
    )
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device=where) as f:
            for ours, theirs in names:
                keep = ours.endswith(getattr(model, "FLOAT32_PARAMETERS", ()))  # e.g. DeepSeek's router biases
                state[ours] = _read(f, theirs, (shard or {}).get(ours)).to(dtype=torch.float32 if keep else dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.helix_cuts = shard or None
    model.inv_freq = model.inv_freq.to(device)
    model.tokenizer = load_tokenizer(model_dir) if with_tokenizer else None
    model.chat_template = read_chat_template(model_dir) if with_tokenizer else None
    logger.info("loaded %s (%d tensors from %d files) as %s on %s", model_dir, len(state), len(by_file), dtype, device)
    return model.eval()


def _read(f, name: str, cut) -> torch.Tensor:
    """Tensor `name` of an open safetensors file, or only its `cut` (a slice read from the file)."""
    if cut is None:
        return f.get_tensor(name)
    part = f.get_slice(name)
    index = [slice(None)] * len(part.get_shape())
    index[cut.dim] = slice(cut.start, cut.stop)
    return part[tuple(index)]


def check_checkpoint(model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """Everything load_model checks before it reads a weight -- config, file names, every tensor's
    name and shape -- without reading the weights (safetensors headers only; a .gguf file's config).
    Returns the model's skeleton on the "meta" device (no memory; .config, parameter sizes).

    Raises:
        what load_model raises for a bad checkpoint.
    """
    from treeattn.models.gguf import is_gguf

    if is_gguf(model_dir):
        config = read_config(model_dir)
        return model_class(config)(config, dtype=dtype, device="meta")
    return _plan(_check_dir(model_dir), dtype)[0]


def _plan(model_dir: Path, dtype: torch.dtype) -> tuple[LlamaModel, dict[str, tuple[Path, str]]]:
    """The model's skeleton on "meta", and our parameter name -> (file, checkpoint name), checked."""
    config = read_config(model_dir)
    locations = weight_locations(model_dir)
    model = model_class(config)(config, dtype=dtype, device="meta")
    return model, _match_tensors(model, locations)


def _load_gguf(path: Path, dtype: torch.dtype, device, weight_format: str, with_tokenizer: bool = True,
               shard: dict | None = None) -> LlamaModel:
    """load_model of a .gguf file: weights, tokenizer and chat template from one reading of it, or from
    its converted copy (treeattn.models.gguf_cache)."""
    from treeattn.models import gguf_cache
    from treeattn.models.gguf import load_gguf_model, open_gguf
    from treeattn.models.gguf_tokenizer import tokenizer_from_gguf

    # the copy's kind: "auto" dequantizes everything off the CPU (the dequantized copy), and on the CPU
    # keeps what it can packed (its own copy: "packed" refuses what "auto" dequantizes)
    kind = "dequantize" if weight_format == "dequantize" or (weight_format == "auto" and device.type != "cpu") else weight_format
    cached = not shard and gguf_cache.enabled() and path.is_file() and (kind == "dequantize" or device.type == "cpu")
    if cached:
        model = gguf_cache.load(path, dtype, device, kind)
        if model is not None:
            if not with_tokenizer:
                model.tokenizer = model.chat_template = None
            return model
    reader = open_gguf(path, tokenizer=with_tokenizer)  # without a tokenizer its arrays are not parsed
    tokenizer = tokenizer_from_gguf(reader, path=path) if with_tokenizer else None
    template = gguf_chat_template(reader, path) if with_tokenizer else None
    model = load_gguf_model(reader, path=path, dtype=dtype, device=device, weight_format=weight_format, shard=shard)
    model.tokenizer, model.chat_template = tokenizer, template
    if cached and with_tokenizer:  # a copy holds the tokenizer and template too
        gguf_cache.store(path, model, kind)
    return model


@dataclass(frozen=True)
class ModelFiles:
    """What a checkpoint says besides its weights: config, tokenizer (tokenizers.Tokenizer or None),
    chat template (ChatTemplate or None)."""

    config: LlamaConfig
    tokenizer: object | None
    chat_template: ChatTemplate | None


def read_model_files(model: str | os.PathLike) -> ModelFiles:
    """Config, tokenizer and chat template of an HF directory or .gguf file, without the weights
    (a GGUF file is read once for all three)."""
    from treeattn.models.gguf import is_gguf

    if is_gguf(model):
        from treeattn.models.gguf import open_gguf, read_gguf_config
        from treeattn.models.gguf_tokenizer import tokenizer_from_gguf

        reader = open_gguf(model)
        config = read_gguf_config(reader, path=model)
        return ModelFiles(config, tokenizer_from_gguf(reader, path=model), gguf_chat_template(reader, model))
    return ModelFiles(read_config(model), load_tokenizer(model), read_chat_template(model))


def load_tokenizer(model_dir: str | os.PathLike):
    """The tokenizers.Tokenizer of tokenizer.json in `model_dir` (or built from a .gguf file's
    vocabulary), or None if there is none.

    Example (a word-level tokenizer.json written here)::

        >>> import pathlib, tempfile, treeattn as ta
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> directory = pathlib.Path(tempfile.mkdtemp())
        >>> tokenizer = Tokenizer(models.WordLevel({"[unk]": 0, "hello": 1, "world": 2}, unk_token="[unk]"))
        >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> tokenizer.save(str(directory / "tokenizer.json"))
        >>> ta.load_tokenizer(directory).encode("hello world").ids
        [1, 2]
        >>> ta.load_tokenizer(tempfile.mkdtemp()) is None            # a directory without tokenizer.json
        True
    """
    from treeattn.models.gguf import is_gguf

    if is_gguf(model_dir):
        from treeattn.models.gguf import open_gguf
        from treeattn.models.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(open_gguf(model_dir), path=model_dir)
    path = _check_dir(model_dir) / TOKENIZER_FILE
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception type
        raise ValueError(f"{path}: not a valid tokenizer.json: {exc}") from exc


def read_config(model_dir: str | os.PathLike) -> LlamaConfig:
    """Parse config.json (and generation_config.json's eos_token_id, if present) of `model_dir`, or
    the metadata of a .gguf file."""
    from treeattn.models.gguf import is_gguf

    if is_gguf(model_dir):
        from treeattn.models.gguf import read_gguf_config

        return read_gguf_config(model_dir)
    model_dir = _check_dir(model_dir)
    path = model_dir / CONFIG_FILE
    raw = _read_json(path)
    config = config_from_dict(raw, source=str(path))
    generation = model_dir / GENERATION_CONFIG_FILE
    if generation.exists():
        extra = _read_json(generation)
        eos = _token_ids(extra.get("eos_token_id"), str(generation), "eos_token_id")
        config.eos_token_ids = tuple(dict.fromkeys(config.eos_token_ids + eos))
    return config


def config_from_dict(raw: dict, *, source: str = CONFIG_FILE) -> LlamaConfig:
    """Build a LlamaConfig from a Hugging Face config dict; errors name `source` and the key."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    architecture = _architecture(raw, source)
    family = SUPPORTED_ARCHITECTURES[architecture]
    if family.startswith("deepseek"):
        from treeattn.models import deepseek

        return deepseek.config_from_dict(raw, architecture, source=source)
    if family.startswith("gemma3"):
        from treeattn.models import gemma3

        return gemma3.config_from_dict(raw, architecture, source=source)

    get = config_reader(raw, source)

    hidden_act = get("hidden_act", str, "silu")
    if hidden_act != "silu":
        raise ValueError(f"{source}: unsupported hidden_act {hidden_act!r} (key 'hidden_act'); only 'silu' (SwiGLU)")
    hidden = get("hidden_size", int)
    heads = get("num_attention_heads", int)
    layers = get("num_hidden_layers", int)
    if "head_dim" not in raw and heads > 0 and hidden % heads:
        raise ValueError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and no 'head_dim' "
                         f"key says the head size")
    rope_theta, rope_type, rope_scaling = _rope(raw, source)
    # Every get() runs before LlamaConfig, so that only LlamaConfig's own errors get the file's name added.
    values = dict(
        vocab_size=get("vocab_size", int),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size", int),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads", int, heads),
        head_dim=get("head_dim", int, hidden // heads if heads else 0),
        rms_norm_eps=float(get("rms_norm_eps", float, 1e-6)),
        rope_theta=float(rope_theta),
        rope_type=rope_type,
        rope_scaling=rope_scaling,
        tie_word_embeddings=get("tie_word_embeddings", bool, False),
        qkv_bias=True if family == "qwen2" else (get("attention_bias", bool, False) if family == "llama" else False),
        o_bias=get("attention_bias", bool, False) if family == "llama" else False,
        mlp_bias=get("mlp_bias", bool, False) if family == "llama" else False,
        layer_windows=_layer_windows(raw, family, layers, source, get),
        max_position_embeddings=get("max_position_embeddings", int, 4096),
        architecture=architecture,
        bos_token_id=get("bos_token_id", int, None),
        eos_token_ids=_token_ids(raw.get("eos_token_id"), source, "eos_token_id"),
    )
    try:
        return LlamaConfig(**values)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def _architecture(raw: dict, source: str) -> str:
    """The supported architecture name, from 'architectures' or else 'model_type' (errors name the key used)."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    architectures = raw.get("architectures")
    if architectures:
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise ValueError(f"{source}: 'architectures' must be a list of names, got {architectures!r}")
        if architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{source}: unsupported architecture {architectures[0]!r} (key 'architectures'); supported: "
                             f"{supported}")
        return architectures[0]
    model_type = raw.get("model_type")
    if model_type is None:
        raise ValueError(f"{source}: neither 'architectures' nor 'model_type' says which model this is; supported: {supported}")
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    if model_type not in by_type:
        raise ValueError(f"{source}: unsupported model_type {model_type!r} (key 'model_type'; no 'architectures' key); "
                         f"supported: {', '.join(by_type)}")
    return by_type[model_type]


def weight_locations(model_dir: str | os.PathLike) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the safetensors file holding it.

    With model.safetensors.index.json the index's weight_map decides (every file it names must
    exist); without it, every *.safetensors file of the directory is opened and its keys listed.
    """
    model_dir = _check_dir(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: expected a 'weight_map' object of tensor name -> file name")
        locations = {}
        for name, file in weight_map.items():
            path = model_dir / file
            if not path.exists():
                raise FileNotFoundError(f"{index}: tensor {name!r} is in {file!r}, which does not exist ({path})")
            locations[name] = path
        return locations
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        extra = (
            " (found pytorch_model.bin: convert it to safetensors; treeattn never unpickles)"
            if (model_dir / "pytorch_model.bin").exists()
            else ""
        )
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights{extra}")
    locations = {}
    for path in files:
        for name in _safetensors_keys(path):
            if name in locations:
                raise ValueError(f"{path}: tensor {name!r} is also in {locations[name]}")
            locations[name] = path
    return locations


def _match_tensors(model: LlamaModel, locations: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """Our parameter name -> (file, checkpoint name), with names and shapes checked."""
    from safetensors import safe_open

    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    plan: dict[str, tuple[Path, str]] = {}
    unexpected = []
    for theirs, path in locations.items():
        if theirs.endswith(IGNORED_SUFFIXES):
            continue
        ours = _our_name(theirs, model.config)
        if ours is None:  # not the text model's (e.g. a gemma3 checkpoint's vision tower)
            continue
        if _is_mtp_layer(ours, model.config):
            continue
        if ours == "lm_head.weight" and model.lm_head is None:
            logger.info("%s: ignoring %s: the config ties the output embedding to the input one", path, theirs)
            continue
        if ours not in expected:
            unexpected.append(f"{theirs!r} in {path.name}")
            continue
        plan[ours] = (path, theirs)
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise ValueError(f"{path.parent}: tensors the {model.config.architecture} config does not have: {shown}")
    missing = [name for name in expected if name not in plan]
    if missing:
        hint = "model." + missing[0] if missing[0] != "lm_head.weight" else "lm_head.weight (or set tie_word_embeddings)"
        raise ValueError(f"{next(iter(locations.values())).parent}: missing {len(missing)} tensors, e.g. {hint}")
    handles = {}
    try:
        for ours, (path, theirs) in plan.items():
            if path not in handles:
                handles[path] = _open(path, safe_open)
            if theirs not in handles[path].keys():
                raise ValueError(_not_in_file(theirs, path, {p for p, _ in plan.values()}, safe_open))
            shape = tuple(handles[path].get_slice(theirs).get_shape())
            if shape != expected[ours]:
                raise ValueError(
                    f"{path}: tensor {theirs!r} has shape {shape}, but config.json implies {expected[ours]}"
                    + _shape_keys(model, ours)
                )
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return plan


def _our_name(theirs: str, config) -> str | None:
    """Our parameter name for checkpoint tensor `theirs` (without "model."; None: not ours to load)."""
    architecture = getattr(config, "checkpoint_architecture", None)
    if architecture is not None and architecture.startswith("Gemma3"):
        from treeattn.models.gemma3 import checkpoint_name

        return checkpoint_name(theirs, architecture)
    return theirs[len("model."):] if theirs.startswith("model.") else theirs


def _shape_keys(model, name: str) -> str:
    """' (from KEYS)': the config keys that set the shape of parameter `name`, where the model says (SHAPE_KEYS)."""
    for suffix, keys in getattr(model, "SHAPE_KEYS", {}).items():
        if name.endswith(suffix):
            return f" (from {keys})"
    return ""


def _is_mtp_layer(name: str, config) -> bool:
    """Whether `name` belongs to DeepSeek-V3's multi-token-prediction layers (layers num_layers and
    on, num_nextn_predict_layers of them), which a checkpoint holds and treeattn does not use."""
    extra = getattr(config, "num_mtp_layers", 0)
    if not extra or not name.startswith("layers."):
        return False
    index = name.split(".")[1]
    return index.isdigit() and config.num_layers <= int(index) < config.num_layers + extra


def _not_in_file(name: str, path: Path, files: set[Path], safe_open) -> str:
    """The message for an index that maps tensor `name` to `path`, which does not hold it."""
    holders = [other.name for other in sorted(files) if other != path and name in _safetensors_keys(other)]
    where = f"it is in {', '.join(holders)}" if holders else "no file of the index holds it"
    return f"{path.parent / INDEX_FILE}: maps tensor {name!r} to {path.name}, which does not hold it ({where})"


def _open(path: Path, safe_open):
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        return handle.__enter__()
    except Exception as exc:  # safetensors raises SafetensorError for a malformed header
        raise ValueError(f"{path}: not a valid safetensors file: {exc}") from exc


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    handle = _open(path, safe_open)
    try:
        return list(handle.keys())
    finally:
        handle.__exit__(None, None, None)


def _rope(raw: dict, source: str) -> tuple[float, str, dict]:
    """(rope_theta, rope_type, scaling parameters) from rope_parameters (transformers 5) or
    rope_theta + rope_scaling (transformers 4)."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        key = "rope_scaling"
    else:
        key = "rope_parameters"
    if not isinstance(params, dict):
        raise ValueError(f"{source}: key {key!r} must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: unsupported rope type {rope_type!r} (key {key!r}); supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings")}
    for name in needed.get(rope_type, ()):
        if not isinstance(params.get(name), (int, float)) or isinstance(params.get(name), bool):
            raise ValueError(f"{source}: rope type {rope_type!r} needs a number {key}.{name}, got {params.get(name)!r}")
    theta = params.get("rope_theta", 10000.0)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"{source}: rope_theta must be a finite positive number, got {theta!r}")
    scaling = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    return theta, rope_type, scaling


def _layer_windows(raw: dict, family: str, layers: int, source: str, get) -> tuple[int | None, ...]:
    """Sliding window of each layer: Mistral all layers; Qwen2 only with use_sliding_window, on the
    layers layer_types marks "sliding_attention" (else layers >= max_window_layers)."""
    if family == "mistral":
        return (get("sliding_window", int, None),) * layers
    if family == "qwen2" and get("use_sliding_window", bool, False):
        window = get("sliding_window", int, None)
        types = raw.get("layer_types")
        if types is not None:
            if not isinstance(types, list) or len(types) != layers:
                raise ValueError(f"{source}: 'layer_types' must list {layers} layer types, got {types!r}")
            return tuple(window if t == "sliding_attention" else None for t in types)
        first = get("max_window_layers", int, layers)
        return tuple(window if i >= first else None for i in range(layers))
    return (None,) * layers


def _token_ids(value, source: str, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{source}: {key!r} must be a token id or a list of them, got {value!r}")
    return tuple(values)


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc


def _check_device(device) -> torch.device:
    """`device` as a torch.device this process can allocate on, before any file is read."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from exc
    try:
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError) as exc:  # torch raises AssertionError for CUDA in a CPU build
        raise ValueError(f"device={device!r} is not usable in this process: {exc}") from exc
    return parsed


def _check_dir(model_dir) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory (expected a Hugging Face model directory with {CONFIG_FILE})")
    return path
