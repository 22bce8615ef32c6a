"""Load a GGUF file (llama.cpp / Ollama format) into a LlamaModel (a Gemma3Model for gemma3 files).

    model = load_gguf_model("SmolLM2-135M-Instruct.Q4_1.gguf")           # float32 weights
    model = load_gguf_model(path, weight_format="packed")                  # Q4_0/Q4_1/Q8_0/Q4_K/Q5_0/Q6_K matrices kept as
    shipped
    config = read_gguf_config("model.gguf")                                # LlamaConfig only

Reading goes through the `gguf` package (gguf.GGUFReader memory-maps the file; gguf.quants
dequantizes). Architectures (general.architecture): llama, mistral, qwen2. llama.cpp's converter
writes Llama 2/3 and Mistral 7B files as "llama"; "mistral" is taken as the same layout with an
optional sliding window.

What the loader undoes, tensor by tensor:
- names: llama.cpp's (blk.3.attn_q.weight, ffn_gate, token_embd, output_norm, ...) -> ours
  (layers.3.self_attn.q_proj.weight, ...); see TENSOR_NAMES.
- shapes: GGUF lists dimensions fastest-first ([in, out]); the numpy view is already (out, in).
- quantization: every tensor is dequantized to float32, then cast to the working dtype: Q8_0, Q4_0
  and Q4_1 (what most small files hold) by whole-array numpy code (dequantize_blocks: gguf.quants'
  arithmetic in its order, so the same bits, 2.5x faster here), every other type by
  gguf.quants.dequantize (F32, F16, BF16, Q5_0, Q5_1, Q2_K..Q6_K, IQ*: whatever the installed gguf
  package implements).
- gemma3 (treeattn.models.gemma3): its own names (GEMMA3_TENSOR_NAMES), every norm weight stored
  as Gemma's 1 + weight (the loader subtracts the 1, as transformers does), and llama.cpp's fixed
  layout: every 6th layer global, the others a sliding window of attention.sliding_window with
  RoPE base 10K. No Q/K permutation (llama.cpp runs Gemma with NEOX-style RoPE).
- the Q/K row permutation: for llama and mistral, llama.cpp's converter permutes the rows of
  attn_q / attn_k (weights and biases) per head from the rotate-half RoPE layout of Hugging Face
  checkpoints to the interleaved-pair layout of its own kernel; `unpermute_rows` inverts it
  (qwen2 files are written unpermuted: llama.cpp runs them with NEOX-style RoPE).
- rope_freqs.weight (Llama 3.1 files): llama.cpp's per-frequency divisors of the RoPE inverse
  frequencies, applied to model.inv_freq instead of a rope_scaling config.
- tied embeddings: a file without output.weight ties the output projection to token_embd.

Weight formats (weight_format): "dequantize" turns every tensor into `dtype` (above). "packed"
keeps every Q4_0, Q4_1, Q8_0, Q4_K, Q5_0 and Q6_K weight matrix (the projections, the token embeddings,
the output projection) in its blocks, as treeattn.models.packed's PackedLinear / PackedEmbedding,
multiplied by treeattn.ops.packed_linear without a float copy of the weight (at load, Q4_K regrouped into
q4_1 blocks of 32, Q5_0 and Q6_K widened into q8_0 blocks of int8 / int16 values: the same values); the
norms (F32) and float matrices (F32/F16/BF16) are loaded into `dtype` as before. It refuses, before
reading any weight, a matrix of another quantized type (Q5_1, Q2_K, Q3_K, Q5_K, IQ*: no kernel here) and a
device other than the CPU and CUDA (CUDA needs triton: treeattn.ops.packed_triton). "auto" keeps what
"packed" can keep on the CPU and dequantizes the rest (everything on a GPU: the Triton kernel has not
been timed on one yet).

Memory: the model is built on the "meta" device and each tensor is dequantized straight into its
parameter in the working dtype, a block of rows at a time (dequantize_to), so beside the finished
weights there are only the bounded float32 intermediates of one block (and the pages of the
memory-mapped file the OS keeps cached). Sequence parallelism shards the KV
cache, not the weights: every rank loads all of them.

Every check -- metadata keys, architecture, tensor names, shapes and types -- runs before the
first tensor is dequantized, and every error is one ValueError naming the file and the key or
tensor at fault, so nothing is half-loaded.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import torch

from treeattn.models.gemma3 import Gemma3Config
from treeattn.models.llama import LlamaConfig, LlamaModel
from treeattn.models.packed import WEIGHT_FORMATS, PackedEmbedding, PackedLinear
from treeattn.ops.packed_linear import BLOCK_BYTES as PACKED_BLOCK_BYTES, q4_k_as_q4_1, q5_0_as_q8_0, q6_k_as_q8_0, unpack_blocks

logger = logging.getLogger(__name__)

# general.architecture -> the Hugging Face architecture name our config uses
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}
# Architectures whose Q/K rows llama.cpp's converter permuted (see unpermute_rows).
PERMUTED_ARCHITECTURES = ("llama", "mistral")

# llama.cpp tensor name -> ours; {i} is the layer index.
TENSOR_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_gate.bias": "layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "layers.{i}.mlp.down_proj.bias",
}
# Gemma 3's names where they differ: its norm before the MLP is ffn_norm, and it has two more norms a
# layer and a norm per query/key head. Every *norm.weight of a gemma3 file holds Gemma's (1 + weight):
# llama.cpp's converter added the 1 (Gemma3RMSNorm scales by 1 + weight), the loader takes it off.
GEMMA3_TENSOR_NAMES = {
    **{k: v for k, v in TENSOR_NAMES.items() if k != "blk.{i}.ffn_norm.weight"},
    "blk.{i}.ffn_norm.weight": "layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.attn_q_norm.weight": "layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "layers.{i}.self_attn.k_norm.weight",
}
# llama.cpp's fixed Gemma 3 layout (llama-model.cpp): every 6th layer global, window layers' RoPE base 10K.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
ROPE_FREQS = "rope_freqs.weight"
# Quantized types the packed layers multiply in place (treeattn.ops.packed_linear), by their format name.
PACKED_TYPES = {gguf.GGMLQuantizationType.Q4_0: "q4_0", gguf.GGMLQuantizationType.Q4_1: "q4_1",
                gguf.GGMLQuantizationType.Q8_0: "q8_0"}
# Every type weight_format="packed" keeps, by the format its blocks are held in: the above as they are,
# Q4_K regrouped into q4_1 blocks of 32, Q5_0 and Q6_K widened into q8_0 blocks (int8 and int16 values):
# the same values exactly (treeattn.ops.packed_linear).
KEPT_TYPES = {**PACKED_TYPES, gguf.GGMLQuantizationType.Q4_K: "q4_1", gguf.GGMLQuantizationType.Q5_0: "q8_0",
              gguf.GGMLQuantizationType.Q6_K: "q8_0"}
# How each kept type's rows of blocks become the (qs, d, m) of its format.
_UNPACK = {**{t: functools.partial(unpack_blocks, fmt) for t, fmt in PACKED_TYPES.items()},
           gguf.GGMLQuantizationType.Q4_K: q4_k_as_q4_1, gguf.GGMLQuantizationType.Q5_0: q5_0_as_q8_0,
           gguf.GGMLQuantizationType.Q6_K: q6_k_as_q8_0}
FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
DEQUANTIZE_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per dequantization block
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def is_gguf(path) -> bool:
    """Whether `path` names a GGUF file (by its suffix)."""
    return str(path).lower().endswith(".gguf")


class _Reader(gguf.GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of its np.memmap (the same mapping, no copy). The
    reader slices its buffer once per metadata string (~100K times for a 49K-token vocabulary), and
    np.memmap's per-slice bookkeeping made opening SmolLM2's file 2-3x slower (5.8 s -> 2.2 s).
    With `tokenizer=False` the array values of the "tokenizer." keys (the vocabulary, scores, token
    types, merges: most of a file's metadata) are stepped over, not parsed, and have no field: for
    loads that build no tokenizer (an engine's rank)."""

    def __init__(self, path, tokenizer: bool = True) -> None:
        self._skipped_arrays = () if tokenizer else ("tokenizer.",)
        super().__init__(path)

    def _build_fields(self, offs, count):
        """The reader's loop over the metadata key-value pairs, stepping over the skipped arrays."""
        if not self._skipped_arrays:
            return super()._build_fields(offs, count)
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            key = str(bytes(kv_kdata), encoding="utf-8")
            if raw_kv_type[0] == gguf.GGUFValueType.ARRAY and key.startswith(self._skipped_arrays):
                offs += self._array_size(offs)
                continue
            field_size, field_parts, field_idxs, field_types = self._get_field_parts(offs, raw_kv_type[0])
            self._push_field(gguf.ReaderField(orig_offs, key, [kv_klen, kv_kdata, raw_kv_type, *field_parts],
                                              [idx + 3 for idx in field_idxs], field_types), skip_sum=True)
            offs += field_size
        return offs

    def _array_size(self, offs) -> int:
        """Bytes of the array value at `offs` (item type, length, items), read without parsing its items."""
        item = gguf.GGUFValueType(int(self._get(offs, np.uint32)[0]))
        count, start = int(self._get(offs + 4, np.uint64)[0]), offs
        offs += 12
        if item == gguf.GGUFValueType.STRING:
            memory, size = memoryview(self._buffer), len(self._buffer)
            for _ in range(count):
                if offs + 8 > size:
                    raise _Truncated(offs + 8, size, False)
                offs += 8 + int.from_bytes(memory[offs : offs + 8], "little")
            return offs - start
        nptype = self.gguf_scalar_to_np.get(item)
        if nptype is None:  # nested arrays: parsed as the reader does
            return self._get_field_parts(start, gguf.GGUFValueType.ARRAY)[0]
        return 12 + count * np.dtype(nptype).itemsize

    @property
    def data(self):
        return self._buffer

    @data.setter
    def data(self, value):
        self._buffer = value.view(np.ndarray)

    def _get(self, offset, dtype, count=1, override_order=None):
        """The reader's read of `count` items at `offset`, refusing one that runs past the file's end
        (numpy would hand back a shorter array, and the reader fail on it with a reshape error)."""
        end = int(offset) + int(np.empty([], dtype=dtype).itemsize) * int(count)
        if end > len(self._buffer):
            raise _Truncated(end, len(self._buffer), getattr(self, "_in_tensor_data", False))
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        """The reader's parts of one metadata value, an array of strings or numbers read in one
        pass instead of one recursive call per item (a 262K-token vocabulary: ~30 s -> ~1 s).
        The parts are the reader's own (a length and a bytes view per string, one view per number),
        so ReaderField.contents() reads them as before."""
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        item = gguf.GGUFValueType(int(raw_itype[0]))
        count, offs = int(alen[0]), orig_offs + 12
        buf = self._buffer
        if item == gguf.GGUFValueType.STRING:
            memory, size, starts, lengths = memoryview(buf), len(buf), [], []
            for _ in range(count):
                if offs + 8 > size:
                    raise _Truncated(offs + 8, size, False)
                n = int.from_bytes(memory[offs : offs + 8], "little")
                if offs + 8 + n > size:
                    raise _Truncated(offs + 8 + n, size, False)
                starts.append(offs + 8)
                lengths.append(n)
                offs += 8 + n
            lens = np.array(lengths, dtype=np.uint64)
            parts = [raw_itype, alen]
            for i, (start, n) in enumerate(zip(starts, lengths)):
                parts += (lens[i : i + 1], buf[start : start + n])
            return offs - orig_offs, parts, list(range(3, 2 * count + 2, 2)), [gguf.GGUFValueType.ARRAY, item]
        nptype = self.gguf_scalar_to_np.get(item)
        if nptype is None:  # nested arrays: the reader's own recursion
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, count)
        parts = [raw_itype, alen, *(values[i : i + 1] for i in range(count))]
        return 12 + int(values.nbytes), parts, list(range(2, count + 2)), [gguf.GGUFValueType.ARRAY, item]

    def _build_tensors(self, start_offs, fields):
        self._in_tensor_data = True  # the header (metadata, tensor infos) is read: what follows is tensor data
        return super()._build_tensors(start_offs, fields)


class _Truncated(Exception):
    """A read past the end of a GGUF file: (the byte it needs, the file's size)."""

    def __init__(self, end: int, size: int, in_tensor_data: bool) -> None:
        super().__init__(end, size)
        self.end, self.size, self.in_tensor_data = end, size, in_tensor_data


class _SharedReaders:
    """The readers open_gguf hands out again while shared_readers() is open (see there)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.readers: dict[tuple, object] = {}


_SHARED = _SharedReaders()


@contextlib.contextmanager
def shared_readers() -> Iterator[None]:
    """While this block is open (in any thread), open_gguf parses each file once and hands the same
    reader out again, as long as the file is unchanged on disk (same resolved path, size, mtime_ns and
    inode). For start-ups that read one file's chat template, config, tokenizer and sizes in several
    places (ta.Engine's checks, `treeattn serve`). Blocks nest; the readers (a reader holds the parsed
    metadata: about 74 MiB for a 49k-token vocabulary) are dropped when the outermost block ends.

        with shared_readers():
            template, files = read_chat_template(path), read_model_files(path)   # one parse of path
    """
    with _SHARED.lock:
        _SHARED.depth += 1
    try:
        yield
    finally:
        with _SHARED.lock:
            _SHARED.depth -= 1
            if _SHARED.depth == 0:
                _SHARED.readers.clear()


def open_gguf(path: str | os.PathLike, *, tokenizer: bool = True):
    """gguf.GGUFReader over `path` (memory-mapped). Raises FileNotFoundError, or ValueError naming the
    file for anything the reader cannot parse (bad magic, truncated header or tensor data). Inside
    shared_readers(), an unchanged file's reader is parsed once and returned again. tokenizer=False:
    the tokenizer's arrays (vocabulary, scores, merges) are stepped over, not parsed (a load that
    builds no tokenizer; about 0.4 s of SmolLM2's 0.6 s parse here), and absent from reader.fields."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    if _SHARED.depth == 0:
        return _open_gguf(path, tokenizer)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, tokenizer)
    with _SHARED.lock:
        reader = _SHARED.readers.get(key)
    if reader is None:
        reader = _open_gguf(path, tokenizer)
        with _SHARED.lock:
            if _SHARED.depth > 0:
                reader = _SHARED.readers.setdefault(key, reader)
    return reader


def _open_gguf(path: Path, tokenizer: bool = True):
    try:
        reader = _Reader(path, tokenizer)
    except _Truncated as cut:
        what = "tensor data" if cut.in_tensor_data else "header"
        raise ValueError(f"{path}: truncated: {what} ends at byte {cut.end}, the file has {cut.size}") from None
    except Exception as exc:  # the reader raises ValueError, IndexError, struct/numpy errors on damaged files
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {type(exc).__name__}: {exc}") from exc
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ValueError(f"{path}: truncated: tensor data ends at byte {end}, the file has {path.stat().st_size}")
    return reader


def metadata(reader, key: str, default=..., *, path=None):
    """The value of metadata `key` (str, int, float, bool or list), `default` if absent.
    Without a default a missing key raises ValueError naming the file and the key."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(f"{path or 'GGUF file'}: missing metadata key {key!r}")
        return default
    return field.contents()


def read_gguf_config(path_or_reader, *, path: str | os.PathLike | None = None) -> LlamaConfig:
    """A LlamaConfig from the file's metadata ({arch}.block_count, .embedding_length, ...).

    The vocabulary size and whether the embeddings are tied come from the tensors themselves
    (token_embd's rows; output.weight present or not), which is what llama.cpp does too.
    """
    reader = open_gguf(path_or_reader) if isinstance(path_or_reader, (str, os.PathLike)) else path_or_reader
    path = path or (path_or_reader if isinstance(path_or_reader, (str, os.PathLike)) else "GGUF file")
    arch = metadata(reader, "general.architecture", path=path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported architecture {arch!r} (metadata general.architecture); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key, kind, default=...):
        value = metadata(reader, f"{arch}.{key}", default, path=path)
        if value is not None and value is not default and not (isinstance(value, kind) and not isinstance(value, bool)):
            raise ValueError(f"{path}: metadata {arch}.{key} must be {kind.__name__}, got {value!r}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no tensor 'token_embd.weight' (the token embedding)")
    hidden = get("embedding_length", int)
    heads = get("attention.head_count", int)
    layers = get("block_count", int)
    head_dim = get("attention.key_length", int, hidden // heads if heads else 0)
    rope_dim = get("rope.dimension_count", int, head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count={rope_dim} rotates part of each head; only full rotary "
                         f"embeddings (= head dim {head_dim}) are supported")
    kv_heads = get("attention.head_count_kv", int, heads)
    rope_type, rope_scaling = _rope_scaling(reader, arch, path)
    window = get("attention.sliding_window", int, None) if arch in ("mistral", "gemma3") else None
    eos = [metadata(reader, f"tokenizer.ggml.{k}", None) for k in ("eos_token_id", "eot_token_id")]
    config_class, extra = LlamaConfig, {}
    if arch == "gemma3":
        from treeattn.models.gemma3 import gemma3_layer_windows

        # As llama.cpp (llama-model.cpp): queries scaled by key_length ** -0.5, except the 62-layer 27B
        # model's (hidden / heads) ** -0.5; these are the checkpoints' query_pre_attn_scalar.
        config_class = Gemma3Config
        scalar = hidden / heads if layers == 62 else head_dim
        extra = dict(query_pre_attn_scalar=float(scalar), rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
                     final_logit_softcapping=get("final_logit_softcapping", float, None))
        if window is None:
            raise ValueError(f"{path}: missing metadata key 'gemma3.attention.sliding_window'")
    try:
        return config_class(
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length", int),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", float, 1e-5)),
            rope_theta=float(get("rope.freq_base", float, 10000.0)),
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            o_bias="blk.0.attn_output.bias" in tensors,
            mlp_bias="blk.0.ffn_up.bias" in tensors,
            layer_windows=gemma3_layer_windows(layers, window,
                                               GEMMA3_SLIDING_WINDOW_PATTERN) if arch == "gemma3" else (window,) * layers,
            max_position_embeddings=get("context_length", int, 4096),
            architecture=SUPPORTED_ARCHITECTURES[arch],
            bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            **extra,
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def load_gguf_model(path_or_reader, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    path: str | os.PathLike | None = None, weight_format: str = "dequantize",
                    shard: dict | None = None) -> LlamaModel:
    """Load a GGUF file into a LlamaModel, dequantizing every tensor to `dtype` or keeping the quantized
    matrices packed.

    Args:
        path_or_reader: the .gguf file, or a reader of it from open_gguf (then `path` names it).
        dtype: parameter dtype (float32, bfloat16, float16); the activations' dtype of a packed model.
        device: where the parameters live.
        weight_format: "dequantize", "packed" or "auto" (WEIGHT_FORMATS; see the module doc).
        shard: parameter name -> treeattn.models.shards.Cut: only that share of each named tensor
            is read (rows; or columns on the file's block boundaries, else a ValueError naming the
            tensor), packed matrices as the file's bytes (treeattn.models.loader.load_model).

    Returns:
        A LlamaModel in eval mode (model.config from the metadata). Its tokenizer and chat template
        are read by treeattn.models.loader.load_model, not here.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unreadable or truncated file, unsupported architecture, missing metadata, a
            missing, unexpected or misshapen tensor, or a tensor type gguf cannot dequantize; with
            weight_format="packed", a matrix no packed kernel reads, or a device other than the CPU and
            CUDA (CUDA without triton).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if isinstance(path_or_reader, (str, os.PathLike)):
        path, reader = Path(path_or_reader), open_gguf(path_or_reader)
    else:
        reader = path_or_reader
    config = read_gguf_config(reader, path=path)
    from treeattn.models.families import model_class

    model = model_class(config)(config, dtype=dtype, device="meta")
    plan, rope_freqs = _match_tensors(model, reader, path)  # every check before any dequantization
    packed = packed_tensors(plan, weight_format, device, path)
    shard = shard or {}
    if shard:
        from treeattn.models.shards import shard_model

        shard_model(model, shard)  # the skeleton's shapes are the shares read below

    arch = metadata(reader, "general.architecture")
    state: dict[str, torch.Tensor] = {}
    for ours, tensor in plan.items():
        if ours in packed:
            continue
        cut = shard.get(ours)
        weight = dequantize_to(tensor, dtype=dtype, device=device) if cut is None else _share(tensor, cut, dtype, device, path)
        heads = weight.shape[0] // config.head_dim  # a share holds whole heads
        if arch in PERMUTED_ARCHITECTURES and ours.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            weight = _unpermuted(weight, heads)
        elif arch == "gemma3" and ours.endswith("norm.weight"):
            weight = (weight.float() - 1.0).to(dtype)  # the file holds 1 + weight (see GEMMA3_TENSOR_NAMES)
        state[ours] = weight
    for ours in packed:  # the packed layers replace their modules; their buffers go in the state too
        raw = share_rows(plan[ours], shard.get(ours), path)  # uint8 (rows, bytes of a row's blocks)
        if arch in PERMUTED_ARCHITECTURES and ours.endswith(("q_proj.weight", "k_proj.weight")):
            raw = unpermute_rows(raw, raw.shape[0] // config.head_dim)
        name = ours.removesuffix(".weight")
        fmt = KEPT_TYPES[plan[ours].tensor_type]
        qs, d, m = (None if t is None else t.to(device) for t in _UNPACK[plan[ours].tensor_type](raw))  # made on the CPU
        layer = (PackedEmbedding(fmt, qs, d, m) if name == "embed_tokens" else
                 PackedLinear(fmt, qs, d, m, bias=state.get(name + ".bias")))
        model.set_submodule(name, layer)
        state.update({f"{name}.{key}": value for key, value in layer.state_dict().items()})
    model.load_state_dict(state, strict=True, assign=True)
    model.helix_cuts = shard or None
    model.inv_freq = model.inv_freq.to(device)
    if rope_freqs is not None:  # llama.cpp divides each inverse frequency by its factor
        model.inv_freq = model.inv_freq / torch.from_numpy(dequantize(rope_freqs).copy()).to(device=device, dtype=torch.float32)
    logger.info("loaded %s (%s, %d tensors, %d kept packed) as %s on %s", path, arch, len(plan), len(packed), dtype, device)
    return model.eval()


def packed_tensors(plan: dict, weight_format: str, device, path) -> set[str]:
    """Our names of the tensors of `plan` that `weight_format` keeps packed (module doc): none for
    "dequantize"; every Q4_0/Q4_1/Q8_0/Q4_K/Q5_0/Q6_K weight matrix for "packed" and, on the CPU, "auto". Raises
    ValueError naming weight_format for what "packed" cannot keep."""
    if weight_format == "dequantize" or (weight_format == "auto" and torch.device(device).type != "cpu"):
        return set()
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda") or (kind == "cuda" and importlib.util.find_spec("triton") is None):
        raise ValueError(f"weight_format='packed' runs on the CPU (numba's kernel) and on CUDA with triton installed "
                         f"(treeattn.ops.packed_triton), got device {str(device)!r}"
                         f"{' without triton' if kind == 'cuda' else ''}: use weight_format='dequantize'")
    keep = {ours for ours, t in plan.items() if ours.endswith(".weight") and len(t.shape) == 2 and t.tensor_type in KEPT_TYPES}
    if weight_format == "packed":
        other = [(ours, t) for ours, t in plan.items() if len(t.shape) == 2 and t.tensor_type not in KEPT_TYPES
                 and t.tensor_type not in FLOAT_TYPES]
        if other:
            raise ValueError(f"weight_format='packed' keeps Q4_0, Q4_1, Q8_0, Q4_K, Q5_0 and Q6_K matrices; {path} has "
                             f"{other[0][1].name!r} in "
                             f"{other[0][1].tensor_type.name} (and {len(other) - 1} more of other types): use "
                             f"weight_format='auto' (dequantizes those) or 'dequantize'")
        if not keep:
            raise ValueError(f"weight_format='packed': {path} has no Q4_0, Q4_1, Q8_0, Q4_K, Q5_0 or Q6_K matrix to keep; use "
                             f"weight_format='dequantize'")
    return keep


def dequantize(tensor) -> np.ndarray:
    """float32 numpy array of a gguf ReaderTensor, in numpy (row-major) order: (out, in) for a
    weight matrix. A view of the memory-mapped file for F32 tensors, a new array otherwise."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)


# bytes per block of 32 values (a float16 scale d, Q4_1's float16 minimum m, then the quants), by
# quantization type: the packed formats' table (treeattn.ops.packed_linear.BLOCK_BYTES)
BLOCK_BYTES = {tensor_type: PACKED_BLOCK_BYTES[fmt] for tensor_type, fmt in PACKED_TYPES.items()}


def dequantize_blocks(raw: np.ndarray, tensor_type, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of whole Q8_0 / Q4_0 / Q4_1 blocks, (n_blocks, 32), any other type through
    gguf.quants.dequantize (then shaped as it returns them).

    The arithmetic is gguf.quants' (float16 scales widened to float32; Q8_0: q * d, Q4_0: d * (q - 8),
    Q4_1: d * q + m; the low nibbles of the 16 quant bytes are values 0-15, the high ones 16-31), so the
    values are bit for bit the same; it runs on whole arrays where gguf.quants splits the rows into
    groups first (SmolLM2's Q4_1 file: 0.49 s instead of 1.3 s, one core).

    Args:
        raw: uint8 rows of whole blocks (any leading shape whose rows hold whole blocks).
        out: optional C-contiguous float32 array of as many values to write them into (then returned).
    """
    block_bytes = BLOCK_BYTES.get(tensor_type)
    if block_bytes is None:
        values = gguf.quants.dequantize(raw, tensor_type)
        if out is None:
            return values
        out[...] = values.reshape(out.shape)
        return out
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    values = np.empty((blocks.shape[0], 32), np.float32) if out is None else out.reshape(blocks.shape[0], 32)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    if tensor_type == gguf.GGMLQuantizationType.Q8_0:
        values[...] = blocks[:, 2:].view(np.int8)
        values *= d
        return values if out is None else out
    quants = blocks[:, 4:] if tensor_type == gguf.GGMLQuantizationType.Q4_1 else blocks[:, 2:]
    nibbles = np.empty((blocks.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(quants, 0x0F, out=nibbles[:, :16])
    np.right_shift(quants, 4, out=nibbles[:, 16:])
    values[...] = nibbles
    if tensor_type == gguf.GGMLQuantizationType.Q4_0:
        values -= 8.0
    values *= d
    if tensor_type == gguf.GGMLQuantizationType.Q4_1:
        values += blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return values if out is None else out


def dequantize_to(tensor, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                  chunk_elements: int = DEQUANTIZE_CHUNK_ELEMENTS) -> torch.Tensor:
    """A gguf ReaderTensor as a new torch tensor of `dtype` on `device`, in numpy order ((out, in)
    for a weight matrix), dequantized a block of rows at a time: the float32 intermediates (gguf's
    numpy dequantization makes several) stay bounded by `chunk_elements`, whatever the tensor's size.

    float32 on the CPU is written by numpy straight into the tensor's memory (one thread, no copy):
    torch's copies of the blocks ran 2-3x slower when its thread pool contended for a busy machine's
    cores (SmolLM2 at load average 9: 5.7 s with 2 threads, 2.0 s with 1)."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        values = np.empty(shape, np.float32)
        if len(shape) == 1:
            dequantize_blocks(tensor.data, tensor.tensor_type, out=values)
            return torch.from_numpy(values)
        data, flat = tensor.data.reshape(shape[0], -1), values.reshape(shape[0], -1)
        rows = max(1, chunk_elements // flat.shape[1])
        for start in range(0, shape[0], rows):
            dequantize_blocks(data[start : start + rows], tensor.tensor_type, out=flat[start : start + rows])
        return torch.from_numpy(values)
    out = torch.empty(shape, dtype=dtype, device=device)
    if len(shape) == 1:  # norms and biases: small, dequantized whole
        out.copy_(torch.from_numpy(dequantize_blocks(tensor.data, tensor.tensor_type).reshape(shape).copy()))
        return out
    data = tensor.data.reshape(shape[0], -1)  # one row of the tensor per row (bytes of blocks when quantized)
    rows = max(1, chunk_elements // (out.numel() // shape[0]))
    for start in range(0, shape[0], rows):
        block = dequantize_blocks(data[start : start + rows], tensor.tensor_type)
        if not block.flags.writeable:  # F32: a view of the read-only file mapping
            block = block.copy()
        out[start : start + rows] = torch.from_numpy(block).reshape(-1, *shape[1:])
    return out


def packed_block(path, names=("attn_output.weight", "ffn_down.weight")) -> int:
    """The largest block (weights along a row) of the matrices of layer 0 of a GGUF file named
    blk.0.<name> for `names` (the matrices a tensor-parallel plan splits by columns): 32 for Q4_0,
    Q4_1, Q8_0 and Q5_0, 256 for the K-quants, 1 for float types."""
    reader = open_gguf(path, tokenizer=False)
    wanted = {f"blk.0.{name}" for name in names}
    return max([gguf.GGML_QUANT_SIZES[t.tensor_type][0] for t in reader.tensors if t.name in wanted], default=1)


def share_rows(tensor, cut, path=None) -> np.ndarray:
    """The file's data of a ReaderTensor's share `cut` (a treeattn.models.shards.Cut of the numpy-order
    (out, in) tensor, or None: all of it), as rows: (rows, a row's blocks in the file's units), no
    copy of the rest. Columns are cut on the type's block boundaries (ValueError naming the tensor
    otherwise); a 1-D tensor is one row per value."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    data = np.asarray(tensor.data).reshape(shape[0], -1)
    if cut is None:
        return data
    if cut.dim == 0:
        return data[cut.start : cut.stop]
    block = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
    if cut.start % block or cut.stop % block:
        raise ValueError(f"{path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) is stored in blocks of {block} columns; "
                         f"this rank's columns [{cut.start}, {cut.stop}) do not start and end on a block boundary")
    units = data.shape[1] // (shape[1] // block)  # of the data's dtype per block
    return data[:, cut.start // block * units : cut.stop // block * units]


def _share(tensor, cut, dtype: torch.dtype, device, path) -> torch.Tensor:
    """A ReaderTensor's share `cut` dequantized to `dtype` on `device` (share_rows, then its values)."""
    raw = share_rows(tensor, cut, path)
    rows = raw.shape[0]
    values = dequantize_blocks(np.ascontiguousarray(raw), tensor.tensor_type).reshape(rows, -1)
    weight = torch.from_numpy(np.array(values, dtype=np.float32))
    if len(tensor.shape) == 1:
        weight = weight.reshape(-1)
    return weight.to(device=device, dtype=dtype)


def can_dequantize(tensor_type) -> bool:
    """Whether the installed gguf package can dequantize this GGMLQuantizationType."""
    return tensor_type in (gguf.GGMLQuantizationType.F32,
                           gguf.GGMLQuantizationType.F16) or tensor_type in gguf.quants._type_traits


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) reorders the rows of each
    head, (heads, 2, D/2) -> (heads, D/2, 2): the two rotate-half partners (i, i + D/2) of the
    Hugging Face layout become neighbours (2i, 2i + 1), as llama.cpp's RoPE kernel pairs them.
    This is the inverse: (heads, D/2, 2) -> (heads, 2, D/2).

    Args:
        weight: (heads * D, ...) float32 rows of attn_q or attn_k (weight or bias).
        heads: number of heads the rows belong to (query heads for Q, KV heads for K).
    """
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _unpermuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """unpermute_rows of a parameter: by numpy for float32 on the CPU (one thread, see dequantize_to)."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return torch.from_numpy(np.ascontiguousarray(unpermute_rows(weight.numpy(), heads)))
    return unpermute_rows(weight, heads).contiguous()


def _match_tensors(model: LlamaModel, reader, path) -> tuple[dict, object | None]:
    """(our parameter name -> ReaderTensor, rope_freqs tensor or None), every name, shape and type
    checked against the model skeleton."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    names = tensor_names(metadata(reader, "general.architecture"))
    plan, unexpected, rope_freqs = {}, [], None
    for tensor in reader.tensors:
        name = tensor.name
        if name == ROPE_FREQS:
            rope_freqs = tensor
            shape = (model.config.head_dim // 2,)
            ours = ROPE_FREQS
        else:
            ours = _our_name(name, names)
            if ours is None or ours not in expected:
                unexpected.append(name)
                continue
            shape = expected[ours]
        actual = tuple(int(n) for n in reversed(tensor.shape))
        if actual != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {actual}, but the metadata implies {shape}")
        if not can_dequantize(tensor.tensor_type):
            raise ValueError(f"{path}: tensor {name!r} has type {tensor.tensor_type.name}, which the installed gguf "
                             f"package cannot dequantize")
        if ours != ROPE_FREQS:
            plan[ours] = tensor
    if unexpected:
        shown = ", ".join(repr(n) for n in unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        raise ValueError(f"{path}: tensors the {model.config.architecture} layout does not have: {shown}")
    missing = [name for name in expected if name not in plan]
    if missing:
        raise ValueError(f"{path}: missing {len(missing)} tensors, e.g. {_gguf_name(missing[0], names)!r}")
    return plan, rope_freqs


def tensor_names(arch: str) -> dict[str, str]:
    """llama.cpp tensor name -> ours for the architecture `arch` (general.architecture)."""
    return GEMMA3_TENSOR_NAMES if arch == "gemma3" else TENSOR_NAMES


def _our_name(gguf_name: str, names: dict[str, str]) -> str | None:
    match = _LAYER_NAME.match(gguf_name)
    if match is None:
        return names.get(gguf_name)
    pattern = names.get("blk.{i}." + match.group(2))
    return pattern.format(i=match.group(1)) if pattern is not None else None


def _gguf_name(ours: str, names: dict[str, str]) -> str:
    for theirs, pattern in names.items():
        match = re.fullmatch(re.escape(pattern).replace(r"\{i\}", r"(\d+)"), ours)
        if match:
            return theirs.format(i=match.group(1)) if match.groups() else theirs
    return ours


def _rope_scaling(reader, arch: str, path) -> tuple[str, dict]:
    """(rope_type, scaling parameters) from {arch}.rope.scaling.*: none or linear."""
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return "default", {}
    if kind == "linear":
        factor = metadata(reader, f"{arch}.rope.scaling.factor", path=path)
        return "linear", {"factor": float(factor)}
    raise ValueError(f"{path}: unsupported RoPE scaling {kind!r} (metadata {arch}.rope.scaling.type); supported: none, linear")


__all__ = [
    "KEPT_TYPES",
    "PACKED_TYPES",
    "PERMUTED_ARCHITECTURES",
    "WEIGHT_FORMATS",
    "SUPPORTED_ARCHITECTURES",
    "TENSOR_NAMES",
    "can_dequantize",
    "dequantize",
    "dequantize_blocks",
    "load_gguf_model",
    "metadata",
    "open_gguf",
    "packed_tensors",
    "read_gguf_config",
    "unpermute_rows",
]
