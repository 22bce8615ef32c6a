"""Needle-in-a-haystack retrieval over context lengths x needle depths: `treeattn eval needle MODEL`.

    report = run_needle("model.gguf", EngineConfig(nproc=4, decode="tree"), SamplingParams(max_new_tokens=16),
                        lengths=[1024, 2048], depths=[0.0, 0.5, 1.0])
    report.accuracy                      # fraction of cells answered exactly
    report.methods_agree                 # every decode method gave the same tokens in every cell

Each cell is one prompt (treeattn.eval.haystack): a filler document of `length` tokens with a
number hidden at `depth`, and the question through the model's chat template. On p ranks the
prompt is prefilled and decoded greedily with the chosen method, then with every other method
from that prefill (the ranks' one engine switches its decode and its prefix cache serves the
prompt again: treeattn.eval.runner.decode_methods); the cell's reply is the chosen method's, scored by exact retrieval
(the number appears in the reply), and the cell records whether all methods produced identical
tokens. Attention is exact, so they must: the eval reports any cell where they do not.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields, replace

from treeattn.engine.config import DEFAULT_METHOD, EngineConfig
from treeattn.engine.request import SamplingParams
from treeattn.eval.haystack import is_correct, needle_case

logger = logging.getLogger(__name__)

ALL_METHODS = (("tree", "onepass"), ("tree", "allreduce"), ("tree", "tree"), ("ring", "allreduce"))


@dataclass
class NeedleCell:
    """One (length, depth) cell. prompt_tokens: the rendered prompt (at most `length`; a length equal
    to the model's window is cut by max_new_tokens so that the answer fits)."""

    length: int
    depth: float
    prompt_tokens: int
    answer: str
    reply: str
    correct: bool
    generated_ids: list[int]
    methods_agree: bool
    method_ids: dict[str, list[int]] = field(default_factory=dict)
    method_cached_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens each method found cached
    prefill_s: float = 0.0
    time_per_token_s: float | None = None


@dataclass
class NeedleReport:
    model: str
    nproc: int
    decode: str
    method: str
    methods: list[str]
    cells: list[NeedleCell]
    load_s: float
    total_s: float

    @property
    def accuracy(self) -> float:
        return sum(c.correct for c in self.cells) / len(self.cells) if self.cells else float("nan")

    @property
    def methods_agree(self) -> bool:
        return all(c.methods_agree for c in self.cells)

    def as_dict(self) -> dict:
        out = asdict(self)
        for cell in out["cells"]:  # a report whose methods each prefilled (older ones, one rank) has none
            if not cell["method_cached_tokens"]:
                del cell["method_cached_tokens"]
        out.update(accuracy=self.accuracy, methods_agree=self.methods_agree)
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "NeedleReport":
        """The report of an as_dict() (the JSON `treeattn eval needle --json` prints), e.g. to draw
        its heatmap again; accuracy and methods_agree are recomputed from the cells."""
        cells = [NeedleCell(**cell) for cell in raw["cells"]]
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name != "cells"}, cells=cells)


def default_lengths(context_window: int) -> list[int]:
    """Powers of two from 1024 up to the model's window (the longest is cut to leave room for the
    answer), at least one length."""
    lengths, n = [], 1024
    while n <= context_window:
        lengths.append(n)
        n *= 2
    return lengths or [max(64, context_window // 2)]


def run_needle(
    model_path: str,
    config: EngineConfig,
    sampling: SamplingParams,
    *,
    lengths: list[int],
    depths: list[float],
    check_methods: bool = True,
    seed: int = 0,
    allow_beyond_context: bool = False,
) -> NeedleReport:
    """Run the grid; see the module docstring. A model without a chat template (a base model such
    as Gemma 3 270M) gets the document and question as plain text to complete (haystack.COMPLETION).
    Raises ValueError for a model without tokenizer, or a length beyond the model's window (unless
    allow_beyond_context). config: the ranks (nproc), the decode and method scored, and the rest as
    decode_methods takes it; sampling: max_new_tokens of each answer (greedy); seed: the filler's order
    and the hidden number."""
    from treeattn.eval.runner import decode_methods, method_name
    from treeattn.models.chat import end_of_turn_id
    from treeattn.models.loader import read_model_files

    files = read_model_files(model_path)
    if files.tokenizer is None:
        raise ValueError(f"{model_path}: the model has no tokenizer (tokenizer.json / tokenizer.ggml.*): the eval needs text")
    window = files.config.max_position_embeddings
    max_new_tokens, nproc = sampling.max_new_tokens, config.nproc
    fit = window - max_new_tokens  # a length up to the window is cut so that the answer fits too
    cases = [needle_case(files.tokenizer, files.chat_template, context_tokens=min(n, fit) if n <= window else n, depth=d,
                         seed=seed)
             for n in lengths for d in depths]
    longest = max(len(c.prompt_ids) for c in cases) + max_new_tokens
    if longest > window and not allow_beyond_context:
        raise ValueError(f"--lengths: the longest prompt needs {longest} positions, beyond the model's context window of "
                         f"{window} "
                         "(use shorter lengths, or --allow-beyond-context)")
    chosen = (config.decode, config.method or DEFAULT_METHOD) if nproc > 1 else ("local", "allreduce")
    methods = [chosen] + ([m for m in ALL_METHODS if m != chosen] if check_methods and nproc > 1 else [])
    eot = end_of_turn_id(files.tokenizer, files.chat_template) if files.chat_template is not None else None
    stop = [eot] if eot is not None else []  # besides the model's eos ids
    sampling = replace(sampling, stop_token_ids=(*sampling.stop_token_ids, *stop))
    runs, timing = decode_methods(model_path, [c.prompt_ids for c in cases], config, sampling, methods=methods)
    cells = []
    for case, row in zip(cases, runs):
        first = row[0].result
        ids = first.generated_ids[0]
        reply = files.tokenizer.decode(ids)
        agree = all(r.result.generated_ids == first.generated_ids for r in row)
        if not agree:
            logger.error("length %d depth %.2f: decode methods disagree: %s", case.context_tokens, case.depth,
                         {r.name: r.result.generated_ids[0] for r in row})
        cells.append(NeedleCell(
            length=lengths[len(cells) // len(depths)], depth=case.depth, prompt_tokens=len(case.prompt_ids), answer=case.answer,
            reply=reply, correct=is_correct(reply, case), generated_ids=ids, methods_agree=agree,
            method_ids={r.name: r.result.generated_ids[0] for r in row},
            method_cached_tokens={r.name: r.result.cached_prompt_tokens[0] for r in row}, prefill_s=first.prefill_s,
            time_per_token_s=first.time_per_token_s if first.decode_steps else None,
        ))
    return NeedleReport(model=str(model_path), nproc=nproc, decode=chosen[0], method=chosen[1],
                        methods=[method_name(*m) for m in methods], cells=cells, load_s=timing.load_s, total_s=timing.total_s)


def heatmap_figure(report: NeedleReport):
    """The heatmap's matplotlib figure: rows needle depth, columns context length, green = retrieved,
    red = missed (the colour bar says so), X = the decode methods disagreed; the title (model, then
    accuracy, ranks, method) is on two lines that the figure's width holds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({c.length for c in report.cells})
    depths = sorted({c.depth for c in report.cells})
    grid = np.full((len(depths), len(lengths)), np.nan)
    fig, ax = plt.subplots(figsize=(3.2 + 1.1 * len(lengths), 1.6 + 0.6 * len(depths)))
    for c in report.cells:
        i, j = depths.index(c.depth), lengths.index(c.length)
        grid[i, j] = 1.0 if c.correct else 0.0
        if not c.methods_agree:
            ax.text(j, i, "X", ha="center", va="center", fontsize=14, color="black")
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    bar = fig.colorbar(image, ax=ax, ticks=[0.0, 1.0], fraction=0.08, pad=0.04)
    bar.ax.set_yticklabels(["missed", "retrieved"], fontsize=8)
    bar.set_label("X: methods disagree", fontsize=8)
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    name = report.model.rsplit("/", 1)[-1]
    method = f" ({report.method})" if report.nproc > 1 else ""  # one rank attends locally: no combine method
    ax.set_title(f"{name}\n{report.accuracy:.0%} retrieved, {report.nproc} rank(s), {report.decode}{method}"
                 + ("" if report.methods_agree else ", methods DISAGREE"), fontsize=9, wrap=True)
    fig.tight_layout()
    return fig


def heatmap(report: NeedleReport, path) -> None:
    """Write heatmap_figure(report) as a PNG at `path`."""
    import matplotlib.pyplot as plt

    fig = heatmap_figure(report)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


__all__ = ["ALL_METHODS", "NeedleCell", "NeedleReport", "default_lengths", "heatmap", "heatmap_figure", "run_needle"]
