"""One arm of an A/B: decode CPU time per token (thread CPU of each process: this one and its rank children)."""
import sys, time, os, torch, json
import treeattn
from treeattn.engine.client import Engine
from treeattn.models.synthetic import synthetic_prompt


def main():
    path, ctx, nproc, N, act, label = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
    torch.set_num_threads(int(os.environ.get("AB_THREADS", 2)) if nproc == 1 else 1)  # AB_THREADS=1: no spinning pool
    TICK = os.sysconf("SC_CLK_TCK")
    def cpu_of(pid):
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TICK
    def kids(pid=None):  # every descendant process (the ranks may be grandchildren)
        pid = pid or os.getpid()
        out = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try: direct = [int(p) for p in open(f"/proc/{pid}/task/{t}/children").read().split()]
            except OSError: continue
            for c in direct:
                out += [c] + kids(c)
        return out
    def snapshot():
        pids = [os.getpid()] + (kids() if nproc > 1 else [])
        return {p: cpu_of(p) for p in pids}
    kw = dict(nproc=nproc, max_batch_size=1, prefix_cache=True, block_size=256, cache_tokens=2 * (ctx + N + 8) + 512 * nproc,
              max_context=ctx + N + 8, kv_cache_dtype="float16", weight_format="packed", activation_format=act,
              threads_per_rank=int(os.environ.get("AB_THREADS", 0)) or None)
    vocab = 262144 if "gemma" in path else 49152
    prompt = synthetic_prompt(ctx, vocab, 0)
    with Engine(path, **kw) as e:
        e.generate([prompt], max_new_tokens=2, ignore_eos=True)
        e.generate([prompt], max_new_tokens=2, ignore_eos=True)
        a = snapshot(); w0 = time.perf_counter()
        e.generate([prompt], max_new_tokens=2, ignore_eos=True)
        b = snapshot(); w1 = time.perf_counter()
        r, = e.generate([prompt], max_new_tokens=N + 2, ignore_eos=True)
        c = snapshot(); w2 = time.perf_counter()
        per = {p: 1e3 * ((c[p] - b[p]) - (b[p] - a[p])) / N for p in c if p in a and p in b}
        print(json.dumps({"label": label, "threads": os.environ.get("AB_THREADS", "default"), "src": os.path.dirname(treeattn.__file__), "nproc": nproc, "ctx": ctx,
                          "cpu_ms_per_token_by_process": [round(v, 2) for v in per.values()],
                          "wall_ms_per_token": round(1e3 * ((w2 - w1) - (w1 - w0)) / N, 2), "tokens": r.token_ids,
                          "loadavg": open("/proc/loadavg").read().split()[:3]}), flush=True)


if __name__ == "__main__":
    main()
