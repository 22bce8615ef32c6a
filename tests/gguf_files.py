"""Small GGUF files for the tests, written the way llama.cpp's converter writes them.

write_gguf(path, hf_model, qtype) takes a transformers Llama/Qwen2 model and writes its weights
with gguf's GGUFWriter: llama.cpp tensor names, Q/K rows permuted for llama (LlamaModel.permute of
convert_hf_to_gguf.py), 1-D tensors in F32, matrices in `qtype` quantized by gguf.quants.quantize.
A tiny byte-level BPE vocabulary (the 256 byte symbols, three merges, ChatML control tokens) and a
ChatML template go in the metadata. roundtrip(weight, qtype) is what a loader must get back.
"""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import torch

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-7B-Instruct, as llama.cpp's
# models/templates/ keeps it): it renders `tools` and tool calls as the hermes format.
QWEN25_TOOLS = ('{%- if tools %}\n    {{- \'<|im_start|>system\\n\' }}\n    {%- if messages[0][\'role\'] == \'system\' %}\n      '
                '  {{- messages[0][\'content\'] }}\n    {%- else %}\n        {{- \'You are Qwen, created by Alibaba Cloud. You '
                'are a helpful assistant.\' }}\n    {%- endif %}\n    {{- "\\n\\n# Tools\\n\\nYou may call one or more '
                'functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> '
                'XML tags:\\n<tools>" }}\n    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    '
                '{%- endfor %}\n    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
                'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
                '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n    {%- if '
                'messages[0][\'role\'] == \'system\' %}\n        {{- \'<|im_start|>system\\n\' + messages[0][\'content\'] + '
                '\'<|im_end|>\\n\' }}\n    {%- else %}\n        {{- \'<|im_start|>system\\nYou are Qwen, created by Alibaba '
                'Cloud. You are a helpful assistant.<|im_end|>\\n\' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in '
                'messages %}\n    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
                '(message.role == "assistant" and not message.tool_calls) %}\n        {{- \'<|im_start|>\' + message.role + '
                '\'\\n\' + message.content + \'<|im_end|>\' + \'\\n\' }}\n    {%- elif message.role == "assistant" %}\n        '
                '{{- \'<|im_start|>\' + message.role }}\n        {%- if message.content %}\n            {{- \'\\n\' + '
                'message.content }}\n        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n            {%- '
                'if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n            '
                '{%- endif %}\n            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n          '
                '  {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n            {{- '
                '\'}\\n</tool_call>\' }}\n        {%- endfor %}\n        {{- \'<|im_end|>\\n\' }}\n    {%- elif message.role == '
                '"tool" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n            {{- '
                '\'<|im_start|>user\' }}\n        {%- endif %}\n        {{- \'\\n<tool_response>\\n\' }}\n        {{- '
                'message.content }}\n        {{- \'\\n</tool_response>\' }}\n        {%- if loop.last or (messages[loop.index0 '
                '+ 1].role != "tool") %}\n            {{- \'<|im_end|>\\n\' }}\n        {%- endif %}\n    {%- endif %}\n{%- '
                'endfor %}\n{%- if add_generation_prompt %}\n    {{- \'<|im_start|>assistant\\n\' }}\n{%- endif %}\n')


def byte_symbols() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (bytes_to_unicode), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """(tokens, token types): control tokens first, then the bytes, then the merged pieces."""
    tokens = CONTROL_TOKENS + byte_symbols() + ["Ġt", "he", "Ġthe"]
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS))
    return tokens, types


VOCAB = len(vocabulary()[0])  # 262

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _NAMES:
        return _NAMES[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    for ours, theirs in _NAMES.items():
        if rest.startswith(ours):
            return f"blk.{layer}.{theirs}{rest[len(ours):]}"
    raise KeyError(hf_name)


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: rotate-half row order -> interleaved pairs, per head."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def roundtrip(weight: np.ndarray, qtype) -> np.ndarray:
    """float32 `weight` after quantizing to `qtype` and back (what a GGUF of it holds)."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return weight
    if qtype == gguf.GGMLQuantizationType.F16:
        return weight.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype).reshape(weight.shape)


def write_gguf(path, hf_model, qtype, *, arch: str = "llama", tokenizer: bool = True, chat_template: str | None = CHATML,
               raw_types: dict | None = None, context_length: int = 64) -> None:
    """Write `hf_model` (transformers Llama/Qwen2) as a GGUF file; raw_types: tensor name -> a
    GGMLQuantizationType to store that tensor as (zero bytes of the right size), for error tests."""
    cfg = hf_model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context_length)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    if tokenizer:
        add_tokenizer(writer)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, data = gguf_name(hf_name), tensor.detach().float().numpy()
        if arch == "llama" and ".attn_q." in name:
            data = permute(data, heads)
        elif arch == "llama" and ".attn_k." in name:
            data = permute(data, kv_heads)
        if raw_types and name in raw_types:
            kind = raw_types[name]
            block, size = gguf.GGML_QUANT_SIZES[kind]
            raw = np.zeros((data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
        elif data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            quantized = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def roundtrip_model(hf_model, qtype):
    """A copy of `hf_model` whose matrices went through `qtype` and back (1-D tensors stay F32)."""
    import copy

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.copy_(torch.from_numpy(roundtrip(param.float().numpy(), qtype)))
    return model


SPM_PIECES = ["▁", "t", "h", "e", "a", "c", "o", "w", "r", "l", "d", "s", "▁t", "he", "▁the", "at", "▁c", "▁cat", "or", "▁w",
              "▁wor", "ld", "▁world"]


def write_spm_gguf(path, hf_model) -> None:
    """A GGUF whose tokenizer is SentencePiece BPE (tokenizer.ggml.model "llama": Llama 2, Mistral):
    <unk> <s> </s>, the 256 byte pieces <0x00>..<0xFF>, then SPM_PIECES scored best-first.
    `hf_model` must have vocab_size == 3 + 256 + len(SPM_PIECES); its weights are stored in F32."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    writer = gguf.GGUFWriter(str(path), "llama")
    cfg = hf_model.config
    writer.add_context_length(64)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for hf_name, tensor in hf_model.state_dict().items():
        data = tensor.detach().float().numpy()
        name = gguf_name(hf_name)
        if ".attn_q." in name:
            data = permute(data, cfg.num_attention_heads)
        elif ".attn_k." in name:
            data = permute(data, cfg.num_key_value_heads)
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tokenizer(writer) -> None:
    """Write the tiny byte-level BPE tokenizer (vocabulary(), MERGES, BOS 1, EOS 2) into a GGUFWriter."""
    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
