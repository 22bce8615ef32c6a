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
        if 'LocalAttention' in s: return 'forward: attention, window layers'
        if 'PagedBatch.attend' in s: return 'forward: attention, global layers (cache runs)'
        if 'kv_store' in s or '_window_store' in s: return 'forward: KV cache writes'
        if 'rms_norm' in s or 'RMSNorm' in s: return 'forward: RMSNorm'
        if 'apply_rope' in s or 'rope' in s: return 'forward: RoPE'
        return 'forward: other (GELU/SiLU, residual, embedding)'
    if '_outcome' in s: return 'LM head + sampling'
    if 'Driver' in s or 'RankRunner' in s: return 'engine step bookkeeping'
    return 'outside prefill (load, tokenizer, import, decode)'
for line in open(sys.argv[1]):
    line=line.rstrip()
    if ' ' not in line: continue
    st,n=line.rsplit(' ',1); n=int(n); tot+=n
    cats[cat(st.split(';'))]+=n
rate=float(sys.argv[2]) if len(sys.argv)>2 else 50
for k,v in sorted(cats.items()): print(f"{k:60s} {v/rate:7.2f} s  {v/tot*100:5.1f}%")
