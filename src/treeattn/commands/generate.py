"""`treeattn generate`: the decoding engine on the command line (`treeattn demo` is treeattn.eval.demo_cli).

    treeattn generate MODEL_DIR --prompt "Once upon a time" --nproc 4 --decode tree --max-new-tokens 64
    treeattn generate MODEL_DIR --prompt-ids ids.json --nproc 2 --json      # one JSON object on stdout
    treeattn generate model.gguf --chat --system "Be brief." --prompt "What is RoPE?"   # chat template
    treeattn generate MODEL_DIR --prompt "Q: 2+2?" --stop "Q:" --stop $'\n\n'        # stop strings (repeatable)
    torchrun --nproc-per-node 4 -m treeattn generate MODEL_DIR --prompt-file prompt.txt

Status lines (loading, ranks starting, prefill progress by chunk) and the summary go to stderr;
stdout carries only the generated text, streamed as it is decoded (with --stop a tail that could
begin a stop string waits until it cannot, and the text ends before the stop string; a batch is
printed at the end), or with --json one JSON object, so the output can be piped. Progress bars only when stderr is a terminal; a
file or pipe gets plain lines
(treeattn.commands.console). Every engine and sampling flag is the field of EngineConfig or
SamplingParams it fills (treeattn.commands.flags): the same name, default and help as in
`treeattn serve`, ta.Engine and ta.generate.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Literal

import typer
from rich.console import Console
from rich.table import Table

from treeattn.engine.config import EngineConfig
from treeattn.commands.console import GenerateDisplay, process_age_s, say
from treeattn.commands.flags import cli_message, config_options, device_and_dtype, dtype_flag, model_argument
from treeattn.engine.request import SamplingParams

logger = logging.getLogger(__name__)
stderr = Console(stderr=True)

RankBy = Literal["none", "mean-logprob"]

E, S = EngineConfig, SamplingParams  # the configurations the flags fill (treeattn.commands.flags)


ENGINE_FLAGS = ("nproc", "tp", "decode", "method", "prefill", "prefill_chunk", "decode_step", "placement", "block_size",
                "max_context", "device", "kv_cache_dtype", "weight_format", "activation_format", "prefill_dtype",
                "threads_per_rank", "speculate",
                "draft_tokens",
                "draft_model", "linear_maps", "kv_store", "kv_store_bytes", "shared_memory", "timeout_s")
SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "stop", "ignore_eos")


@config_options(S, SAMPLING_FLAGS, into="sampled")
@config_options(E, ENGINE_FLAGS, into="engine", nproc={"default": None, "help": "Ranks sharing the KV cache, spawned here "
                                                                                  "(gloo). Default 1, or the world size under "
                                                                                  "torchrun."},
                max_context={"help": "The most positions (prompt + new tokens) one sequence may take, its KV cache slots "
                                     "(default: the longest prompt + --max-new-tokens)."})
def generate_command(
    model_dir: Path = model_argument(),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text (needs the model's tokenizer)."),
    prompt_file: Path | None = typer.Option(None, "--prompt-file", help="Read the prompt text (UTF-8) from this file."),
    prompt_ids: Path | None = typer.Option(None, "--prompt-ids",
                                           help="JSON file: a list of token ids, or a list of such lists (a batch)."),
    dtype: str = dtype_flag(),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    num_samples: int = typer.Option(1, "--num-samples", min=1, help="Completions of the one prompt (the prompt prefilled "
                                    "once, the samples decoding over its shared blocks)."),
    rank_by: RankBy = typer.Option("none", "--rank-by", help="Order the printed sequences: none (as generated) or "
                                   "mean-logprob (mean log-probability of the generated tokens, best first)."),
    top: int | None = typer.Option(None, "--top", min=1,
                                   help="Print only the first K sequences in --rank-by order (needs --rank-by mean-logprob)."),
    chat: bool = typer.Option(False, "--chat", help="Send the prompt as a user message through the model's chat template "
                              "(with the generation prompt); stop at the template's end-of-turn token too."),
    system: str | None = typer.Option(None, "--system", help="System message before the prompt (needs --chat)."),
    allow_beyond_context: bool = typer.Option(False, "--allow-beyond-context", help="Run even if the prompt + --max-new-tokens "
                                              "exceed the model's context window: positions past it get RoPE angles the model "
                                              "never saw in training, so the output may degrade."),
    engine: dict | None = None,
    sampled: dict | None = None,
) -> None:
    """Generate from a Hugging Face checkpoint or a GGUF file with the KV cache sharded across ranks."""
    from treeattn.commands.generate_rank import GenerateJob, generate_rank
    from treeattn.models.loader import read_model_files
    from treeattn.parallel.spawn import under_torchrun

    try:
        world = _world_size(engine["nproc"])
        sampling = SamplingParams(**sampled)
        config = EngineConfig(**{**engine, "nproc": world, "threads_per_rank": None})  # threads: the job's, below
        if system is not None and not chat:
            raise ValueError("--system is a chat message: give --chat too")
        files = read_model_files(model_dir)  # config, tokenizer, chat template (a .gguf is read once)
        tokenizer = files.tokenizer
        render, end_of_turn = _chat_renderer(system, prompt_ids, files, model_dir) if chat else (None, ())
        prompts, batched = _read_prompts(prompt, prompt_file, prompt_ids, tokenizer, model_dir, render)
        if end_of_turn and not sampling.ignore_eos:  # --chat: the end of the assistant's turn stops too
            sampling = dataclasses.replace(sampling, stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids,
                                                                                         *end_of_turn))))
        if sampling.stop and tokenizer is None:
            raise ValueError(f"--stop: {model_dir} has no tokenizer to find stop strings with; use --stop-id")
        if top is not None and rank_by == "none":
            raise ValueError("--top K prints the K best sequences: give --rank-by mean-logprob too")
        kind, dtype = device_and_dtype(config.device, dtype, world)  # "cpu" or "cuda"; --dtype auto: bfloat16 on CUDA
        config = _check_before_spawning(config, sampling, num_samples, model_dir, prompts, world, dtype)  # the ranks trust it
        _check_context(prompts, sampling.max_new_tokens, files.config, model_dir, allow_beyond_context)
    except FileNotFoundError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except (ValueError, TypeError) as exc:
        typer.echo(f"error: {cli_message(exc)}", err=True)
        raise typer.Exit(2) from exc

    job = GenerateJob(model_dir=str(model_dir), prompts=tuple(map(tuple, prompts)), config=config, sampling=sampling,
                      checked=True,
                      num_samples=num_samples, dtype=dtype, device=kind,
                      threads=engine["threads_per_rank"] or max(1, (os.cpu_count() or 1) // world))
    batched = batched or num_samples > 1
    # the answer goes to stdout as decoded (the engine's text: cut before a stop string, a possible start held back)
    streamed = not json_output and not batched and tokenizer is not None
    display = None if json_output else GenerateDisplay(stream_text=streamed)
    if display is not None and os.environ.get("RANK", "0") == "0":
        say(f"loading {Path(model_dir).name} on {world} rank(s)" + ("" if world == 1 or under_torchrun() else " (starting them)"))
    try:
        if world == 1 and not under_torchrun():
            result = generate_rank(0, 1, job, display)
        else:
            from treeattn.parallel import spawn

            from treeattn.engine.device import backend_for

            result = spawn(generate_rank, world, job, display, backend=backend_for(kind), timeout=config.timeout_s,
                           threads=job.threads)[0]
    except Exception as exc:  # a rank's error (SpawnError names it) or a local one: report, exit non-zero
        from treeattn.parallel import SpawnError

        typer.echo(f"error: {exc.summary if isinstance(exc, SpawnError) else exc}", err=True)
        if isinstance(exc, SpawnError):
            typer.echo(str(exc), err=True)  # every rank's error and traceback, after the one line
        raise typer.Exit(1) from exc
    if result is None:  # a non-zero rank under torchrun: rank 0 reports
        return
    total_s = process_age_s()  # the whole command: start-up, imports, loading, ranks, prefill, decode
    texts = result["texts"] if tokenizer is not None else None  # the engine's text, cut before a stop string
    ranked = rank_by == "mean-logprob"
    order = result["ranking"][:top] if ranked else list(range(len(result["generated_ids"])))
    if json_output:
        typer.echo(json.dumps(_json_report(result, texts, batched, total_s, order if ranked else None)))
        return
    for i in ([] if streamed else order):
        ids = result["generated_ids"][i]
        prefix = f"[{i}] " if batched else ""
        if ranked:
            prefix += f"(mean logprob {result['mean_logprobs'][i]:.4f}) "
        typer.echo(prefix + (texts[i] if texts is not None else " ".join(map(str, ids))))
    stderr.print(_summary_table(result, total_s))
    if "length" in result["finish_reasons"]:
        say(f"the answer was cut at --max-new-tokens {sampling.max_new_tokens} (finish_reason length): raise it for a longer one")


def _check_before_spawning(config: EngineConfig, sampling: SamplingParams, num_samples: int, model_dir: Path,
                           prompts: list[list[int]], world: int, dtype: str) -> EngineConfig:
    """Everything the ranks would refuse, checked once here with the checks they run: the checkpoint
    (without reading its weights), the prompts, generate's checks of the batch and the engine's checks
    (checks.check_engine: the draft model, a hybrid cache, the memory of `world` ranks on this
    machine, each holding all weights and its share of the cache, the draft model's too). Warns when ranks outnumber the cores or
    the prompt's tokens.
    Returns the checked config, sized to the batch (generate.batch_config): the ranks run it without checking it again."""
    import torch

    from treeattn.engine.checks import check_engine, with_device
    from treeattn.engine.generate import batch_config, check_generation, check_prompts
    from treeattn.models.loader import check_checkpoint
    from treeattn.parallel.spawn import local_ranks

    torch_dtype = getattr(torch, dtype)
    model_config = check_checkpoint(model_dir, dtype=torch_dtype).config  # tensor names and shapes: headers only
    prompts = check_prompts(prompts, model_config.vocab_size)
    sized = dataclasses.replace(batch_config(config, sampling, num_samples, prompts, world), dtype=torch_dtype)
    check_generation(sized, sampling, num_samples, model_config, prompts)
    # the engine's checks (the ranks load the checkpoint on --device): a draft model, a hybrid cache, memory, ...
    sized = with_device(str(model_dir), sized)
    check_engine(str(model_dir), sized, cache_option="max_new_tokens" if config.max_context is None else "max_context")
    longest = max(len(p) for p in prompts)
    here = local_ranks(world)
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 warns for all
        return sized
    cores = os.cpu_count() or 1
    if here > cores:
        stderr.print(f"warning: --nproc {here} ranks on {cores} cores: they will time-share the cores (slower, not faster)")
    if world > longest:
        stderr.print(f"warning: --nproc {world} ranks for a {longest}-token prompt: some ranks start with no tokens")
    return sized


def _read_prompts(prompt, prompt_file, prompt_ids, tokenizer, model_dir, render=None) -> tuple[list[list[int]], bool]:
    """The prompt(s) as token ids, and whether a batch was given. Text (--prompt, --prompt-file)
    is tokenized, or turned into ids by `render` (--chat)."""
    given = [name for name, value in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--prompt-ids",
                                                                                             prompt_ids)) if value is not None]
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
            raise ValueError(f"--prompt-file {prompt_file}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                             f"{exc.start}); "
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
    from treeattn.models.chat import chat_end_of_turn, encode_chat, messages

    if prompt_ids is not None:
        raise ValueError("--chat renders text through the chat template: give --prompt or --prompt-file, not --prompt-ids")
    eot = chat_end_of_turn(files, f"--chat: {model_dir}")
    return (lambda text: encode_chat(files.tokenizer, files.chat_template, messages(text, system=system))), (
        () if eot is None else (eot,)
    )


def _check_context(prompts, max_new_tokens: int, model_config, model_dir, allow: bool) -> None:
    """The prompt + new tokens must fit in the model's context window, unless --allow-beyond-context."""
    longest = max(len(p) for p in prompts)
    needed, window = longest + max_new_tokens, model_config.max_position_embeddings
    if needed <= window:
        return
    if not allow:
        raise ValueError(f"--max-new-tokens: the prompt's {longest} tokens + {max_new_tokens} new tokens need {needed} "
                         f"positions, "
                         f"beyond the context window of {model_dir} ({window}); shorten the prompt, lower --max-new-tokens, "
                         "or pass --allow-beyond-context")
    stderr.print(f"warning: --allow-beyond-context: {needed} positions, past the model's window of {window}; "
                 "the model never saw those positions in training, so the output may degrade")


def _world_size(nproc: int | None) -> int:
    from treeattn.parallel.spawn import under_torchrun

    if under_torchrun():
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
        "setup_s": result["setup_s"],  # the part of prefill_s spent building the engine (GenerationResult.setup_s)
        "decode_s": result["decode_s"],
        "decode_steps": result["decode_steps"],
        "time_per_token_s": _finite(result["time_per_token_s"]),
        "tokens_per_s": _finite(result["tokens_per_s"]),
        "step_times_s": result["step_times_s"],  # each decode step's wall seconds on rank 0 (decode_s is their sum)
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
    report["kv_cache_dtype"] = result["kv_cache_dtype"]
    report["weight_bytes_per_rank"] = result["weight_bytes_per_rank"]
    report["weight_format"] = result["weight_format"]
    report["activation_format"] = result["activation_format"]  # how packed weights multiplied the decode steps: float32 or int8
    report["prefill_dtype"] = result["prefill_dtype"]  # what packed weights multiplied prefill chunks in: float32 or bfloat16
    if result["kv_window_bytes"]:
        report["kv_window_bytes"] = result["kv_window_bytes"]
    report["peak_rss_bytes_per_rank"] = result["peak_rss_bytes_per_rank"]
    report["run"] = {k: result[k] for k in ("world_size", "decode", "method", "prefill", "placement")}
    if result.get("tp") is not None:  # the Helix layout: tp tensor-parallel x world_size / tp KV ranks
        report["run"]["tp"] = result["tp"]
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
    table.add_row("finish reason", ", ".join(result["finish_reasons"]))
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
    table.add_row("KV cache per rank", ", ".join(format_size(b) for b in result["kv_bytes_per_rank"]))
    if result["kv_window_bytes"]:
        table.add_row("KV cache per token", f"{format_size(result['kv_bytes_per_token'])} (global layers)")
        table.add_row("KV cache of the windows", f"{format_size(result['kv_window_bytes'])} per sequence, every rank")
    else:
        table.add_row("KV cache per token", f"{format_size(result['kv_bytes_per_token'])} (all layers)")
    table.add_row("comm per token (all ranks)", format_size(result["comm_bytes_per_token"]) if steps else "-")
    table.add_row("total wall time (whole command)", f"{total_s:.2f} s")
    return table


def format_mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_size(n: float) -> str:
    if n >= 2**20:
        return format_mib(n)
    if n >= 2**10:
        return f"{n / 2**10:.2f} KiB"
    return f"{n:.0f} B"


__all__ = ["generate_command"]
