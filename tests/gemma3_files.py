"""Tiny Gemma 3 checkpoints for the tests, written the way their real counterparts are.

hf_gemma3(...) is a transformers Gemma3ForCausalLM with random weights (norm weights random too, so
Gemma's 1 + weight is exercised); write_gemma3_gguf(path, hf_model) writes it as llama.cpp's
converter writes google/gemma-3-270m: architecture gemma3, every norm weight stored as 1 + weight
(F32), and the matrices in the real file's tensor types -- attn_q, attn_k, ffn_gate, ffn_up Q5_0;
attn_v and token_embd Q8_0 (gguf's own quantizer); attn_output Q4_K and ffn_down Q6_K, which gguf
cannot quantize: those get random well-formed blocks (small scales), so the file's weights differ
from the HF model's there and the oracle is transformers loading the same file (gguf_file=). The
vocabulary is Gemma's layout in miniature: control tokens, user-defined newline and space runs
(space runs stored as spaces), the 256 byte tokens, then pieces in merge order.
"""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import torch

from treeattn.models.attention import LocalAttention

Q = gguf.GGMLQuantizationType
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER = ["\n", "\n\n", "  ", "   "]
PIECES = ["▁", "t", "h", "e", "a", "c", "o", "w", "r", "l", "d", "s", "n", "i", "f", "x", "y", "m", "p", "u", "g", "b", "k",
          "he", "▁t", "▁the", "at", "▁c", "▁cat", "or", "▁w", "▁wor", "ld", "▁world", "in", "▁s", "▁sk", "▁sky", "▁b", "lu",
          "▁blu", "e."]
TOKENS = CONTROL + USER + [f"<0x{b:02X}>" for b in range(256)] + PIECES
TYPES = [3] * len(CONTROL) + [4] * len(USER) + [6] * 256 + [1] * len(PIECES)
VOCAB = len(TOKENS)
WINDOW = 4

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
# the real file's type of each matrix
TYPES_OF = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_0, "attn_v": Q.Q8_0, "token_embd": Q.Q8_0,
            "attn_output": Q.Q4_K, "ffn_down": Q.Q6_K}


def hf_gemma3(*, layers: int = 6, seed: int = 0, window: int = WINDOW, context: int = 256, multimodal: bool = False,
              heads: int = 2, head_dim: int = 256):
    """A tiny transformers Gemma3ForCausalLM (or, multimodal=True, Gemma3ForConditionalGeneration
    around the same text model): hidden 64, 2 query heads of 256 (as the real model: llama.cpp scales
    queries by head_dim ** -0.5, transformers by its default query_pre_attn_scalar 256), 1 KV head, MLP 256 (row lengths the
    K-quants' 256-element blocks fit), every 6th layer global, window `window`; `heads` and `head_dim` change the
    query heads and their size (query_pre_attn_scalar follows head_dim)."""
    import transformers

    torch.manual_seed(seed)
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=1, head_dim=head_dim, sliding_window=window, max_position_embeddings=context,
        query_pre_attn_scalar=head_dim,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        initializer_range=0.1, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True)
    model = transformers.Gemma3ForCausalLM(text).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)
    if not multimodal:
        return model
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    full = transformers.Gemma3ForConditionalGeneration(config).eval()
    full.model.language_model.load_state_dict(model.model.state_dict())
    return full


def _raw_k_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random well-formed Q4_K / Q6_K blocks for a (rows, cols) matrix: random quants and scales,
    the f16 super-block scales set small so that weights stay O(0.1)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-4 if qtype == Q.Q4_K else 1e-4).tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin, scales[12], qs[128]
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: ql[128], qh[64], scales[16], d
        raw[..., 208:210] = scale
    return raw.reshape(rows, -1)


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _NAMES:
        return _NAMES[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{_NAMES[rest]}"


def write_gemma3_gguf(path, hf_model, *, seed: int = 0, context_length: int = 256, tokenizer: bool = True) -> None:
    """Write the transformers Gemma3ForCausalLM `hf_model` as a gemma3 GGUF (see the module docstring)."""
    cfg = hf_model.config
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(context_length)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["full_attention"]["rope_theta"]))
    writer.add_sliding_window(cfg.sliding_window)
    if tokenizer:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(TOKENS)
        writer.add_token_types(TYPES)
        writer.add_token_scores([-1000.0] * len(CONTROL) + [0.0] * (len(TOKENS) - len(CONTROL)))
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        name, data = gguf_tensor_name(hf_name), tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            writer.add_tensor(name, data + 1.0)  # llama.cpp's converter stores Gemma's 1 + weight
            continue
        qtype = TYPES_OF[name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]]
        if qtype in (Q.Q4_K, Q.Q6_K):
            raw = _raw_k_blocks(*data.shape, qtype, rng)
        else:
            raw = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ours_logits(model, ids: list[int]) -> torch.Tensor:
    """(S, V) float32 prefill logits of our model over `ids`, no cache."""
    positions = torch.arange(len(ids))[None]

    def store(layer, k, v):
        return k, v, positions

    with torch.no_grad():
        return model.logits(model(torch.tensor([ids]), positions, store, LocalAttention()))[0]
