"""Build a tokenizers.Tokenizer from the vocabulary a GGUF file carries, so a lone .gguf can chat.

    tokenizer = tokenizer_from_gguf(open_gguf("model.gguf"), path="model.gguf")   # or None

A GGUF has no tokenizer.json; llama.cpp stores the tokenizer as metadata:
    tokenizer.ggml.model    "gpt2" (byte-level BPE: Llama 3, Qwen2, SmolLM, ...) or
                            "llama" (SentencePiece BPE with byte fallback: Llama 2, Mistral;
                            Gemma 3 too, spelled as transformers' GemmaTokenizer: see _gemma_bpe)
    tokenizer.ggml.pre      which pre-tokenizer split the BPE merges were learned on (gpt2 only)
    tokenizer.ggml.tokens, .token_type, .merges (gpt2), .scores (llama),
    tokenizer.ggml.{bos,eos,unknown}_token_id, .add_bos_token, .add_space_prefix

Tokens of type CONTROL (3) become special added tokens (matched whole, skipped when decoding
with skip_special_tokens), USER_DEFINED (4) plain added tokens, as llama.cpp treats them. With
add_bos_token the post-processor puts BOS in front of every encoding, as llama.cpp does.
"""

from __future__ import annotations

import logging

from treeattn.models.gguf import metadata

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex llama.cpp applies before byte-level BPE (llama-vocab.cpp).
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# pre-tokenizers that split every digit off, then apply GPT-2's regex (StarCoder's vocabulary family).
DIGIT_SPLITTING = ("smollm", "starcoder", "refact", "codeshell")
GPT2_DEFAULT = ("default", "gpt2", "gpt-2")
# general.architecture values whose SentencePiece vocabulary is Gemma's (see _gemma_bpe).
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def tokenizer_from_gguf(reader, *, path) -> "tokenizers.Tokenizer | None":  # noqa: F821
    """The file's tokenizer as a tokenizers.Tokenizer, None if the file has no tokenizer.ggml.model.

    Raises:
        ValueError naming the file and key: an unknown tokenizer model, or missing tokens/merges.
    """
    kind = metadata(reader, "tokenizer.ggml.model", None)
    if kind is None:
        return None
    tokens = metadata(reader, "tokenizer.ggml.tokens", path=path)
    types = metadata(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(reader, tokens, path)
    elif kind == "llama" and metadata(reader, "general.architecture", None) in GEMMA_ARCHITECTURES:
        tokenizer = _gemma_bpe(reader, _gemma_spelling(tokens), path)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(reader, tokens, path)
    else:
        raise ValueError(f"{path}: unsupported tokenizer {kind!r} (metadata tokenizer.ggml.model); supported: gpt2, llama")
    _add_special_tokens(tokenizer, tokens, types)
    _add_bos(tokenizer, reader, tokens, default=kind == "llama")
    return tokenizer


def special_token(reader, key: str) -> str | None:
    """The text of the token whose id metadata tokenizer.ggml.<key> names (e.g. "eos_token_id")."""
    token_id = metadata(reader, f"tokenizer.ggml.{key}", None)
    if token_id is None:
        return None
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return tokens.contents(int(token_id)) if 0 <= int(token_id) < len(tokens.data) else None


def _byte_level_bpe(reader, tokens: list[str], path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = metadata(reader, "tokenizer.ggml.merges", path=path)
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    pre = metadata(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in PRE_TOKENIZER_SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in DIGIT_SPLITTING:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        if pre not in GPT2_DEFAULT:
            logger.warning("%s: pre-tokenizer %r (tokenizer.ggml.pre) is not known here; using GPT-2's split, "
                           "which may tokenize some text differently from llama.cpp", path, pre)
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(reader, tokens: list[str], path):
    """SentencePiece BPE as Hugging Face's Llama tokenizer.json spells it: byte fallback, spaces as
    U+2581, merges rebuilt from the scores (a piece's score ranks the merges that produce it)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = metadata(reader, "tokenizer.ggml.scores", path=path)
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = metadata(reader, "tokenizer.ggml.unknown_token_id", 0)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(vocab, scores), unk_token=tokens[unk],
                                     fuse_unk=True, byte_fallback=True))
    prefix = metadata(reader, "tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def _gemma_spelling(tokens: list[str]) -> list[str]:
    """Gemma files store a token of two or more spaces as spaces ("  "), where the model's
    tokenizer spells them "\u2581\u2581": respelled, so that merges built from them match (as
    transformers' GGUF converter does)."""
    return ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]


def _gemma_bpe(reader, tokens: list[str], path):
    """Gemma's SentencePiece BPE as transformers' GemmaTokenizer spells it: byte fallback, no prefix
    space, spaces as U+2581, pieces split after each space; the file has no merges and Gemma's
    scores do not follow its merge order, so merges are rebuilt ranked by the tokens' order in the
    file (the first token's merges first)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {token: i for i, token in enumerate(tokens)}
    unk = metadata(reader, "tokenizer.ggml.unknown_token_id", 0)
    order = [-float(i) for i in range(len(tokens))]  # a higher "score" merges first
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(vocab, order), unk_token=tokens[unk],
                                     fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a vocabulary piece whose halves are pieces too, best score first
    (ties: shorter left piece first, then vocabulary order), as transformers does for SentencePiece."""
    merges = []
    for piece, index in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[index], len(left), len(right), vocab[left], vocab[right], left, right))
    merges.sort()
    return [(m[5], m[6]) for m in merges]


def _add_special_tokens(tokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL tokens as special added tokens; USER_DEFINED ones as plain added tokens where the
    model's vocabulary spells them as the file does (a respelled Gemma space run is not added)."""
    from tokenizers import AddedToken

    control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == CONTROL]
    vocab = tokenizer.get_vocab()
    user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens,
                                                                              types) if kind == USER_DEFINED and t in vocab]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)


def _add_bos(tokenizer, reader, tokens: list[str], *, default: bool) -> None:
    from tokenizers import processors

    bos = metadata(reader, "tokenizer.ggml.bos_token_id", None)
    if bos is None or not metadata(reader, "tokenizer.ggml.add_bos_token", default):
        return
    text = tokens[int(bos)]
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{text} $A", pair=f"{text} $A {text} $B",
                                                             special_tokens=[(text, int(bos))])


__all__ = ["PRE_TOKENIZER_SPLITS", "special_token", "tokenizer_from_gguf"]
