"""Draft models for speculative decoding: checked against the model before any rank starts.

    files = read_draft_model("draft.gguf")                       # config + tokenizer, no weights
    check_draft_model(files, target, positions=len(prompt) + max_new_tokens)

A draft model must share the model's tokenizer (the same ids for the same text) and reach every
position the generation runs. It runs in the engine (treeattn.engine.worker.draft: on every rank, over
its own KV cache of the model's blocks); ta.generate and `treeattn serve` take it through the
engine's speculate="draft".
"""

from __future__ import annotations

import os

from treeattn.engine.config import ConfigError


def read_draft_model(path: str | os.PathLike):
    """The draft checkpoint's config and tokenizer (treeattn.models.loader.ModelFiles), its tensor names
    and shapes checked, without reading its weights.

    Raises:
        ConfigError("draft_model"): no such file or directory, or not a model checkpoint.
    """
    from treeattn.models.loader import check_checkpoint, read_model_files

    try:
        check_checkpoint(path)
        return read_model_files(path)
    except (OSError, ValueError, TypeError) as exc:
        reason = " ".join(str(exc).split())  # one line
        raise ConfigError("draft_model", f"draft_model={os.fspath(path)} is not a usable model checkpoint: {reason}") from None


def check_draft_model(draft, target, *, positions: int, needed_by: str = "the prompt and max_new_tokens need") -> None:
    """Check that `draft` can propose tokens for `target`.

    Args:
        draft, target: anything with .config (a LlamaConfig) and .tokenizer (tokenizers.Tokenizer or
            None): a loaded model or read_draft_model's result.
        positions: positions the draft must reach (prompt + max_new_tokens).
        needed_by: what needs them, in the error's words.

    Raises:
        ConfigError("draft_model"): another vocabulary size; another tokenizer (the token -> id maps
            with added tokens, and which added tokens are special, must be equal; where neither model
            has a tokenizer only the sizes are compared); a context window shorter than `positions`.
    """
    ours, theirs = draft.config.vocab_size, target.config.vocab_size
    if ours != theirs:
        raise ConfigError("draft_model", f"draft_model has a vocabulary of {ours} tokens, the model {theirs}: "
                          "a draft model must share the model's tokenizer")
    if (draft.tokenizer is None) != (target.tokenizer is None):
        which = "draft_model has no tokenizer" if draft.tokenizer is None else "the model has no tokenizer"
        raise ConfigError("draft_model", f"{which}, so it cannot be checked that the draft shares the model's: "
                          "give a draft model with the model's tokenizer")
    if draft.tokenizer is not None:
        difference = _tokenizer_difference(draft.tokenizer, target.tokenizer)
        if difference:
            raise ConfigError("draft_model", f"draft_model has another tokenizer than the model: {difference}")
    window = draft.config.max_position_embeddings
    if window < positions:
        raise ConfigError("draft_model", f"draft_model's context window of {window} positions is shorter than the "
                          f"{positions} {needed_by}")


def _tokenizer_difference(draft, target) -> str | None:
    """The first difference between two tokenizers.Tokenizer vocabularies, in words; None if equal."""
    a, b = draft.get_vocab(with_added_tokens=True), target.get_vocab(with_added_tokens=True)
    if a != b:
        token = min(set(a.items()) ^ set(b.items()))[0]
        return f"token {token!r} is id {a.get(token)} in the draft, {b.get(token)} in the model"
    special_a = {i: (t.content, t.special) for i, t in draft.get_added_tokens_decoder().items()}
    special_b = {i: (t.content, t.special) for i, t in target.get_added_tokens_decoder().items()}
    if special_a != special_b:
        i = min(set(special_a.items()) ^ set(special_b.items()))[0]
        return f"added token {i} is {special_a.get(i)} (content, special) in the draft, {special_b.get(i)} in the model"
    return None


def describe(draft_model) -> str:
    """EngineConfig.draft_model in words for reports: the path, or the loaded model's class and size."""
    if isinstance(draft_model, str):
        return draft_model
    return f"{type(draft_model).__name__} ({draft_model.config.num_layers} layers, loaded)"
