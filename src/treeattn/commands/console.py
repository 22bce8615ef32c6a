"""What the engine's commands (`treeattn generate`, `treeattn chat`) show while they work.

    say("loading model.gguf on 2 rank(s)")            # one status line on stderr
    display = GenerateDisplay(stream_text=True)         # picklable: rank 0 of `generate` gets it
    display.loaded(seconds=2.1)                         # "model loaded in 2.10 s"
    display.on_prefill(1024, 3197)                      # prefill progress, chunk by chunk
    display.on_layer(7, 30)                             # within a step: rank 0 finished layer 8 of 30
    with display.run(tokenizer, world_size, 3197, 64) as on_token:
        for step in generation: on_token(step)          # the answer streamed to stdout as decoded (step.texts)

Status and progress go to stderr, the answer to stdout, so the answer can be piped. On a terminal
stderr shows rich's progress bars; when stderr is a file or a pipe it gets plain lines, one per
event (no spinners, no cursor movement, no colours), so a log stays readable.

The streamed text is the engine's own (StepOutput.texts, from treeattn.engine.output): detokenized
incrementally, a trailing incomplete multi-byte character held back until it completes, and with
stop strings a tail that could begin one held back until it cannot (vLLM's output processor and
llama-server do the same), the text ending right before a stop string. So what streams is exactly
GenerationResult.texts.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module was imported),
    so that "total wall time" counts the interpreter's start, imports and loading too."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def stderr_console():
    """A rich Console on stderr; plain (no colour, no cursor control) when stderr is not a terminal."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def say(message: str) -> None:
    """One status line on stderr (dim on a terminal, plain text otherwise)."""
    console = stderr_console()
    if console.is_terminal:
        console.print(message, style="dim", markup=False)
    else:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def write_stdout(text: str) -> None:
    """Write `text` to stdout now (the answer is shown as it is decoded)."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


class GenerateDisplay:
    """`treeattn generate`'s display on rank 0 (see the module docstring). Picklable, so ranks
    started by ta.spawn receive it.

    Args:
        stream_text: write the one sequence's text to stdout as it is decoded (text mode with one
            prompt); otherwise show only decode progress (a batch, or --json).
    """

    def __init__(self, stream_text: bool) -> None:
        self.stream_text = stream_text
        self._progress = self._prefill_task = None
        self._prefill_started: float | None = None
        self._computed, self._total, self._prefilled = 0, 0, False

    def loaded(self, seconds: float) -> None:
        say(f"model loaded in {seconds:.2f} s")

    def on_prefill(self, computed: int, total: int) -> None:
        """Prefill progress (the engine's driver thread, once per chunk)."""
        now = time.perf_counter()
        if self._prefill_started is None:  # (called outside run())
            self._prefill_started = now
        self._computed, self._total, self._prefilled = computed, total, computed >= total
        if self._progress is not None:
            self._progress.update(self._prefill_task, completed=computed, total=total, description="prefill")
        else:
            say(f"prefill {computed}/{total} tokens ({now - self._prefill_started:.2f} s)")

    def on_layer(self, layer: int, layers: int) -> None:
        """Rank 0 has run layer `layer` (0-based) of `layers` in the step now running (a forward hook
        on its decoder layers, in the step's thread). On 2+ ranks a prompt-only step is a ring step of
        up to 4096 tokens a rank, the whole of most prompts, and its ranks go through the layers
        together (each layer's ring attention waits for every rank), so this is that step's progress.
        Shown until the prefill is done: the bar's label in a terminal, else a plain line at each
        quarter of the layers."""
        if self._prefill_started is None or self._prefilled:
            return
        done = layer + 1
        if self._progress is not None:
            self._progress.update(self._prefill_task, description=f"prefill (layer {done}/{layers})")
        elif done < layers and done % max(1, layers // 4) == 0:
            say(f"prefill {self._computed}/{self._total} tokens, this step at layer {done}/{layers} "
                f"({time.perf_counter() - self._prefill_started:.2f} s)")

    @contextmanager
    def run(self, tokenizer, world_size: int, prompt_tokens: int, max_new_tokens: int):
        """Context yielding on_token(step) for one Generation on rank 0."""
        console = stderr_console()
        self._prefill_started = time.perf_counter()
        self._computed, self._total, self._prefilled = 0, prompt_tokens, False
        say(f"prefill {prompt_tokens} tokens on {world_size} rank(s), then up to {max_new_tokens} new tokens")
        stream = self.stream_text and tokenizer is not None
        progress = decode_task = None
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=console, transient=stream)
            self._prefill_task = progress.add_task("prefill", total=prompt_tokens)
            if not stream:
                decode_task = progress.add_task("decode", total=max_new_tokens, start=False)
            progress.start()
            self._progress = progress

        def on_token(step) -> None:
            self._prefilled = True
            if step.index == 0 and progress is not None:
                progress.update(self._prefill_task, completed=prompt_tokens)
                if stream:  # the answer takes the terminal from here
                    progress.stop()
                    self._progress = None
                else:
                    progress.start_task(decode_task)
            if stream:
                write_stdout(step.texts[0])  # the engine's text: stop strings cut, a possible start held back
            elif decode_task is not None:
                progress.update(decode_task, completed=step.index + 1)

        try:
            yield on_token
        finally:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None
            if stream:
                write_stdout("\n")


__all__ = ["GenerateDisplay", "process_age_s", "say", "stderr_console", "write_stdout"]
