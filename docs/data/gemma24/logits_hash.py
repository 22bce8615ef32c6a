"""The sha256 of every step's float32 logits (prefill's last row and each decode step's) and the tokens of one greedy
run through a one-rank ta.Engine (packed weights, int8 activations, float16 KV, one thread): run under main's and this
branch's PYTHONPATH; equal digests = bitwise-equal logits.
PYTHONPATH=... python3 docs/data/fuse23/logits_hash.py MODEL_NAME CONTEXT NEW_TOKENS ACTIVATIONS KV (fuse23: the activation format and KV dtype as arguments)"""
import hashlib, subprocess, sys, torch
from treeattn.engine.client import Engine
from treeattn.models.llama import LlamaModel
from treeattn.models.loader import load_model
from treeattn.models.synthetic import synthetic_prompt
torch.set_num_threads(1)
name, context, new, act, kv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
path = subprocess.run(["treeattn", "models", "--path", name], capture_output=True, text=True).stdout.strip()
model = load_model(path, weight_format="packed", with_tokenizer=False)
digests = []
original = type(model).logits
def logits(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    digests.append(hashlib.sha256(out.detach().contiguous().numpy().tobytes()).hexdigest()[:16])
    return out
type(model).logits = logits
prompt = synthetic_prompt(context, model.config.vocab_size, 0)
with Engine(model, decode="local", device="cpu", max_batch_size=1, prefix_cache=False, block_size=256,
            cache_tokens=len(prompt) + new + 256, max_context=len(prompt) + new + 1, kv_cache_dtype=kv,
            activation_format=act) as engine:
    result, = engine.generate([prompt], max_new_tokens=new, ignore_eos=True)
print(name, context, act, kv, "tokens", result.token_ids)
print(name, context, act, kv, "logits sha256[:16] per step", " ".join(digests), "all:", hashlib.sha256(" ".join(digests).encode()).hexdigest()[:16])
