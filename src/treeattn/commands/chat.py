"""`treeattn chat`: an interactive conversation with a model in the terminal (llama-cli -cnv,
`ollama run`, `vllm chat`), over ta.Engine.

    treeattn chat model.gguf --nproc 2 --system "Be brief."
    > What is RoPE?
    Rotary position embeddings ...                                  (streamed as it is decoded)
    [turn 1: 52 prompt tokens (0 cached, 52 prefilled), 38 new tokens, 1.9 s]
    > /reset        (forget the conversation)      /exit or Ctrl-D   (leave)
    printf 'Hi\\nWhat is 2+2?\\n' | treeattn chat model.gguf        (lines from stdin, one reply each)

Each turn renders the whole conversation with the model's chat template (the user's lines, the
model's replies, the system message) and submits it to one ta.Engine. The engine's prefix cache
keeps the conversation's keys and values in full blocks (--block-size tokens), so a turn prefills
only what is new since the last one: the status line shows how many prompt tokens came from the
cache. Ctrl-C stops the reply being written (the engine cancels the request) and the chat goes on;
at the prompt it clears the line. Replies go to stdout, status lines to stderr.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from treeattn.engine.config import EngineConfig
from treeattn.commands.console import say, write_stdout
from treeattn.engine.errors import ConfigError
from treeattn.commands.flags import config_flag, config_options, dtype_flag, model_argument, torch_dtype
from treeattn.engine.request import SamplingParams as S

CHAT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.1}
"""The chat's sampling where the checkpoint ships none (treeattn.models.generation_config) and no flag is given:
ollama's and llama.cpp's kind of defaults (they sample, with a repeat penalty), where greedy decoding of a small
model repeats itself. top_k 0: off."""
SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                  "repetition_penalty": "--repetition-penalty"}

COMMANDS = {"/reset": "forget the conversation (the system message stays)", "/exit": "leave (Ctrl-D too)",
            "/help": "list these commands"}


class Conversation:
    """The messages of one chat and the token ids of its next prompt.

    Args:
        tokenizer: the model's tokenizer.
        template: the model's ChatTemplate (treeattn.models.chat).
        system: the system message, or None (the template's default, if it has one).
    """

    def __init__(self, tokenizer, template, system: str | None = None) -> None:
        self.tokenizer, self.template, self.system = tokenizer, template, system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    @property
    def turns(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)

    def prompt(self, text: str) -> list[int]:
        """Add the user's `text`; the ids of the whole conversation with the generation prompt."""
        from treeattn.models.chat import encode_chat

        self.messages.append({"role": "user", "content": text})
        return encode_chat(self.tokenizer, self.template, self.messages)

    def reply(self, text: str) -> None:
        """Add the model's reply (what was shown, also when it was stopped early)."""
        self.messages.append({"role": "assistant", "content": text})


CHAT_ENGINE_FLAGS = ("nproc", "tp", "block_size", "decode", "device", "kv_cache_dtype", "weight_format", "activation_format",
                     "prefill_dtype",
                     "timeout_s",
                     "kv_store", "kv_store_bytes")


@config_options(EngineConfig, CHAT_ENGINE_FLAGS, into="engine_options",
                nproc={"help": "Ranks sharing the KV cache, spawned here (gloo)."},
                block_size={"min": 1})
def chat_command(
    model: Path = model_argument(", with a chat template."),
    system: str | None = typer.Option(None, "--system", help="System message before the conversation."),
    max_new_tokens: int = config_flag(S, "max_new_tokens", default=512, min=1, help="New tokens per reply at most."),
    temperature: float | None = config_flag(S, "temperature", default=None, help="Sampling temperature (0: greedy); "
                                            "default: the checkpoint's generation config, else 0.7."),
    top_p: float | None = config_flag(S, "top_p", default=None, help="Nucleus sampling: keep the most likely tokens "
                                      "up to this probability mass; default: the checkpoint's, else 0.9."),
    top_k: int | None = config_flag(S, "top_k", default=None, help="Keep the k most likely tokens (0: all); default: "
                                    "the checkpoint's, else 0."),
    repetition_penalty: float | None = config_flag(S, "repetition_penalty", default=None, help="Penalize tokens already in "
                                                   "the conversation or the reply: a positive logit divided by it, a "
                                                   "negative one multiplied (1: none); default: the checkpoint's, else 1.1."),
    seed: int = config_flag(S, "seed"),
    dtype: str = dtype_flag(),
    engine_options: dict | None = None,
) -> None:
    """Chat with MODEL in the terminal: its chat template, replies streamed as decoded, the conversation in the prefix cache."""
    from treeattn.engine.client import Engine
    from treeattn.engine.request import SamplingParams
    from treeattn.models.chat import chat_end_of_turn
    from treeattn.models.loader import read_model_files

    try:
        files = read_model_files(model)
        eot = chat_end_of_turn(files, f"{model}: the model", otherwise="; use treeattn generate")
        stop = tuple(dict.fromkeys(list(files.config.eos_token_ids) + ([] if eot is None else [eot])))
        sampling, sources = chat_sampling(model, temperature=temperature, top_p=top_p, top_k=top_k,
                                          repetition_penalty=repetition_penalty)
        params = dict(max_new_tokens=max_new_tokens, seed=seed, stop_token_ids=stop, **sampling)
        SamplingParams(**params)  # bad sampling options: one line now, before the model loads
    except (ValueError, TypeError, FileNotFoundError) as exc:
        from treeattn.commands.flags import cli_message

        typer.echo(f"error: {cli_message(exc)}", err=True)
        raise typer.Exit(2) from exc
    say("sampling: " + ", ".join(f"{SAMPLING_FLAGS[k]} {v} ({sources[k]})" for k, v in sampling.items()))

    conversation = Conversation(files.tokenizer, files.chat_template, system)
    say(f"loading {model.name} on {engine_options['nproc']} rank(s)")
    start = time.perf_counter()
    try:
        nproc = engine_options["nproc"]
        engine = Engine(str(model), EngineConfig(**{**engine_options,
                                                    "decode": engine_options["decode"] if nproc > 1 else "local"},
                                                 max_batch_size=1, prefix_cache=True, dtype=torch_dtype(dtype)))
    except ConfigError as exc:  # a refused option (--device cuda without CUDA, ...): one line in the flags' words
        from treeattn.commands.flags import cli_message

        typer.echo(f"error: {cli_message(exc)}", err=True)
        raise typer.Exit(2) from exc
    except Exception as exc:  # noqa: BLE001 -- a rank's error or a refused config: one line, exit 1
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    interactive = sys.stdin.isatty()
    with engine:
        say(f"ready in {time.perf_counter() - start:.2f} s. " + ("Ctrl-C stops a reply; /reset, /exit (or Ctrl-D), /help"
                                                                   if interactive else "reading lines from stdin"))
        while True:
            line = _read_line(interactive)
            if line is None:
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if line == "/exit":
                    break
                if line == "/reset":
                    conversation.reset()
                    say("conversation cleared")
                else:
                    if line != "/help":
                        say(f"unknown command {line}")
                    for name, what in COMMANDS.items():
                        say(f"  {name:7} {what}")
                continue
            if not _turn(engine, conversation, line, SamplingParams(**params)):
                raise typer.Exit(1)


def chat_sampling(model, **given) -> tuple[dict, dict]:
    """The chat's sampling settings ({field: value}) and where each came from ({field: "flag", "the
    checkpoint's generation config" or "chat default"}): a flag given (not None) wins, then the
    checkpoint's generation config (treeattn.models.generation_config), then CHAT_SAMPLING."""
    from treeattn.models.generation_config import read_generation_config

    shipped = read_generation_config(model)
    values, sources = {}, {}
    for name, default in CHAT_SAMPLING.items():
        if given.get(name) is not None:
            values[name], sources[name] = given[name], "flag"
        elif name in shipped:
            values[name], sources[name] = shipped[name], "the checkpoint's generation config"
        else:
            values[name], sources[name] = default, "chat default"
    return values, sources


def _read_line(interactive: bool) -> str | None:
    """The next line the user typed (None at the end of input). On a terminal: a "> " prompt with
    line editing, and Ctrl-C clears the line; otherwise a line of stdin as it is."""
    if not interactive:
        line = sys.stdin.readline()
        return line if line else None
    try:
        import readline  # noqa: F401 -- line editing and history for input()
    except ImportError:  # pragma: no cover -- not on every platform
        pass
    while True:
        try:
            return input("> ")
        except EOFError:
            write_stdout("\n")
            return None
        except KeyboardInterrupt:
            write_stdout("\n")


def _turn(engine, conversation: Conversation, text: str, params) -> bool:
    """One turn: submit the conversation, stream the reply; False when the engine failed."""
    ids = conversation.prompt(text)
    turn = conversation.turns
    start = time.perf_counter()
    handle = None
    stopped = False
    try:
        handle = engine.submit(ids, params)
        for event in handle:
            write_stdout(event.text)
    except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
        stopped = True
        if handle is not None:
            handle.cancel()
    result = None
    while handle is not None:  # the cancelled request ends at the driver's next step
        try:
            result = handle.result()
            break
        except KeyboardInterrupt:  # Ctrl-C again while it ends: still not the program's end
            handle.cancel()
    write_stdout("\n")
    if result is None:
        conversation.messages.pop()
        return True
    conversation.reply(result.text)
    if result.finish_reason == "error":
        say(f"error: {result.error}")
        return engine.healthy
    cached = result.cached_prompt_tokens
    say(f"[turn {turn}: {result.prompt_tokens} prompt tokens ({cached} cached, {result.prompt_tokens - cached} prefilled), "
        f"{len(result.token_ids)} new tokens, {time.perf_counter() - start:.2f} s"
        + (", stopped by Ctrl-C]" if stopped or result.finish_reason == "cancelled" else
           f", cut at --max-new-tokens {params.max_new_tokens} (finish_reason length): raise it for longer replies]"
           if result.finish_reason == "length" else "]"))
    return True


__all__ = ["Conversation", "chat_command"]
