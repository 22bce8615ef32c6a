"""Single-device attention: the attention-state algebra and the kernels that produce states."""

from treeattn.ops.attention import attention
from treeattn.ops.energy import attention_via_energy, energy
from treeattn.ops.graph_safe import graph_safe_attention
from treeattn.ops.merge import merge_states, merge_states_list
from treeattn.ops.reference import reference_attention

__all__ = [
    "attention",
    "attention_via_energy",
    "energy",
    "graph_safe_attention",
    "merge_states",
    "merge_states_list",
    "reference_attention",
]
