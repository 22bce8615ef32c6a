"""Session 18 (pre18): a py-spy raw profile (`py-spy record -r 50 -f raw -o FILE -- python3 -m treeattn.cli generate ...`)
summed by the part of a prefill each sample falls in (the first matching rule below), as seconds of samples at
RATE samples a second (wall time of the sampled threads, idle ones left out) and shares of the whole run. Takes the
raw file, or its .gz.

    python3 docs/data/pre18_profile_parts.py PROFILE.txt.gz [RATE]
"""
import sys, collections
cats=collections.Counter(); tot=0
def cat(fr):
    s=';'.join(fr)
    if 'Engine.__init__' in s:
        if 'pack_arena' in s: return 'setup: pack_arena (weights copied to huge pages)'
        if 'warm_up' in s: return 'setup: kernel warm-up (numba)'
        return 'setup: other'
    if 'Model.forward' in s:
        if 'dequantize_packed' in s: return 'forward: dequantize packed weights'
        if 'packed_matmul' in s: return 'forward: matmul (F.linear, float32)'
        if 'LocalAttention' in s: return 'forward: attention, LocalAttention calls (Gemma: window layers)'
        if 'PagedBatch.attend' in s: return 'forward: attention over cache runs (Gemma: global layers)'
        if 'kv_store' in s or '_window_store' in s: return 'forward: KV cache writes'
        if 'rms_norm' in s or 'RMSNorm' in s: return 'forward: RMSNorm'
        if 'apply_rope' in s or 'rope' in s: return 'forward: RoPE'
        return 'forward: other (GELU/SiLU, residual, embedding)'
    if '_outcome' in s: return 'LM head + sampling'
    if 'Driver' in s or 'RankRunner' in s: return 'engine step bookkeeping'
    return 'outside prefill (load, tokenizer, import, decode)'
import gzip
for line in (gzip.open(sys.argv[1], 'rt') if sys.argv[1].endswith('.gz') else open(sys.argv[1])):
    line=line.rstrip()
    if ' ' not in line: continue
    st,n=line.rsplit(' ',1); n=int(n); tot+=n
    cats[cat(st.split(';'))]+=n
rate=float(sys.argv[2]) if len(sys.argv)>2 else 50
for k,v in sorted(cats.items()): print(f"{k:60s} {v/rate:7.2f} s  {v/tot*100:5.1f}%")
