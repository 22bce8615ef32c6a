"""RULER through the engine on several rank counts: `treeattn eval ruler MODEL --context 4096 --nproc 1 2 4`.

    report = run_ruler("model.gguf", tasks=TASKS, contexts=[4096], samples=4, nprocs=[1, 2])
    report.scores()          # {(p, task, context): mean RULER score}
    report.mismatches()      # samples whose greedy tokens differ between rank counts (none: attention is exact)

Every sample (treeattn.eval.ruler_tasks: the prompt, sized to the context) is answered greedily
with one ta.Engine per rank count p (p = 1: this process, local attention; p > 1: p spawned gloo
ranks, the KV cache sharded, tree decoding), one request at a time so that each sample's time
(time to first token, then decode) is its own. The proof of exactness is that every sample's
generated token ids are identical for every p; the report lists any sample where they are not.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch

from treeattn.engine.config import DEFAULT_METHOD
from treeattn.eval.ruler_tasks import TASKS, reply_text, ruler_sample, score

SPAWN_TIMEOUT_S = 3600.0  # a collective may wait this long for a slow peer's prefill


@dataclass
class RulerResult:
    """One sample answered on `nproc` ranks."""

    task: str
    context: int
    index: int
    nproc: int
    prompt_tokens: int
    answers: list[str]
    generated_ids: list[int]
    reply: str
    score: float
    ttft_s: float
    decode_s: float


@dataclass
class RulerReport:
    model: str
    decode: str
    method: str
    results: list[RulerResult]
    total_s: float

    def scores(self) -> dict[tuple[int, str, int], float]:
        """(nproc, task, context) -> mean score over its samples."""
        groups: dict[tuple[int, str, int], list[float]] = {}
        for r in self.results:
            groups.setdefault((r.nproc, r.task, r.context), []).append(r.score)
        return {key: sum(v) / len(v) for key, v in groups.items()}

    def seconds_per_sample(self) -> dict[tuple[int, str, int], float]:
        """(nproc, task, context) -> mean seconds a sample took (first token, then decoding)."""
        groups: dict[tuple[int, str, int], list[float]] = {}
        for r in self.results:
            groups.setdefault((r.nproc, r.task, r.context), []).append(r.ttft_s + r.decode_s)
        return {key: sum(v) / len(v) for key, v in groups.items()}

    def mismatches(self) -> list[tuple[str, int, int, dict[int, list[int]]]]:
        """(task, context, index, {nproc: generated ids}) of every sample whose tokens differ between rank counts."""
        by_sample: dict[tuple[str, int, int], dict[int, list[int]]] = {}
        for r in self.results:
            by_sample.setdefault((r.task, r.context, r.index), {})[r.nproc] = r.generated_ids
        return [(*key, ids) for key, ids in by_sample.items() if len({tuple(v) for v in ids.values()}) > 1]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["scores"] = [{"nproc": p, "task": t, "context": c, "score": s,
                          "seconds_per_sample": self.seconds_per_sample()[(p, t, c)]}
                         for (p, t, c), s in sorted(self.scores().items())]
        out["mismatches"] = [{"task": t, "context": c, "index": i, "generated_ids": {str(p): v for p, v in ids.items()}}
                             for t, c, i, ids in self.mismatches()]
        return out


def run_ruler(model_path: str, *, tasks=TASKS, contexts: list[int], samples: int, nprocs: list[int], method: str = DEFAULT_METHOD,
              seed: int = 0, threads: int | None = None, dtype: str = "float32", on_done=None) -> RulerReport:
    """Generate the samples, answer them on each rank count in `nprocs`, score them (see the module
    docstring). on_done(nproc, report so far) is called after each rank count. ValueError (one line naming the
    argument) for a model without a tokenizer or a context beyond its window."""
    from treeattn.models.loader import read_model_files

    files = read_model_files(model_path)
    if files.tokenizer is None:
        raise ValueError(f"{model_path}: the model has no tokenizer (tokenizer.json / tokenizer.ggml.*): RULER needs text")
    window = files.config.max_position_embeddings
    if max(contexts) > window:
        raise ValueError(f"--context: {max(contexts)} is beyond the model's context window of {window}")
    if not nprocs or any(p < 1 for p in nprocs):
        raise ValueError(f"--nproc: rank counts must be ints >= 1, got {nprocs}")
    cases = [ruler_sample(t, files.tokenizer, files.chat_template, context_tokens=c, index=i, seed=seed)
             for c in contexts for t in tasks for i in range(samples)]
    keys = [(t, c, i) for c in contexts for t in tasks for i in range(samples)]
    start, results = time.perf_counter(), []
    for p in nprocs:
        rows = answer(model_path, [(s.prompt_ids, s.max_new_tokens) for s in cases], nproc=p, method=method,
                      threads=threads or max(1, (os.cpu_count() or 1) // p), dtype=dtype)
        for (task, context, index), sample, (ids, ttft, decode_s) in zip(keys, cases, rows):
            reply = reply_text(files.tokenizer, ids)
            results.append(RulerResult(task, context, index, p, len(sample.prompt_ids), sample.answers, ids, reply,
                                       score(reply, sample.answers), ttft, decode_s))
        if on_done is not None:
            on_done(p, RulerReport(str(model_path), "tree", method, list(results), time.perf_counter() - start))
    return RulerReport(str(model_path), "tree", method, results, time.perf_counter() - start)


def answer(model_path: str, prompts: list[tuple[list[int], int]], *, nproc: int, method: str, threads: int,
           dtype: str = "float32") -> list[tuple[list[int], float, float]]:
    """Greedy answers of (prompt ids, max new tokens) pairs on `nproc` ranks, one request at a time:
    per prompt (generated ids, time to first token s, decode s)."""
    args = (str(model_path), prompts, method, threads, dtype)
    if nproc == 1:
        saved = torch.get_num_threads()
        try:
            return _answer_rank(0, 1, *args)
        finally:
            torch.set_num_threads(saved)
    from treeattn.engine.measure import malloc_env
    from treeattn.parallel import spawn

    with malloc_env():
        return spawn(_answer_rank, nproc, *args, timeout=SPAWN_TIMEOUT_S, threads=threads, method="spawn")[0]


def _answer_rank(rank, world_size, model_path, prompts, method, threads, dtype):
    """One rank: load the model, run one engine (inside the group on several ranks); rank 0 returns
    the answers, the others None."""
    from treeattn.engine.client import Engine
    from treeattn.engine.config import EngineConfig
    from treeattn.engine.generate import DEFAULT_TIMEOUT_S, batch_config
    from treeattn.engine.request import SamplingParams
    from treeattn.models.loader import load_model
    from treeattn.parallel.shared_memory import group_timeout_s

    torch.set_num_threads(threads)
    model = load_model(model_path, dtype=getattr(torch, dtype))
    longest = max((ids for ids, _ in prompts), key=len)
    sampling = SamplingParams(max_new_tokens=max(n for _, n in prompts))
    config = EngineConfig(decode="tree" if world_size > 1 else "local", method=method,
                          timeout_s=(group_timeout_s() or DEFAULT_TIMEOUT_S) if world_size > 1 else DEFAULT_TIMEOUT_S)
    engine = Engine(model, batch_config(config, sampling, 1, [longest], world_size))
    if not engine.is_driver:  # served rank 0's steps until it closed the engine
        return None
    try:
        engine.generate([longest[:16]], max_new_tokens=2)  # warm-up: the kernels' first calls compile outside the times
        out = []
        for ids, max_new_tokens in prompts:
            result = engine.generate([ids], max_new_tokens=max_new_tokens)[0]
            if result.finish_reason == "error":
                raise RuntimeError(f"a RULER sample failed on {world_size} rank(s): {result.error}")
            out.append((list(result.token_ids), result.ttft_s, result.decode_s))
        return out
    finally:
        engine.close()


__all__ = ["RulerReport", "RulerResult", "answer", "run_ruler"]
