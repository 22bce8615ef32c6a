"""RULER's synthetic long-context tasks, generated offline and seeded (Hsieh et al., 2024, arXiv 2404.06654).

    sample = ruler_sample("niah_multikey", tokenizer, template, context_tokens=4096, index=0, seed=0)
    sample.prompt_ids, sample.answers        # the rendered prompt (at most context_tokens - sample.max_new_tokens)
    score(reply, sample.answers)             # RULER's string_match_all: the fraction of answers found in the reply

The tasks follow the paper's definitions (section 3, table 2) and its prompt templates
(RULER's scripts/data/synthetic/constants.py), with this repository's own offline haystacks and words:

- niah_single (S-NIAH): one needle "One of the special magic numbers for {key} is: {value}." in a
  repeated-noise haystack ("The grass is green. The sky is blue. ..."); the query names the key.
- niah_multikey (MK-NIAH): four needles with different keys in an essay-like haystack (the
  sentences of treeattn.eval.haystack.FILLER instead of Paul Graham's essays); one key is asked,
  the other three are distractors.
- niah_multivalue (MV-NIAH): four needles with the same key and different values; all four asked.
- niah_multiquery (MQ-NIAH): four needles with different keys; all four keys asked.
- vt (variable tracking): a chain "VAR A = 12345", "VAR B = VAR A", ... of 4 hops (5 variables)
  scattered in the noise haystack; asked: every variable that holds the value.
- cwe (common words extraction): a numbered list of words in which 10 words appear 30 times each
  and the others 3 times each; asked: the 10 most common words.

Keys are word pairs ("amber-lantern", RULER's word keys), values 7-digit numbers, variables 5
capital letters. Needle depths are drawn uniformly per sample. Every prompt is sized to the
largest haystack whose rendered prompt plus the answer's budget fits `context_tokens`.
A model with a chat template gets the task as a user message and the answer prefix after the
generation prompt; a base model gets the text and the answer prefix to complete.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from treeattn.eval.haystack import FILLER

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about "
        "the numbers afterwards.\n{context}\nWhat are all the special magic numbers for {query} mentioned in the provided text?")
NIAH_ANSWER = " The special magic numbers for {query} mentioned in the provided text are"
VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
      "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
             "the value {query}, they are: ")
CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
       "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
MAX_NEW_TOKENS = {"niah_single": 24, "niah_multikey": 24, "niah_multivalue": 64, "niah_multiquery": 64, "vt": 32, "cwe": 96}
"""Greedy tokens per answer (RULER generates 128 for NIAH, 30 for vt, 120 for cwe; the answers here need fewer)."""

WORDS = tuple("""
amber anchor apple arrow autumn badge bamboo banner barrel basket beacon bell berry blanket blossom bottle bracket branch
bread breeze brick bridge bucket butter button cabin cactus camera candle canoe canvas carpet castle cedar chair chalk
cherry chimney circle cloud clover coast cobalt coffee comet copper coral cotton crayon cricket crown crystal cup curtain
daisy desert diamond dolphin door dragon drum eagle echo ember engine falcon feather fence fern field flame flute forest
fossil fountain garden garnet ginger glacier globe granite grape gravel guitar hammer harbor harp hazel helmet honey horizon
island ivory jacket jasmine jewel kettle kite ladder lagoon lantern laurel lemon lily linen lizard locket magnet maple marble
meadow melon mirror mist mountain needle nest noodle oak ocean olive onion orbit orchid otter paddle palace panda paper
parrot pebble pencil pepper piano pillow pine planet plum pocket pond poppy quartz quill rabbit radar rain raven ribbon
river robin rocket rose ruby saddle sail salmon sand saturn scarf shadow shell silver sketch sled slate snow socket spruce
star stone storm sugar summit sunset swan table thistle thunder tiger timber tomato topaz tower trumpet tulip tunnel
turtle umbrella valley velvet violet volcano wagon walnut willow window winter wolf yarn zebra zephyr
""".split())


@dataclass(frozen=True)
class RulerSample:
    """One prompt of one task.

    Attributes:
        task: one of TASKS.
        prompt_ids: the rendered prompt's token ids (with the answer prefix).
        answers: what the reply must contain (all of them, case-insensitive).
        context_tokens: the length the prompt (and its answer) was sized for.
        max_new_tokens: the greedy tokens the answer may take (MAX_NEW_TOKENS).
    """

    task: str
    prompt_ids: list[int]
    answers: list[str]
    context_tokens: int
    max_new_tokens: int


def score(reply: str, answers: list[str]) -> float:
    """RULER's string_match_all: the fraction of `answers` that appear in `reply`, case-insensitive.

        >>> from treeattn.eval.ruler_tasks import score
        >>> score(" 1234567 and 7654321.", ["1234567", "7654321", "1111111", "2222222"])
        0.5
    """
    text = reply.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def ruler_sample(task: str, tokenizer, template, *, context_tokens: int, index: int, seed: int = 0) -> RulerSample:
    """Sample `index` of `task` sized for `context_tokens` (see the module docstring); the same
    arguments give the same prompt. ValueError naming the argument for an unknown task or a context
    too short for the task's frame."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    rng = random.Random(f"{task}:{context_tokens}:{seed}:{index}")
    build = {"vt": _vt, "cwe": _cwe}.get(task, _niah)
    render = build(task, rng)  # size -> (text, answer prefix, answers)
    budget = context_tokens - MAX_NEW_TOKENS[task]

    def ids_of(size: int) -> tuple[list[int], list[str]]:
        text, prefix, answers = render(size)
        return _encode(tokenizer, template, text, prefix), answers

    if len(ids_of(0)[0]) > budget:
        raise ValueError(f"context_tokens={context_tokens} is too short for {task}: its frame alone takes {len(ids_of(0)[0])} "
                         f"tokens")
    low, high = 0, 1
    while len(ids_of(high)[0]) <= budget:  # the haystack size: the largest whose prompt fits
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if len(ids_of(mid)[0]) <= budget else (low, mid)
    ids, answers = ids_of(low)
    return RulerSample(task, ids, answers, context_tokens, MAX_NEW_TOKENS[task])


def _encode(tokenizer, template, text: str, prefix: str) -> list[int]:
    """The prompt's ids: with a chat template the task as the user turn, then the answer prefix; a
    base model's: the text and the prefix to complete."""
    if template is None:
        return tokenizer.encode(text + prefix).ids
    from treeattn.models.chat import encode_chat, messages

    return encode_chat(tokenizer, template, messages(text)) + tokenizer.encode(prefix.lstrip(), add_special_tokens=False).ids


def _key(rng: random.Random, taken: set) -> str:
    while True:
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set) -> str:
    while True:
        value = str(rng.randrange(1_000_000, 10_000_000))
        if value not in taken:
            taken.add(value)
            return value


def _scatter(rng: random.Random, haystack: list[str], needles: list[str]) -> str:
    """The haystack's sentences with each needle inserted at its own uniformly drawn depth (in order)."""
    slots = sorted(rng.randrange(len(haystack) + 1) for _ in needles)
    out, last = [], 0
    for slot, needle in zip(slots, needles):
        out += haystack[last:slot] + [needle]
        last = slot
    return " ".join(out + haystack[last:])


def _niah(task: str, rng: random.Random):
    keys, values = set(), set()
    if task == "niah_multivalue":
        key = _key(rng, keys)
        pairs = [(key, _number(rng, values)) for _ in range(4)]
        queried = [key]
    else:
        pairs = [(_key(rng, keys), _number(rng, values)) for _ in range(1 if task == "niah_single" else 4)]
        queried = [k for k, _ in pairs] if task == "niah_multiquery" else [pairs[0][0]]
    answers = [v for k, v in pairs if k in queried]
    needles = [NEEDLE.format(key=k, value=v) for k, v in pairs]
    rng.shuffle(needles)
    order = [rng.random() for _ in range(4096)]  # the essay haystack's sentence order, fixed per sample
    query = ", ".join(queried[:-1]) + ", and " + queried[-1] if len(queried) > 1 else queried[0]
    state = rng.random()

    def render(size: int):
        if task == "niah_single":
            haystack = [NOISE] * size
        else:
            haystack = [FILLER[int(order[i % len(order)] * len(FILLER))] for i in range(size)]
        context = _scatter(random.Random(state), haystack, needles)
        return NIAH.format(context=context, query=query), NIAH_ANSWER.format(query=query), answers

    return render


def _vt(task: str, rng: random.Random):
    names: set = set()
    variables = []
    while len(variables) < 5:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.add(name)
            variables.append(name)
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {variables[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(variables, variables[1:])]
    state = rng.random()

    def render(size: int):
        context = _scatter(random.Random(state), [NOISE] * size, chain)
        return VT.format(context=context, query=value), VT_ANSWER.format(num_v=len(variables), query=value), list(variables)

    return render


def _cwe(task: str, rng: random.Random):
    words = list(WORDS)
    rng.shuffle(words)
    common, rare = words[:10], words[10:]
    state = rng.random()

    def render(size: int):
        listed = common * 30 + rare[: min(size, len(rare))] * 3
        listed += [f"{rare[i % len(rare)]}{i // len(rare)}" for i in range(len(rare), size)] * 3  # more distinct rare words
        random.Random(state).shuffle(listed)
        context = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
        return CWE.format(context=context), CWE_ANSWER, list(common)

    return render


def reply_text(tokenizer, ids: list[int]) -> str:
    """The reply's text (special tokens dropped), for scoring."""
    return re.sub(r"\s+", " ", tokenizer.decode(ids, skip_special_tokens=True))


__all__ = ["MAX_NEW_TOKENS", "TASKS", "RulerSample", "reply_text", "ruler_sample", "score"]
