"""Needle-in-a-haystack prompts: a long filler document with one fact hidden at a chosen depth.

    case = needle_case(tokenizer, template, context_tokens=4096, depth=0.5, seed=0)
    case.prompt_ids          # chat-rendered prompt, about context_tokens long
    case.answer              # "7294": what a correct reply must contain
    is_correct(reply, case)  # exact retrieval: the answer appears in the reply

The haystack is built from FILLER, plain sentences with no digits, shuffled per seed, so the needle
(the only number in the document) is the one fact a model can retrieve. Nothing is downloaded.
The prompt is cut by tokens: the filler gets what the chat template, instructions, needle and
question leave of `context_tokens`, and the needle sits after the sentence nearest `depth` (0:
first, 1: last).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = (
    "The river bends twice before it reaches the old mill at the edge of the valley.",
    "Most of the orchard was planted by the first families who settled along the northern road.",
    "In spring the meadow fills with clover, and the bees work from dawn until late afternoon.",
    "The library keeps its maps in long flat drawers that smell faintly of cedar and dust.",
    "A light rain fell over the harbour while the fishing boats waited for the tide to turn.",
    "Bread from the corner bakery is usually gone before the market opens on Saturday mornings.",
    "The museum added a new wing for textiles, with looms that visitors are allowed to try.",
    "Walkers who climb the eastern ridge can see three villages and the lake beyond them.",
    "The town council met in the school hall because the roof of the old chamber was leaking.",
    "Every autumn the students collect fallen leaves and press them between the pages of heavy books.",
    "The lighthouse keeper wrote short notes about the weather in a log that nobody else read.",
    "Cyclists prefer the canal path, which is flat and shaded by a long row of poplar trees.",
    "The choir rehearses on Thursday evenings and performs at the chapel near the square.",
    "Farmers along the coast grow potatoes in sandy soil that warms quickly after the winter.",
    "A small ferry crosses the estuary, carrying bicycles, crates of apples and the occasional goat.",
    "The painter spent a whole summer trying to capture the colour of the evening sky over the hills.",
    "Children learn to swim in the shallow bay, where the water stays calm behind the sandbar.",
    "The railway station was rebuilt in brick after a fire destroyed the original wooden hall.",
    "Old letters found in the attic described a journey across the mountains by horse and cart.",
    "The cheese maker ages her wheels in a cool cellar dug into the side of the hill.",
    "Fog rolled in from the sea and hid the church tower for most of the morning.",
    "The market sells wool, honey, candles and baskets woven from willow branches.",
    "A narrow bridge of grey stone connects the two halves of the village across the stream.",
    "The botanist catalogued ferns in the damp woods and pressed the rarest ones for the collection.",
    "In winter the pond freezes hard enough for skating, and lanterns are hung along its banks.",
    "The carpenter builds chairs without nails, joining each piece with pegs of seasoned oak.",
    "Travellers often stop at the inn by the crossroads for soup and a seat by the fire.",
    "The observatory opens its dome on clear nights so that visitors can look at the planets.",
    "Sheep graze on the high pastures all summer and are brought down before the first snow.",
    "The potter fires her kiln once a month and invites neighbours to watch the glaze change colour.",
)
NEEDLE = "The secret number is {answer}."
QUESTION = "What is the secret number? Answer with the number only."
# A base model's prompt (no chat template): the answer is what completes the last line.
COMPLETION = "{document}\n\nQuestion: {question}\nAnswer: The secret number is"


@dataclass(frozen=True)
class NeedleCase:
    """One prompt: the chat-rendered ids and what the answer must contain.

    Attributes:
        prompt_ids: token ids of the rendered chat prompt (document, question, generation prompt).
        answer: the hidden number as text.
        context_tokens: requested prompt length in tokens (the rendered prompt is within a
            sentence of it, never longer).
        depth: requested needle depth in [0, 1]; actual_depth: where it landed, by tokens.
        question: the question asked.
    """

    prompt_ids: list[int]
    answer: str
    context_tokens: int
    depth: float
    actual_depth: float
    question: str


def needle_case(tokenizer, template, *, context_tokens: int, depth: float, seed: int = 0,
                system: str | None = None) -> NeedleCase:
    """Build a prompt of about `context_tokens` tokens (tokenizer's count; the filler is cut to what
    the template, instructions, needle and question leave) with the needle at `depth`, rendered
    with the question through the chat `template`; with template None (a base model), as plain
    text to complete (COMPLETION: the document, the question, then "Answer: The secret number is")."""

    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed * 1_000_003 + context_tokens)
    answer = str(rng.randrange(1000, 10000))
    frame = len(_encode(tokenizer, template, NEEDLE.format(answer=answer), system))
    budget = context_tokens - frame
    if budget < 1:
        raise ValueError(f"context_tokens={context_tokens} leaves no room for filler: the question and template take {frame}")
    sentences, lengths, total = [], [], 0
    while total < budget:
        batch = list(FILLER)
        rng.shuffle(batch)
        for sentence in batch:
            n = len(tokenizer.encode(" " + sentence, add_special_tokens=False).ids)
            if total + n > budget:
                break
            sentences.append(sentence)
            lengths.append(n)
            total += n
        else:
            continue
        break
    cut = min(range(len(sentences) + 1), key=lambda i: abs(sum(lengths[:i]) - depth * total))
    needle = NEEDLE.format(answer=answer)
    document = " ".join(sentences[:cut] + [needle] + sentences[cut:])
    ids = _encode(tokenizer, template, document, system)
    return NeedleCase(ids, answer, context_tokens, depth, sum(lengths[:cut]) / max(total, 1), QUESTION)


def _encode(tokenizer, template, document: str, system: str | None) -> list[int]:
    """The prompt's ids: the chat-rendered user message, or (template None) COMPLETION's text."""
    from treeattn.models.chat import encode_chat, messages

    if template is None:
        return tokenizer.encode(COMPLETION.format(document=document, question=QUESTION.split("?")[0] + "?")).ids
    return encode_chat(tokenizer, template, messages(_user_message(document), system=system))


def _user_message(document: str) -> str:
    return f"Read the document and answer the question.\n\nDocument:\n{document}\n\nQuestion: {QUESTION}"


def is_correct(reply: str, case: NeedleCase) -> bool:
    """Exact retrieval: the hidden number appears in the reply as a whole number."""
    import re

    return re.search(rf"(?<!\d){case.answer}(?!\d)", reply) is not None


__all__ = ["FILLER", "NEEDLE", "QUESTION", "NeedleCase", "is_correct", "needle_case"]
