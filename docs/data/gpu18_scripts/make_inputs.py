"""Inputs made here for the device run: a tiny Gemma 3 GGUF (tests/gemma3_files.py's writer, 8K context,
window 512) and the prompt ids (random, seeded) for it and for the SmolLM2-shape GGUF."""
import json, sys
import numpy as np
sys.path.insert(0, "tests")
from gemma3_files import TOKENS, CONTROL, USER, hf_gemma3, write_gemma3_gguf

out = sys.argv[1]
model = hf_gemma3(layers=6, window=512, context=8192)
write_gemma3_gguf(f"{out}/gemma3_tiny.gguf", model, context_length=8192)
rng = np.random.default_rng(0)
first = len(CONTROL) + len(USER)
json.dump(rng.integers(first, len(TOKENS), size=2000).tolist(), open(f"{out}/gemma_ids_2000.json", "w"))
json.dump(rng.integers(100, 49152, size=4096).tolist(), open(f"{out}/smollm_ids_4096.json", "w"))
json.dump(rng.integers(100, 49152, size=256).tolist(), open(f"{out}/smollm_ids_256.json", "w"))
