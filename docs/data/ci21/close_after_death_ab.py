"""ta.Engine (2 ranks, the server tests' tiny Llama GGUF) after SIGKILL to rank 1, idle: seconds until the engine is
unhealthy, and seconds engine.close() takes then; under a step (a 400-token generate in a thread): seconds from the kill
until that generate returns (failed; the ranks restarted) and until a 2-token generate on the new ranks returns; before (.scratch/before/src: b23fc32~1) and after (src) the abandon
change, alternated ABAB in fresh interpreters.
Run from the worktree root: python3 docs/data/ci21/close_after_death_ab.py > docs/data/ci21/close_after_death_ab.txt 2>&1"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import os, signal, sys, time
import treeattn as ta
e = ta.Engine(sys.argv[1], nproc=2, block_size=16, cache_tokens=512)
e.generate([[3, 4, 5]], max_new_tokens=2)
ranks = [p for p in __import__('multiprocessing').active_children() if p.name == 'treeattn-rank1']
pid = ranks[0].pid if ranks else max(e._channel._processes.procs, key=lambda p: p.name).pid
t0 = time.monotonic(); os.kill(pid, signal.SIGKILL)
while e.healthy:
    time.sleep(0.01)
t1 = time.monotonic(); e.close(); t2 = time.monotonic()
import threading
e2 = ta.Engine(sys.argv[1], nproc=2, block_size=16, cache_tokens=2048)
e2.generate([[3, 4, 5]], max_new_tokens=2)
done = []
th = threading.Thread(target=lambda: done.append(e2.generate([[3, 4, 5]], max_new_tokens=400, ignore_eos=True)))
th.start(); time.sleep(1.0)
pid = next(p.pid for p in __import__('multiprocessing').active_children() if p.name == 'treeattn-rank1')
t3 = time.monotonic(); os.kill(pid, signal.SIGKILL); th.join(); t4 = time.monotonic()
e2.generate([[3, 4, 5]], max_new_tokens=2); t5 = time.monotonic(); e2.close()
print(f"idle: unhealthy after {t1 - t0:.2f} s, close {t2 - t1:.2f} s; under a step: failed after {t4 - t3:.2f} s "
      f"({done[0][0].finish_reason}), next answer after {t5 - t3:.2f} s")
"""

if __name__ == "__main__":
    sys.path.insert(0, "tests")
    from helpers.serve import NAME, _write_tiny_llama_gguf

    model = _write_tiny_llama_gguf(Path(tempfile.mkdtemp()) / f"{NAME}.gguf", 0, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[1].splitlines()[0].strip())
    for arm in ("before", "after") * 3:
        src = Path(".scratch/before/src" if arm == "before" else "src").resolve()
        load = open("/proc/loadavg").read().split()[:3]
        script = Path(tempfile.mkdtemp()) / "child.py"  # a file under a main guard: the ranks re-import the main module
        script.write_text('if __name__ == "__main__":\n' + "".join(f"    {line}\n" for line in CHILD.strip().splitlines()))
        out = subprocess.run([sys.executable, str(script), str(model)], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=str(src)))
        print(f"{arm:6s} load {' '.join(load)}: {out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]}", flush=True)
