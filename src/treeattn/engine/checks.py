"""The engine's checks before any rank starts: everything a rank would refuse, said once in the caller's process.

    files = check_engine(model, config, group=group, joined=joined)   # all of them, in this order:

    files = model_files(model)                   # config and tokenizer, without the weights for a path
    check_model(model); check_decode_step_device(model, config, group, joined)
    check_hybrid_cache(files.config, config)
    if config.tp is not None:
        from treeattn.engine.worker.tensor_parallel import check_block_cuts, check_tensor_parallel

        check_tensor_parallel(files.config, config.tp, config.nproc)
        if _may_pack(model, config):
            check_block_cuts(files.config, config.tp, config.nproc, _block_of(model))     # static/graph steps refuse a hybrid
            cache
    check_draft_model(files, config)             # with speculate="draft"
    check_memory(model, files.config, config)    # weights + cache (+ draft) of the ranks on this machine
    check_weight_format(model, config)

Once per run, wherever the run starts: ta.Engine runs check_engine before it starts a rank; ta.generate
runs it on its batch-sized config before any work and hands the Engine it starts the proof, a Checked
(the config, the model it was checked for, the model files): the Engine trusts it instead of checking
again, as vLLM trusts a VllmConfig once it is built. `treeattn generate` checks before spawning, with
the checkpoint's path, and its ranks hand on a Checked for the model they load from that path.

Each raises ValueError (ConfigError naming the EngineConfig field to change) with one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from treeattn.cache.window import hybrid_windows
from treeattn.engine import memory
from treeattn.engine.config import EngineConfig, resolve_kv_cache_dtype
from treeattn.engine.device import backend_for, check_gpus, rank_device, resolve_device, resolve_dtype
from treeattn.engine.errors import ConfigError
from treeattn.engine.memory import model_bytes
from treeattn.parallel.spawn import local_ranks


def check_model(model) -> None:
    from treeattn.models.deepseek import DeepseekModel
    from treeattn.models.llama import LlamaModel

    if isinstance(model, (LlamaModel, DeepseekModel)):
        return
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a LlamaModel, a DeepseekModel or a checkpoint path, got {type(model).__name__}")
    if not Path(model).exists():
        raise ValueError(f"model: no such file or directory: {model}")



def model_files(model):
    """What the checks need of the model (.config, .tokenizer): a loaded model itself, or its
    checkpoint's config and tokenizer, read without the weights."""
    if isinstance(model, (str, os.PathLike)):
        from treeattn.models.loader import read_model_files

        return read_model_files(model)
    return model


def with_device(model, config: EngineConfig) -> EngineConfig:
    """`config` with its device resolved to "cpu" or "cuda": a given model's own device for "auto",
    else device.resolve_device (ConfigError naming device: CUDA asked for and not there)."""
    if config.device == "auto" and not isinstance(model, (str, os.PathLike)):
        kind = model.device.type
        if kind not in ("cpu", "cuda"):
            raise ConfigError("device", f"device: the engine runs on 'cpu' or 'cuda', but the model is on {model.device}")
    else:
        kind = resolve_device(config.device)
    return replace(config, device=kind)


def check_gpus_of(model, config: EngineConfig, joined: bool) -> None:
    """CUDA ranks need a GPU each: more ranks on this machine than GPUs is a ConfigError naming nproc
    (one process on a model already on its GPU needs nothing more)."""
    if joined or config.nproc > 1 or isinstance(model, (str, os.PathLike)):
        check_gpus(config.device, local_ranks(config.nproc))


def check_decode_step_device(model, config: EngineConfig, group, joined: bool) -> None:
    """decode_step="graph" needs the ranks on CUDA (config.device, resolved by with_device),
    and on several ranks an NCCL group (gloo's collectives cannot be captured); ConfigError naming
    decode_step."""
    if config.decode_step != "graph":
        return
    device = torch.device(config.device)  # where the ranks run the model (with_device)
    if device.type != "cuda":
        raise ConfigError("decode_step", f"decode_step='graph' records CUDA graphs: the model must be on a CUDA device, got "
                          f"{device} (decode_step='static' runs the same steps without graphs)")
    backend = dist.get_backend(group) if joined else backend_for(config.device)
    if config.nproc > 1 and backend != "nccl":
        raise ConfigError("decode_step", f"decode_step='graph' on {config.nproc} ranks captures the combines in CUDA graphs, "
                          f"which needs an NCCL process group, got {backend} (decode_step='static' runs without graphs)")


def check_hybrid_cache(model_config, config: EngineConfig) -> None:
    """A hybrid model (window and global layers, e.g. Gemma 3) keeps its window layers per sequence
    (treeattn.cache.window), which static and graph steps do not run: ConfigError naming
    decode_step, before any rank starts."""
    if not hybrid_windows(tuple(model_config.layer_windows)):
        return
    arch = getattr(model_config, "architecture", "this model")
    if config.decode_step != "dynamic":
        raise ConfigError("decode_step", f"decode_step={config.decode_step!r} does not run a hybrid KV cache (the "
                          f"sliding-window layers of {arch}); use decode_step='dynamic'")


def check_linear_maps(config: EngineConfig) -> None:
    """config.linear_maps names a directory `treeattn linearize` wrote (ConfigError naming
    linear_maps), before any rank starts."""
    if config.linear_maps is None:
        return
    from treeattn.linear.hybrid import CONFIG_FILE

    if not (Path(config.linear_maps) / CONFIG_FILE).is_file():
        raise ConfigError("linear_maps", f"linear_maps: {config.linear_maps} holds no {CONFIG_FILE} (a directory written by "
                          f"`treeattn linearize --out`)")


def check_linear(model, config: EngineConfig, windows: bool) -> None:
    """A hybrid linear model -- a loaded one, or a checkpoint whose config.linear_maps layers are
    linearized on load -- refused with what the engine cannot run with it, before any rank starts
    (treeattn.linear.hybrid.check_linear_engine: the one copy of those refusals, which the runner
    calls too). `windows`: the model has sliding-window layers."""
    from treeattn.linear.hybrid import check_linear_engine, linear_layers, maps_layers

    check_linear_maps(config)
    layers = set(maps_layers(config.linear_maps)) if config.linear_maps is not None else set()
    if not isinstance(model, (str, os.PathLike)):
        layers |= set(linear_layers(model))
    check_linear_engine(tuple(sorted(layers)), decode_step=config.decode_step, speculate=config.speculate, windows=windows)


def check_draft_model(target, config: EngineConfig) -> None:
    """The draft model against the model (`target`: model_files) before any rank starts (ConfigError
    naming draft_model): the same tokenizer, and a context window reaching every position the engine runs."""
    from treeattn.engine.draft_model import check_draft_model, read_draft_model

    draft = read_draft_model(config.draft_model) if isinstance(config.draft_model, str) else config.draft_model
    check_draft_model(draft, target, positions=config.max_context_tokens(target.config.max_position_embeddings),
                      needed_by="positions the engine runs (max_context: the model's context window, or cache_tokens if fewer)")


def model_dtype(model, config: EngineConfig) -> torch.dtype:
    """The dtype the ranks run `model` in: config.dtype, else a checkpoint's resolve_dtype (bfloat16 on
    CUDA, float32 on the CPU; config.device resolved by with_device) or the loaded model's."""
    if config.dtype is not None:
        return config.dtype
    if isinstance(model, (str, os.PathLike)):
        return resolve_dtype(None, config.device if config.device != "auto" else resolve_device("auto"))
    return model.dtype


def check_weight_format(model, config: EngineConfig) -> None:
    """config.weight_format against the model (ConfigError naming weight_format), before any rank starts
    (and config.activation_format "int8" and config.prefill_dtype "bfloat16" against this host's CPU):
    "packed" needs a .gguf file whose quantized matrices a packed kernel reads, on the CPU or on CUDA
    with triton installed (config.device resolved by with_device); a loaded model keeps the format it was loaded in ("auto" takes
    it as it is)."""
    if config.activation_format != "auto":
        from treeattn.ops.packed_linear import resolve_activation_format

        try:
            resolve_activation_format(config.activation_format)
        except ValueError as exc:
            raise ConfigError("activation_format", str(exc)) from None
    if config.prefill_dtype != "float32":
        from treeattn.ops.packed_linear import resolve_prefill_dtype

        try:
            resolve_prefill_dtype(config.prefill_dtype)
        except ValueError as exc:
            raise ConfigError("prefill_dtype", str(exc)) from None
    fmt = config.weight_format
    if fmt == "auto":
        return
    if not isinstance(model, (str, os.PathLike)):
        from treeattn.models.packed import is_packed

        if is_packed(model) != (fmt == "packed"):
            raise ConfigError("weight_format", f"weight_format={fmt!r}: the loaded model's weights are "
                              f"{'packed' if is_packed(model) else 'dequantized'}; a loaded model keeps its format: load it "
                              f"with ta.load_model(path, weight_format={fmt!r}), or give weight_format='auto'")
        return
    from treeattn.models.gguf import is_gguf

    if fmt != "packed":
        return
    if not is_gguf(model):
        raise ConfigError("weight_format", f"weight_format='packed' keeps a GGUF file's quantized matrices; {model} is not a "
                          f".gguf file: use weight_format='dequantize' or 'auto'")
    from treeattn.models.gguf import open_gguf, packed_tensors

    try:
        packed_tensors({t.name: t for t in open_gguf(model).tensors}, fmt, torch.device(config.device), model)
    except ValueError as exc:
        raise ConfigError("weight_format", str(exc)) from None


def check_memory(model, model_config, config: EngineConfig, *, cache_option: str = "cache_tokens") -> None:
    """The weights and KV cache the ranks on this machine hold (the draft model's too) against its
    memory (memory.check_memory_fit, the one memory check), the cache counted in the dtype it stores
    (kv_cache_dtype); ConfigError naming the option to change (`cache_option` when the cache is what
    does not fit: the option that sized it)."""
    dtype = model_dtype(model, config)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    draft = 0
    if config.draft_model is not None:
        draft_config = (model_files(config.draft_model) if isinstance(config.draft_model, (str, os.PathLike))
                        else config.draft_model).config
        draft = model_bytes(config.draft_model, dtype) + memory.kv_cache_bytes_per_rank(config, draft_config, dtype,
                                                                                        blocks_for=model_config)
    ranks, device, weights = local_ranks(config.nproc), torch.device("cpu"), model_bytes(model, dtype)
    if config.tp is not None and config.nproc > 1:  # the Helix layout: each rank holds its share
        from treeattn.engine.worker.tensor_parallel import share_fraction

        weights = int(weights * share_fraction(model_config, config.tp, config.nproc))
    if config.device == "cuda":  # each rank its own GPU: one rank's share against the GPU with the least free memory
        in_group = dist.is_available() and dist.is_initialized()
        devices = [rank_device("cuda", dist.get_rank())] if in_group else [rank_device("cuda", r) for r in range(ranks)]
        if not isinstance(model, (str, os.PathLike)) and model.device.type == "cuda" and (in_group or config.nproc == 1):
            devices, weights = [model.device], 0  # the model stays where it is: its weights are already taken
        ranks, device = 1, min(devices, key=memory.device_memory_bytes)
    cache = memory.kv_cache_bytes_per_rank(config, model_config, kv_dtype, compute_dtype=dtype)
    memory.check_memory_fit(ranks=ranks, weights=weights, cache=cache,
                            draft=draft, device=device, cache_option=cache_option)


def check_kv_store(config: EngineConfig) -> None:
    """config.kv_store is a directory this process can create and write (ConfigError naming
    kv_store), before any rank starts."""
    if config.kv_store is None:
        return
    try:
        os.makedirs(config.kv_store, exist_ok=True)
    except OSError as exc:
        raise ConfigError("kv_store", f"kv_store: cannot create the directory {config.kv_store}: {exc.strerror}") from exc
    if not os.access(config.kv_store, os.W_OK | os.X_OK):
        raise ConfigError("kv_store", f"kv_store: {config.kv_store} is not a directory this process can write")


def _may_pack(model, config: EngineConfig) -> bool:
    """Whether the ranks may keep some of the model's matrices packed: a GGUF checkpoint with
    weight_format "packed", or "auto" on the CPU; a loaded model that holds packed layers."""
    if not isinstance(model, (str, os.PathLike)):
        from treeattn.models.packed import is_packed

        return is_packed(model)
    from treeattn.models.gguf import is_gguf

    return is_gguf(model) and (config.weight_format == "packed" or (config.weight_format == "auto" and config.device == "cpu"))


def _block_of(model) -> int:
    """The packed blocks' width a plan's column shares must respect: a GGUF file's (256 for its
    K-quant matrices), else 32."""
    if isinstance(model, (str, os.PathLike)):
        from treeattn.models.gguf import is_gguf, packed_block

        if is_gguf(model):
            return max(32, packed_block(model))
    return 32


@dataclass(frozen=True, eq=False)
class Checked:
    """An EngineConfig that check_engine passed for one model: handed on, it is not checked again.

    Attributes:
        config: the checked config (its device resolved by with_device).
        model: the model it was checked for (a loaded model, or the checkpoint path given).
        files: model_files(model): what the engine needs of the model (.config, .tokenizer).

    Example::

        >>> from treeattn.models.llama import LlamaConfig, random_model
        >>> model = random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
        ...                                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128))
        >>> config = with_device(model, EngineConfig(nproc=1, block_size=16, cache_tokens=128))
        >>> proof = Checked(config, model, check_engine(model, config))
        >>> proof.vouches_for(model, config), proof.vouches_for(model, EngineConfig(nproc=1, block_size=32, cache_tokens=128))
        (True, False)
    """

    config: EngineConfig
    model: object
    files: object

    def vouches_for(self, model, config: EngineConfig) -> bool:
        """Whether this proof covers running `model` with `config` (the same model object, an equal config)."""
        return self.model is model and self.config == config


def check_engine(model, config: EngineConfig, *, group=None, joined: bool = False, cache_option: str = "cache_tokens"):
    """Every check of this module, in order, for `model` (a loaded model or a checkpoint path) run
    with `config` (its device resolved by with_device); `group`/`joined`: the existing process group,
    if any. Returns model_files(model). `cache_option` is the option the memory check names when the
    cache does not fit."""
    check_model(model)
    check_gpus_of(model, config, joined)
    check_decode_step_device(model, config, group, joined)
    files = model_files(model)
    check_hybrid_cache(files.config, config)
    if config.tp is not None:
        from treeattn.engine.worker.tensor_parallel import check_block_cuts, check_tensor_parallel

        check_tensor_parallel(files.config, config.tp, config.nproc)
        if _may_pack(model, config):
            check_block_cuts(files.config, config.tp, config.nproc, _block_of(model))
    check_linear(model, config, windows=bool(hybrid_windows(tuple(files.config.layer_windows))))
    if config.draft_model is not None:
        check_draft_model(files, config)
    check_memory(model, files.config, config, cache_option=cache_option)
    check_weight_format(model, config)
    check_kv_store(config)
    config.max_context_tokens(files.config.max_position_embeddings)  # max_context beyond the cache
    return files
