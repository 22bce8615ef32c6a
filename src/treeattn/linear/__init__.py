"""Linear attention: kernel feature maps (elu + 1, relu, Hedgehog's learned maps), exact across ranks.

    out = ta.linear_attention(q, k, v, feature_map="elu", causal=True, group=None)

The state of a span of keys, (sum phi(k) v^T, sum phi(k)), adds like Tree Attention's (out, lse)
merges, so the sequence can be sharded across ranks: rank r needs only the sum of the states
before it (treeattn.linear.exchange), and decoding continues from the total state.
"""

from treeattn.linear.attention import linear_attention
from treeattn.linear.feature_maps import HedgehogFeatureMap, elu_feature_map, relu_feature_map
from treeattn.linear.kernel import LinearAttentionState
from treeattn.linear.reference import reference_linear_attention

__all__ = [
    "HedgehogFeatureMap",
    "LinearAttentionState",
    "elu_feature_map",
    "linear_attention",
    "reference_linear_attention",
    "relu_feature_map",
]
