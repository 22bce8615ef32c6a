"""The two position values that mark rows which are not real tokens.

PAD_POSITION (-1) marks a padding token in the positions handed to a cache's extend();
INVISIBLE_POSITION (2**62) is stored as the position of a slot no query may see (padding, a window
ring's unwritten rows): it lies after every real query, so causal attention masks it.
"""

# Position of a padding token in the positions handed to extend().
PAD_POSITION = -1
# Position stored for a padding slot: after every real query, so causal attention never sees it.
INVISIBLE_POSITION = 1 << 62
