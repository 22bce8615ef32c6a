"""`treeattn chat`: the conversation through the model's chat template, replies streamed, each turn's
earlier tokens taken from the prefix cache, /reset and /exit, lines from a non-terminal stdin, and
Ctrl-C through a pseudo-terminal stopping the reply and not the program (SmolLM2, 2 ranks)."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import sys
import time

import gguf
import pytest

pytest.importorskip("transformers")

from gguf_files import write_gguf  # noqa: E402
from helpers.gguf_models import hf_model  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from treeattn.cli import app  # noqa: E402
from treeattn.commands.chat import Conversation  # noqa: E402
from treeattn.models.loader import read_model_files  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours and cursor control, the terminal's business
TURN = re.compile(r"\[turn (\d+): (\d+) prompt tokens \((\d+) cached, (\d+) prefilled\), (\d+) new tokens, [\d.]+ s(, [^\]]*)?\]")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "tiny.gguf"
    write_gguf(path, hf_model("llama"), gguf.GGMLQuantizationType.Q8_0, context_length=1024)
    return path


def test_lines_from_stdin_each_turn_prefills_only_what_is_new(tiny):
    """Not a terminal: one reply per line. Turn 2's prompt is turn 1's prompt + reply + the new
    message; its full blocks of turn 1's tokens come from the prefix cache. /reset starts over."""
    block = 4
    result = CliRunner().invoke(app, ["chat", str(tiny), "--max-new-tokens", "6", "--block-size", str(block), "--system", "S"],
                                input="the hat\nthe\n/reset\nthe hat\n/exit\nnever read\n")
    assert result.exit_code == 0, result.output
    turns = [tuple(int(g) for g in m.groups()[:5]) for m in TURN.finditer(result.stderr)]
    assert [t[0] for t in turns] == [1, 2, 1] and "conversation cleared" in result.stderr
    files = read_model_files(tiny)
    first = Conversation(files.tokenizer, files.chat_template, "S").prompt("the hat")
    assert turns[0][1:3] == (len(first), 0)  # nothing cached before the first turn
    assert turns[1][2] >= len(first) // block * block > 0  # at least turn 1's prompt blocks were cached
    assert turns[1][3] == turns[1][1] - turns[1][2] < turns[1][1]
    # the same first turn again: its full blocks but the one holding its last token (which must run to sample)
    assert turns[2][1] == len(first) and turns[2][2] == (len(first) - 1) // block * block
    replies = result.stdout.splitlines()
    assert len(replies) == 3  # one line per reply; "never read" after /exit is not answered


def test_refuses_a_model_without_chat_template(tmp_path):
    path = tmp_path / "bare.gguf"
    write_gguf(path, hf_model("llama"), gguf.GGMLQuantizationType.F16, chat_template=None)
    result = CliRunner().invoke(app, ["chat", str(path)])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert re.search(r"bare\.gguf: the model has no chat template \(.*\); use treeattn generate$",
                     result.stderr.strip()), result.stderr


def test_chat_end_of_turn_names_what_is_missing():
    """One check of a model's chat files for `treeattn chat` and `generate --chat` (models.chat)."""
    from types import SimpleNamespace

    from treeattn.models.chat import chat_end_of_turn

    with pytest.raises(ValueError, match=r"^--chat: m has no tokenizer \(tokenizer\.json"):
        chat_end_of_turn(SimpleNamespace(tokenizer=None, chat_template=None), "--chat: m", otherwise="; x")
    with pytest.raises(ValueError, match=r"^m has no chat template \(.*\.gguf\); use generate$"):
        chat_end_of_turn(SimpleNamespace(tokenizer=object(), chat_template=None), "m", otherwise="; use generate")


class Terminal:
    """A child process on a pseudo-terminal: what it writes, and keys typed into it."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal (Ctrl-C -> SIGINT)
            # a suite started in the background (`cmd &`, nohup) ignores SIGINT, and an ignored signal
            # stays ignored across exec: give the chat the default a terminal user has
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(argv[0], argv, os.environ)
        self.output = ""

    def expect(self, pattern: str, timeout: float = 300) -> re.Match:
        """Read until `pattern` matches the output after what earlier expects consumed (a timeout
        guards against a hang; it is not a speed bound)."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.output)
            if match:
                self.output = self.output[match.end():]
                return match
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {pattern!r} within {timeout} s; output: {self.output[-2000:]!r}")
            try:
                data = os.read(self.fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                data = b""
            if not data:
                raise AssertionError(f"the process ended before {pattern!r}; output: {self.output[-2000:]!r}")
            self.output += ANSI.sub("", data.decode("utf-8", "replace")).replace("\r\n", "\n")

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.read(self.fd, 4096)  # drain, so the child never blocks writing
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError("the chat did not exit")


@pytest.mark.slow  # scheduled first under pytest-xdist (tests/conftest.py): SmolLM2 on 2 ranks in a pseudo-terminal
def test_chat_on_smollm2_in_a_terminal_ctrl_c_stops_the_reply_not_the_chat():
    """SmolLM2 on 2 ranks in a pseudo-terminal: a reply streams, the second turn finds the first in
    the prefix cache, Ctrl-C in the middle of a reply stops it and the prompt comes back, /exit ends
    the program with status 0."""
    from treeattn.eval.demo import smollm2_path

    term = Terminal([sys.executable, "-m", "treeattn", "chat", smollm2_path(), "--nproc", "2", "--max-new-tokens", "48",
                     "--block-size", "16"])
    try:
        term.expect(r"ready in [\d.]+ s\. Ctrl-C stops a reply")
        term.expect(r"> ")
        term.type("What is 2+2?\r")
        term.expect(r"What is 2\+2\?\n")  # the terminal's echo
        reply = term.expect(r"(.+)\n\[turn 1: ")
        assert reply.group(1).strip()
        first = term.expect(r"(\d+) prompt tokens \((\d+) cached")
        assert first.group(2) == "0"
        term.expect(r"> ")
        term.type("Write a very long story about a cat.\r")
        term.expect(r"cat\.\n")
        term.expect(r"\w")  # the reply has begun
        term.type("\x03")  # Ctrl-C: the line discipline sends SIGINT to the foreground process group
        second = term.expect(r"\[turn 2: (\d+) prompt tokens \((\d+) cached, \d+ prefilled\), (\d+) new tokens, [\d.]+ s, "
                             r"stopped by Ctrl-C\]")
        assert int(second.group(2)) >= int(first.group(1)) // 16 * 16 > 0
        assert int(second.group(3)) < 48
        term.expect(r"> ")
        term.type("/exit\r")
        assert term.wait() == 0
    finally:
        _kill(term)


def test_kv_cache_dtype_and_weight_format_flags_reach_the_engine(tiny, monkeypatch):
    """--kv-cache-dtype and --weight-format are EngineConfig's flags: their values reach ta.Engine (here a
    stand-in that records its options and refuses, so no rank starts); a value outside the field's list
    is refused by the command line naming the flag."""
    from treeattn.engine import client
    from treeattn.engine.errors import ConfigError

    seen = {}

    def engine(model, config):
        seen["config"] = config
        raise ConfigError("kv_cache_dtype", "stand-in")

    monkeypatch.setattr(client, "Engine", engine)
    result = CliRunner().invoke(app, ["chat", str(tiny), "--kv-cache-dtype", "bfloat16", "--weight-format", "packed"],
                                input="/exit\n")
    assert result.exit_code == 2 and "stand-in" in result.stderr
    assert seen["config"].kv_cache_dtype == "bfloat16" and seen["config"].weight_format == "packed"
    result = CliRunner().invoke(app, ["chat", str(tiny), "--kv-cache-dtype", "fp7"], input="/exit\n")
    assert result.exit_code == 2 and "--kv-cache-dtype" in result.output


def test_sampling_comes_from_a_flag_then_the_checkpoint_then_the_chat_defaults(tiny, tmp_path):
    """chat_sampling: the tiny GGUF ships no general.sampling.* keys (chat defaults); a directory's
    generation_config.json gives its values; a flag given wins over both."""
    from treeattn.commands.chat import CHAT_SAMPLING, chat_sampling

    values, sources = chat_sampling(tiny)
    assert values == CHAT_SAMPLING and set(sources.values()) == {"chat default"}
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6, "top_p": 0.95, "eos_token_id": 2}')
    values, sources = chat_sampling(tmp_path, temperature=1.0)
    assert values == {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "repetition_penalty": 1.1}
    assert sources == {"temperature": "flag", "top_p": "the checkpoint's generation config", "top_k": "chat default",
                       "repetition_penalty": "chat default"}
    # greedy, as transformers reads it
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert chat_sampling(tmp_path)[0]["temperature"] == 0.0


@pytest.mark.slow  # scheduled first under pytest-xdist (tests/conftest.py): three sampled SmolLM2 replies
def test_three_turns_on_smollm2_in_a_terminal_sample_with_the_printed_defaults():
    """SmolLM2 on one rank in a pseudo-terminal, three turns: the sampling line says which settings apply
    and where they came from, each turn's status line follows its reply, and turns 2 and 3 find the
    conversation so far in the prefix cache (16-token blocks)."""
    from treeattn.eval.demo import smollm2_path

    term = Terminal([sys.executable, "-m", "treeattn", "chat", smollm2_path(), "--max-new-tokens", "32", "--block-size", "16"])
    try:
        term.expect(r"sampling: --temperature 0\.7 \(chat default\), --top-p 0\.9 \(chat default\), --top-k 0 \(chat default\), "
                    r"--repetition-penalty 1\.1 \(chat default\)")
        cached = []
        for turn, text in enumerate(("My name is Ada.", "What is my name?", "Thank you!"), 1):
            term.expect(r"> ")
            term.type(text + "\r")
            status = term.expect(rf"(.*)\n\[turn {turn}: (\d+) prompt tokens \((\d+) cached, \d+ prefilled\), (\d+) new tokens")
            assert status.group(1).strip() and 0 < int(status.group(4)) <= 32
            cached.append(int(status.group(3)))
        assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
        term.expect(r"> ")
        term.type("/exit\r")
        assert term.wait() == 0
    finally:
        _kill(term)



def _kill(term) -> None:
    """End the pseudo-terminal's process if a test left it running (a failed expect), and reap it."""
    try:
        os.kill(term.pid, signal.SIGKILL)
        os.waitpid(term.pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass

def _greedy_chat_replies(path, *layout: str) -> list[str]:
    """Two turns of a greedy chat in a pseudo-terminal with `layout`'s flags: each reply's text."""
    term = Terminal([sys.executable, "-m", "treeattn", "chat", str(path), *layout, "--temperature", "0", "--max-new-tokens", "8",
                     "--block-size", "4"])
    replies = []
    try:
        for turn, text in enumerate(("the hat", "the cat"), 1):
            term.expect(r"> ")
            term.type(text + "\r")
            term.expect(re.escape(text) + r"\n")  # the terminal's echo
            replies.append(term.expect(rf"(.*)\n\[turn {turn}: \d+ prompt tokens \((\d+) cached").group(1))
        term.expect(r"> ")
        term.type("/exit\r")
        assert term.wait() == 0
    finally:
        _kill(term)
    return replies


@pytest.fixture(scope="module")
def one_process_replies(tiny):
    replies = _greedy_chat_replies(tiny, "--nproc", "1")
    assert len(replies) == 2 and all(r.strip() for r in replies)
    return replies


@pytest.mark.parametrize("tp", ["2", "1"])
def test_chat_in_the_helix_layout_answers_as_one_process(tiny, one_process_replies, tp):
    """`treeattn chat --nproc 2 --tp T` (the tiny Q8_0 Llama, its packed blocks split over both ranks) in a
    pseudo-terminal, two greedy turns: the replies of `--nproc 1`."""
    assert _greedy_chat_replies(tiny, "--nproc", "2", "--tp", tp) == one_process_replies
