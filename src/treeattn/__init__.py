"""treeattn: exact attention for decoding from sequence-sharded long-context KV caches.

    import treeattn as ta
    out, lse = ta.attention(q, k, v)                      # one device, (out, lse)
    out, lse = ta.merge_states(out_a, lse_a, out_b, lse_b) # exact merge of partial states
"""

from treeattn.ops import (
    attention,
    attention_via_energy,
    energy,
    merge_states,
    merge_states_list,
    reference_attention,
)
from treeattn.parallel import Topology, comm_stats, ring_attention, ring_decode, spawn, tree_decode
from treeattn.ops.bifurcated import bifurcated_attention
from treeattn.parallel.bifurcated import sharded_bifurcated_attention
from treeattn.cache import ShardedKVCache
from treeattn.models import LlamaConfig, LlamaModel, load_model, load_tokenizer
from treeattn.engine.generate import GenerationResult, generate, stream
from treeattn.engine import Engine, RequestResult, SamplingParams, TokenEvent, TokenLogprob
from treeattn.engine.structured import StructuredOutput
from treeattn.linear import linear_attention

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_via_energy",
    "energy",
    "merge_states",
    "merge_states_list",
    "reference_attention",
    "Topology",
    "comm_stats",
    "ring_attention",
    "ring_decode",
    "spawn",
    "tree_decode",
    "bifurcated_attention",
    "sharded_bifurcated_attention",
    "ShardedKVCache",
    "LlamaConfig",
    "LlamaModel",
    "load_model",
    "load_tokenizer",
    "GenerationResult",
    "generate",
    "stream",
    "Engine",
    "RequestResult",
    "SamplingParams",
    "StructuredOutput",
    "TokenEvent",
    "TokenLogprob",
    "linear_attention",
]
