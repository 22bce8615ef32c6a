"""`treeattn bench serve` against `treeattn serve` (1, 2, 4 ranks) and llama-cpp-python's server on the same GGUF.

    nice -n 10 python benchmarks/serving/serve_matrix.py smollm2 --nproc 1 2 --input-len 512 2048 \\
        --concurrency 1 2 4 8 --output-len 32 --llama-python /work/llama/venv/bin/python [--budget-min 20]
        [--llama-server-python XLLAMACPP_VENV/bin/python --llama-parallel 4]
    nice -n 10 python benchmarks/serving/serve_matrix.py smollm2 --nproc 2 4 --cells 512:16 2048:1 8192:1 ...
                                                     # chosen (prompt length, concurrency) cells, in this order
    python benchmarks/serving/serve_matrix.py --table docs/data/serve_matrix      # the markdown table of the JSONs there
    python benchmarks/serving/serve_matrix.py --knee docs/data/serve_matrix       # each server's knee, from those JSONs

For one model (`treeattn models` name or a .gguf path) it starts every server at once, each idle while
another is measured: `treeattn serve MODEL --nproc N` for each N, and
`LLAMA_PYTHON -m llama_cpp.server --model MODEL --n_threads 2 --n_ctx C --interrupt_requests False`
(its default, interrupt_requests true, ends a stream whenever another request arrives), and with
`--llama-server-python PY` llama.cpp's own C++ server (tools/server: `--llama-parallel` slots, continuous
batching) as the xllamacpp wheel (PyPI) builds it into its extension, started from PY's venv with n_ctx
= slots x (longest prompt + output + 64), as server "llamaserver_np<slots>". Then, for each
prompt length and concurrency (a cell), it runs `treeattn bench serve --request-rate inf
--max-concurrency C` against each server, in an order that alternates from cell to cell, and writes the
result (vllm bench serve's keys, plus "server", "loadavg_before"/"loadavg_after" and "command") as
OUT_DIR/<model>_<server>_L<len>_c<C>.json.

Prompts are text (llama-cpp-python's server takes no token ids): random words cut to `len` tokens of the
model's tokenizer, different for every server and cell, so no server finds another's prompts in a
cache. Neither server is asked for ignore_eos (llama-cpp-python has none): every request carries
`logit_bias` -100 on the end-of-sequence token and the end-of-generation tokens the vocabulary has instead, so answers are
`--output-len` tokens long on
both. num_prompts per cell: max(--min-prompts, --prompts-factor x concurrency), default max(4, 2 x C). Cells stop starting after
`--budget-min` minutes.
`--cells L:C ...` runs those cells instead of every --input-len x --concurrency pair.

The knee (`--knee`): for each model, server and prompt length, the output throughput against the
concurrency (the cells of that length, from every run in the folder): the knee is the last
concurrency whose step up (to the next measured one) still raised the throughput by at least
KNEE_GAIN (10 %) per doubling of the concurrency; past it, more concurrency buys latency, not
throughput. With one measured concurrency there is no knee ("-"); when the throughput still rose at
every step, the knee is past the largest concurrency measured ("> C").
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

# end-of-generation tokens llama.cpp stops at
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<eos>", "<end_of_turn>", "<|eot_id|>")
WORDS = ("the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell", "over", "old", "city", "and", "music", "played",
         "river", "light", "stone", "under", "green", "hills", "where", "people", "walk", "slowly", "home")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2", metavar="MODEL", help="smollm2, gemma3 or a .gguf path")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--input-len", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--llama-python", default=None, help="the python of a venv with llama-cpp-python[server]")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--llama-server-python", default=None,
                        help="the python of a venv with xllamacpp (llama.cpp's C++ server, parallel slots)")
    parser.add_argument("--llama-parallel", type=int, default=4, help="the C++ server's slots (llama-server --parallel)")
    parser.add_argument("--budget-min", type=float, default=20.0)
    parser.add_argument("--prompts-factor", type=int, default=2, help="num_prompts per cell: max(--min-prompts, factor x C)")
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--out-dir", default="docs/data/serve_matrix")
    parser.add_argument("--cells", nargs="+", default=None, metavar="L:C",
                        help="run these (prompt length, concurrency) cells, in order, instead of --input-len x --concurrency")
    parser.add_argument("--table", default=None, help="print the markdown table of the JSONs in this folder, run nothing")
    parser.add_argument("--knee", default=None, help="print each server's knee from the JSONs in this folder, run nothing")
    args = parser.parse_args()
    if args.table:
        print("\n".join(table(Path(args.table))))
        return
    if args.knee:
        print("\n".join(knee_table(Path(args.knee))))
        return
    args.cells = _cells(args.cells) if args.cells else [(n, c) for n in args.input_len for c in args.concurrency]
    args.input_len = sorted({n for n, _ in args.cells})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run(args)


def _model_path(name: str) -> str:
    if name.endswith(".gguf"):
        return name
    out = subprocess.run([sys.executable, "-m", "treeattn", "models", "--path", name], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def run(args) -> None:
    model = _model_path(args.model)
    name = Path(model).name.split(".")[0].split("-")[0].lower() if args.model.endswith(".gguf") else args.model
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, eos = _tokenizer(model)
    servers, processes = {}, []
    try:
        from treeattn.serve.child import start_serve

        for n in args.nproc:
            child = start_serve(model, "--nproc", str(n), "--served-model-name", "bench", "--log-level", "warning")
            servers[f"treeattn_p{n}"], processes = child.url, processes + [child.process]
        if args.llama_python:
            url, process = _start_llama(args.llama_python, model, args.llama_threads, max(args.input_len) + args.output_len + 64)
            servers["llamacpp"], processes = url, processes + [process]
        if args.llama_server_python:
            n_ctx = args.llama_parallel * (max(args.input_len) + args.output_len + 64)
            url, process = _start_llama_server(args.llama_server_python, model, args.llama_threads, n_ctx, args.llama_parallel)
            servers[f"llamaserver_np{args.llama_parallel}"], processes = url, processes + [process]
        start = time.monotonic()
        for cell, (length, c) in enumerate(args.cells):
            order = list(servers) if cell % 2 == 0 else list(reversed(servers))
            for server in order:
                if time.monotonic() - start > args.budget_min * 60:
                    print(f"budget spent: stopped before {server} L{length} c{c}", flush=True)
                    return
                seed = zlib.crc32(f"{server} {length} {c}".encode())
                prompts = out_dir / f"prompts_{name}_{server}_L{length}_c{c}.jsonl"
                _write_prompts(prompts, tokenizer, length, _count(args, c), args.output_len, seed)
                _cell(servers[server], server, name, length, c, prompts, args, eos, out_dir)
                prompts.unlink()
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def _cell(url: str, server: str, name: str, length: int, c: int, prompts: Path, args, eos: list[int], out_dir: Path) -> None:
    out = out_dir / f"{name}_{server}_L{length}_c{c}.json"
    command = [sys.executable, "-m", "treeattn", "bench", "serve", "--base-url", url, "--dataset-path", str(prompts),
               "--num-prompts", str(_count(args, c)), "--max-concurrency", str(c), "--no-ignore-eos",
               "--extra-body", json.dumps({"logit_bias": {str(e): -100 for e in eos}}), "--label", server, "--result-file",
               str(out)]
    before = _loadavg()
    done = subprocess.run(command, capture_output=True, text=True)
    after = _loadavg()
    if not out.exists():
        print(f"{server} L{length} c{c}: failed: {done.stderr.strip()[-300:]}", flush=True)
        return
    result = json.loads(out.read_text())
    result.update(server=server, input_len=length, loadavg_before=before, loadavg_after=after, command=" ".join(command))
    result.pop("generated_texts", None)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{server} L{length} c{c}: {result['completed']} done, {result['output_throughput']:.2f} tok/s, TTFT p50 "
          f"{result['median_ttft_ms']:.0f} ms, TPOT p50 {result['median_tpot_ms']:.0f} ms, load {before} -> {after}", flush=True)


def _cells(specs: list[str]) -> list[tuple[int, int]]:
    """[(prompt length, concurrency)] of "L:C" strings; SystemExit naming a bad one."""
    cells = []
    for spec in specs:
        length, _, c = spec.partition(":")
        if not (length.isdigit() and c.isdigit() and int(length) > 0 and int(c) > 0):
            raise SystemExit(f"--cells: expected L:C with two positive integers (e.g. 2048:4), got {spec!r}")
        cells.append((int(length), int(c)))
    return cells


def _count(args, c: int) -> int:
    return max(args.min_prompts, args.prompts_factor * c)


def _tokenizer(model: str):
    from treeattn.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    import gguf

    reader = gguf.GGUFReader(model)
    field = reader.fields["tokenizer.ggml.eos_token_id"]
    ends = {int(field.parts[field.data[0]][0])} | {
        tokenizer.token_to_id(t) for t in END_TOKENS if tokenizer.token_to_id(t) is not None
    }
    return tokenizer, sorted(ends)


def _write_prompts(path: Path, tokenizer, length: int, count: int, output_len: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as sink:
        for _ in range(count):
            text = " ".join(rng.choice(WORDS) for _ in range(length * 2))
            ids = tokenizer.encode(text, add_special_tokens=False).ids[:length]
            text = tokenizer.decode(ids)
            sink.write(json.dumps({"prompt": text, "prompt_len": len(tokenizer.encode(text, add_special_tokens=False).ids),
                                   "output_len": output_len}) + "\n")


def _start_llama(python: str, model: str, threads: int, n_ctx: int) -> tuple[str, subprocess.Popen]:
    port = _free_port()
    process = subprocess.Popen([python, "-m", "llama_cpp.server", "--model", model, "--n_threads", str(threads),
                                "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--interrupt_requests", "False",
                                "--model_alias", "bench", "--host", "127.0.0.1", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _wait_ready(f"http://127.0.0.1:{port}", process, "llama_cpp.server")


# llama.cpp's own C++ server (tools/server: slots, continuous batching) as xllamacpp's wheel builds it into
# its extension; argv: model, port, threads, n_ctx (all slots together), slots
LLAMA_SERVER = """
import sys, time
import xllamacpp as xlc
model, port, threads, n_ctx, slots = sys.argv[1], *map(int, sys.argv[2:6])
params = xlc.CommonParams()
params.model.path, params.port, params.hostnames, params.model_alias = model, port, ["127.0.0.1"], {"bench"}
params.n_ctx, params.n_parallel, params.cont_batching = n_ctx, slots, True
params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
server = xlc.Server(params)
while True:
    time.sleep(3600)
"""


def _start_llama_server(python: str, model: str, threads: int, n_ctx: int, slots: int) -> tuple[str, subprocess.Popen]:
    port = _free_port()
    process = subprocess.Popen([python, "-c", LLAMA_SERVER, model, str(port), str(threads), str(n_ctx), str(slots)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _wait_ready(f"http://127.0.0.1:{port}", process, "xllamacpp's llama.cpp server")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(url: str, process: subprocess.Popen, what: str) -> tuple[str, subprocess.Popen]:
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return url, process
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    process.kill()
    raise SystemExit(f"{what} did not answer /v1/models within 600 s")


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def table(folder: Path) -> list[str]:
    """One row per cell and server: throughput, TTFT and TPOT percentiles, the load, and treeattn's ratio to llama.cpp."""
    by_cell = {}
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        model = path.name.split(f"_{r['server']}_")[0]  # every server serves "bench": the model is the file's prefix
        by_cell.setdefault((model, r["input_len"], r["max_concurrency"]), {})[r["server"]] = r
    lines = ["| model | prompt | concurrency | server | done | output tok/s | x llama.cpp | TTFT p50 / p99 (ms) | TPOT p50 / "
             "p99 (ms) "
             "| load before -> after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, length, c), cell in sorted(by_cell.items(), key=lambda kv: (kv[0][0] != "smollm2", kv[0])):
        base = cell.get("llamacpp")
        for server, r in sorted(cell.items()):
            ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}" if base and base["output_throughput"] else "-"
            lines.append(f"| {model} | {length} | {c} | {server} | {r['completed']}/{r['num_prompts']} | "
                         f"{r['output_throughput']:.2f} | {ratio} "
                         f"| {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.0f} / "
                         f"{r['p99_tpot_ms']:.0f} "
                         f"| {r['loadavg_before']} -> {r['loadavg_after']} |")
    return lines


KNEE_GAIN = 0.10  # the least throughput gain per doubling of the concurrency that still counts as scaling


def knee(points: list[tuple[int, float]]) -> int | None:
    """The knee of (concurrency, output throughput) points (see the module docstring); None with fewer
    than two points or when the throughput rose at every step.

        >>> knee([(1, 1.0), (2, 1.9), (4, 2.0), (8, 2.1)]), knee([(1, 1.0), (4, 3.0)]), knee([(1, 1.0)])
        (2, None, None)
    """
    import math

    points = sorted(points)
    if len(points) < 2:
        return None
    for (c0, t0), (c1, t1) in zip(points, points[1:]):
        doublings = math.log2(c1 / c0)
        if t0 <= 0 or (t1 / t0) ** (1 / doublings) - 1 < KNEE_GAIN:
            return c0
    return None


def knee_table(folder: Path) -> list[str]:
    """One row per model, server and prompt length: throughput by concurrency, the knee and its latency."""
    runs = {}
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        model = path.name.split(f"_{r['server']}_")[0]
        runs.setdefault((model, r["server"], r["input_len"]), {})[r["max_concurrency"]] = r
    lines = ["| model | server | prompt | output tok/s by concurrency | knee | at the knee: TTFT p50 / TPOT p50 (ms) |",
             "|---|---|---|---|---|---|"]
    for (model, server, length), cells in sorted(runs.items()):
        at = knee([(c, r["output_throughput"]) for c, r in cells.items()])
        curve = ", ".join(f"{c}: {r['output_throughput']:.2f}" for c, r in sorted(cells.items()))
        latency = f"{cells[at]['median_ttft_ms']:.0f} / {cells[at]['median_tpot_ms']:.0f}" if at else "-"
        shown = at if at else ("-" if len(cells) < 2 else f"> {max(cells)}")
        lines.append(f"| {model} | {server} | {length} | {curve} | {shown} | {latency} |")
    return lines


if __name__ == "__main__":
    main()
