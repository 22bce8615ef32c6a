"""Speculative decoding with a draft model: a small model of the target's tokenizer proposes tokens.

    files = read_draft_model("draft.gguf")                       # config + tokenizer, no weights
    check_draft_model(files, target, positions=len(prompt) + max_new_tokens)
    drafter = DraftModelDrafter(load_model("draft.gguf"), capacity=..., sampling=SamplingParams())
    drafter.prefill(prompt_ids)                                   # the prompt into the draft's cache
    draft, q = drafter.propose(context, k, generator)             # int64 (d,); q float64 (d, V) or None

Where it runs: on one process, rank 0 of the generation, with its own whole (unsharded) KV cache of
the context. Rank 0 drafts right after it accepts the previous step's tokens and sends the drafts in
the same broadcast as those tokens (treeattn.generate), so drafting adds no communication round. The
alternative, the draft's cache sharded like the target's, pays one combine per draft layer and a
broadcast per drafted token but splits the draft's attention over the context: over gloo it was slower
per drafted token on the 2-core machine, over the shared-memory transport 8-15% faster at 4K tokens
(docs/benchmarks.md, "Speculative decoding with a draft model"); it is not implemented.

Proposals: greedily (temperature 0; the proposal is then one-hot, q = None), else each token drawn
from the draft's own sampling distribution q (the same temperature, top-k and top-p as the target's),
and q returned for the acceptance rule (treeattn.speculate.accept). The cache remembers the token ids
it holds: each propose() keeps the longest prefix of them that the new context shares (the accepted
drafts) and runs the rest, so a rejection costs no more than the tokens that replace the rejected ones.
"""

from __future__ import annotations

import os

import torch

from treeattn.cache import ShardedKVCache
from treeattn.engine.config import ConfigError, SamplingParams
from treeattn.generate import sampling_probs
from treeattn.models.attention import LocalAttention
from treeattn.speculate import draw


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


def check_draft_model(draft, target, *, positions: int) -> None:
    """Check that `draft` can propose tokens for `target`.

    Args:
        draft, target: anything with .config (a LlamaConfig) and .tokenizer (tokenizers.Tokenizer or
            None): a loaded model or read_draft_model's result.
        positions: positions the draft must reach (prompt + max_new_tokens).

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
                          f"{positions} the prompt and max_new_tokens need")


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


def check_loaded_draft(draft_model, target, *, positions: int):
    """The draft model of GenerationConfig.draft_model, loaded like `target` (its dtype and device)
    when it is a path, and checked against `target` (check_draft_model). Returns the loaded model.

    Raises:
        ConfigError("draft_model") naming what is wrong.
    """
    from treeattn.models.loader import load_model

    if isinstance(draft_model, str):
        check_draft_model(read_draft_model(draft_model), target, positions=positions)  # before reading any weight
        return load_model(draft_model, dtype=target.dtype, device=target.device)
    check_draft_model(draft_model, target, positions=positions)
    return draft_model


def describe(draft_model) -> str:
    """GenerationConfig.draft_model in words for reports: the path, or the loaded model's class and size."""
    if isinstance(draft_model, str):
        return draft_model
    return f"{type(draft_model).__name__} ({draft_model.config.num_layers} layers, loaded)"


class DraftModelDrafter:
    """A draft model proposing tokens from its own whole KV cache, on this process.

    Args:
        model: the draft model (a LlamaModel), the target's tokenizer.
        capacity: the most tokens its cache holds (prompt + max_new_tokens + draft_tokens).
        sampling: the target's sampling parameters; temperature 0: greedy proposals.
        chunk: tokens per forward pass of the prompt's prefill.
    """

    def __init__(self, model, *, capacity: int, sampling: SamplingParams, chunk: int = 1024) -> None:
        c = model.config
        self.model, self.sampling, self.chunk = model, sampling, chunk
        self.cache = ShardedKVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                    value_dim=c.cache_value_dim, capacity=capacity, dtype=model.dtype, device=model.device)
        self.held = torch.zeros(0, dtype=torch.int64)  # the token ids whose keys/values the cache holds, in order
        self.attend = LocalAttention()

    def prefill(self, prompt: list[int]) -> None:
        """Run the prompt into the draft's (empty) cache; its logits come with the first propose()."""
        self._run(torch.tensor(prompt, dtype=torch.int64))

    def propose(self, context: torch.Tensor, k: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft k tokens after `context`.

        Args:
            context: int64 (L,) on the CPU, L >= 1: the prompt and every token generated so far.
            k: tokens to draft, >= 0 (0: nothing is run).
            generator: CPU torch.Generator of the draws (one uniform per drafted token) when
                sampling; unused for greedy proposals.

        Returns:
            (draft, q): int64 (d,) with d <= k (fewer if the draft's logits turn non-finite), and
            float64 (d, V), the distribution each token was drawn from (None when greedy: one-hot).
        """
        if k == 0:
            return context[:0].clone(), None
        kept = self._shared_prefix(context[:-1])  # the last token is always run: its logits propose the first draft
        self.cache.truncate(kept)
        self.held = self.held[:kept]
        hidden = self._run(context[kept:])
        tokens, rows = [], []
        for i in range(k):
            logits = self.model.logits(hidden[None]).float().cpu()  # (1, V)
            if not bool(torch.isfinite(logits).all()):
                break
            if self.sampling.temperature == 0:
                token = int(logits[0].argmax())
            else:
                q = sampling_probs(logits, self.sampling)[0]
                token = draw(q, float(torch.rand(1, generator=generator, dtype=torch.float64)))
                rows.append(q)
            tokens.append(token)
            if i < k - 1:
                hidden = self._run(torch.tensor([token], dtype=torch.int64))
        draft = torch.tensor(tokens, dtype=torch.int64)
        return draft, torch.stack(rows) if rows else None

    def _shared_prefix(self, context: torch.Tensor) -> int:
        """How many leading tokens of `context` (int64 (n,)) the cache already holds."""
        n = min(self.held.numel(), context.numel())
        differ = (self.held[:n] != context[:n]).nonzero()
        return int(differ[0]) if differ.numel() else n

    def _run(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run tokens int64 (n,), n >= 1, after the cached ones, in chunks; returns the last one's final
        hidden state (hidden_size,)."""
        for start in range(0, tokens.numel(), self.chunk):
            piece = tokens[start: start + self.chunk]
            positions = torch.arange(self.cache.length, self.cache.length + piece.numel())[None].to(self.model.device)
            slots = self.cache.extend(positions)
            hidden = self.model(piece[None].to(self.model.device), positions, self.cache.update(slots), self.attend, chunk=self.chunk)
            self.held = torch.cat([self.held, piece])
        return hidden[0, -1]
