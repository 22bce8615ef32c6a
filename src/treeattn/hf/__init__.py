"""treeattn.hf: tree decoding for transformers' own models (Llama, Qwen2/3, Mistral, Gemma 2, Phi-3, ...).

    import treeattn.hf as tahf
    model = AutoModelForCausalLM.from_pretrained(path).eval()       # on every rank
    out_ids = tahf.generate(model, input_ids, max_new_tokens=64, group=None)

Importing this package registers the "treeattn" attention implementation with transformers'
AttentionInterface (treeattn.hf.attention) and provides ShardedCache (treeattn.hf.cache), the
Cache that holds only this rank's shard; tahf.generate (treeattn.hf.generate) drives both around
model.generate. transformers is an optional dependency (pip install 'treeattn[hf]'): nothing in
treeattn imports this package unless asked. See docs/hf.md.
"""

from __future__ import annotations

from treeattn.hf.compat import TESTED_ARCHITECTURES, check_model, check_transformers_version

check_transformers_version()

from transformers import AttentionInterface  # noqa: E402

from treeattn.hf.attention import ATTN_IMPLEMENTATION, sharded_attention  # noqa: E402
from treeattn.hf.cache import ShardedCache  # noqa: E402
from treeattn.hf.generate import generate  # noqa: E402

AttentionInterface.register(ATTN_IMPLEMENTATION, sharded_attention)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ShardedCache",
    "TESTED_ARCHITECTURES",
    "check_model",
    "check_transformers_version",
    "generate",
    "sharded_attention",
]
