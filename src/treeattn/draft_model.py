"""Speculative decoding with a draft model: a small model of the target's tokenizer proposes tokens.

    files = read_draft_model("draft.gguf")                       # config + tokenizer, no weights
    check_draft_model(files, target, positions=len(prompt) + max_new_tokens)
    drafter = DraftModelDrafter.like(load_model("draft.gguf"), target_runner, prefill="ring", sampling=SamplingParams())
    drafter.prefill(prompt_ids)                                   # the prompt into the draft's cache
    draft, q = drafter.propose(context, k, generator)             # int64 (d,); q float64 (d, V) or None

Where it runs (GenerationConfig.draft_cache):

- "sharded" (the default, DraftModelDrafter.like): on every rank of the generation, like the model
  itself: the draft model goes through its own treeattn.sharded_runner.ShardedRunner, over its own
  KV cache sharded exactly like the model's (the same capacity, block size, placement and ranks),
  with the same decode attention (tree_decode / ring_decode across the shards) and the same prefill
  (ring prefill splits the prompt p ways). Every rank makes the same calls; drafting k tokens is k
  one-token forward passes of the draft on every rank, and after each one rank 0 picks the token
  (argmax, or a draw from q with its generator) and broadcasts it, since every rank needs it for the
  next draft forward pass (one small broadcast per drafted token; picking on each rank would need
  bitwise-equal logits on every rank, which ring_decode's per-rank merge order does not give).
- "rank0" (DraftModelDrafter.whole): on rank 0 alone, over one whole cache with plain attention;
  treeattn.generate broadcasts its drafts to the other ranks.

Measured inside speculative decoding (docs/benchmarks.md, "Speculative decoding with a draft model";
SmolLM2 at 4K tokens, a 4-layer draft): with a core per rank (p = 2) both cost the same per drafted
token (0.95-1.07x) and the sharded prefill takes 0.55-0.57x the time; with two ranks per core (p = 4
on 2 cores) the sharded draft's collectives make it 1.40-1.55x slower per drafted token. Hence the
default "sharded", and "rank0" for ranks that share cores.

Proposals: greedily (temperature 0; the proposal is then one-hot, q = None), else each token drawn
from the draft's own sampling distribution q (the same temperature, top-k and top-p as the target's),
and q returned for the acceptance rule (treeattn.speculate.accept). The drafter remembers the token
ids its cache holds: each propose() first rolls its cache back to the longest prefix of them that the
new context shares (the accepted drafts; the rejected ones leave every rank's shard) and runs the rest,
so a rejection costs no more than the tokens that replace the rejected ones.
"""

from __future__ import annotations

import os

import torch

from treeattn.cache import ShardedKVCache
from treeattn.engine.config import ConfigError, SamplingParams
from treeattn.generate import sampling_probs
from treeattn.sharded_runner import ShardedRunner
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
    """A draft model proposing tokens, run on every rank over its own KV cache sharded like the model's.

    Args:
        runner: the draft model's ShardedRunner: its own cache, with the model's capacity, block
            size and placement over the same ranks, and the same decode attention and prefill.
        sampling: the model's sampling parameters; temperature 0: greedy proposals.

    Every rank makes the same calls with the same context and gets the same drafts; rank 0 picks each
    drafted token from its logits (argmax, or a draw from q with its generator) and broadcasts it
    before the next draft forward pass.
    """

    def __init__(self, runner: ShardedRunner, *, sampling: SamplingParams) -> None:
        self.runner, self.sampling = runner, sampling
        self.held = torch.zeros(0, dtype=torch.int64)  # the token ids whose keys/values the cache holds, in order

    @classmethod
    def like(cls, model, target: ShardedRunner, *, prefill: str, sampling: SamplingParams) -> "DraftModelDrafter":
        """draft_cache "sharded": the drafter of `model` with a cache laid out as `target`'s (capacity,
        block size, placement, rank, world size), the same decode attention and group, and `prefill`
        ("ring" or "local"). Every rank builds one."""
        layout = target.cache
        cache = _cache_for(model, capacity=layout.capacity, block_size=layout.block_size, placement=layout.placement.kind,
                           rank=layout.rank, world_size=layout.world_size)
        runner = ShardedRunner(model, cache, decode=target.decode, method=target.method, prefill=prefill, group=target.group,
                               topology=target.topology, chunk=target.chunk)
        return cls(runner, sampling=sampling)

    @classmethod
    def whole(cls, model, *, capacity: int, sampling: SamplingParams, chunk: int = 1024) -> "DraftModelDrafter":
        """draft_cache "rank0": the drafter of `model` on this process alone, over one whole cache of
        `capacity` tokens (plain attention, the prompt prefilled in chunks of `chunk`); its drafts go
        to the other ranks in one broadcast (treeattn.generate)."""
        cache = _cache_for(model, capacity=capacity, block_size=256, placement="contiguous", rank=0, world_size=1)
        return cls(ShardedRunner(model, cache, decode="local", method="allreduce", prefill="local", chunk=chunk), sampling=sampling)

    @property
    def cache(self) -> ShardedKVCache:
        return self.runner.cache

    def prefill(self, prompt: list[int]) -> None:
        """Run the prompt into the draft's (empty) cache; its logits come with the first propose()."""
        tokens = torch.tensor(prompt, dtype=torch.int64)
        self.runner.prefill(tokens[None].to(self.runner.model.device), torch.arange(len(prompt))[None].to(self.runner.model.device))
        self.held = tokens

    def propose(self, context: torch.Tensor, k: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft k tokens after `context` (a collective: every rank calls it with the same arguments).

        Args:
            context: int64 (L,) on the CPU, L >= 1: the prompt and every token generated so far.
            k: tokens to draft, >= 0 (0: nothing is run).
            generator: CPU torch.Generator of rank 0's draws (one uniform per drafted token) when
                sampling; unused for greedy proposals and on the other ranks.

        Returns:
            (draft, q): int64 (d,) with d <= k (fewer if the draft's logits turn non-finite), the same
            on every rank; and on rank 0 float64 (d, V), the distribution each token was drawn from
            (None when greedy, a one-hot proposal, and on the other ranks).
        """
        if k == 0:
            return context[:0].clone(), None
        self.rollback(context[:-1])  # the last token is always run: its logits propose the first draft
        hidden = self._run(context[self.cache.length:])
        tokens, rows = [], []
        for i in range(k):
            token, q = self._pick(hidden, generator)
            if token < 0:
                break
            tokens.append(token)
            if q is not None:
                rows.append(q)
            if i < k - 1:
                hidden = self._run(torch.tensor([token], dtype=torch.int64))
        draft = torch.tensor(tokens, dtype=torch.int64)
        return draft, torch.stack(rows) if rows else None

    def rollback(self, context: torch.Tensor) -> None:
        """Cut the cache back to the longest prefix of its tokens that `context` (int64 (n,)) starts
        with: rejected drafts' keys/values leave every rank's shard."""
        n = min(self.held.numel(), context.numel())
        differ = (self.held[:n] != context[:n]).nonzero()
        kept = int(differ[0]) if differ.numel() else n
        self.cache.truncate(kept)
        self.held = self.held[:kept]

    def _pick(self, hidden: torch.Tensor, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        """The next drafted token after final hidden state (hidden_size,): rank 0 picks it from the
        draft's logits and broadcasts it; -1 when they are not finite. Returns (token, q): q float64
        (V,) on rank 0 when sampling, else None."""
        message, q = torch.full((1,), -1, dtype=torch.int64), None
        if self.cache.rank == 0:
            logits = self.runner.model.logits(hidden[None]).float().cpu()  # (1, V)
            if bool(torch.isfinite(logits).all()):
                if self.sampling.temperature == 0:
                    message[0] = int(logits[0].argmax())
                else:
                    q = sampling_probs(logits, self.sampling)[0]
                    message[0] = draw(q, float(torch.rand(1, generator=generator, dtype=torch.float64)))
        token = int(self.runner.broadcast(message.to(hidden.device), src=0)[0])
        return token, q

    def _run(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run tokens int64 (n,), n >= 1, after the cached ones (one forward pass; its queries at their
        positions); returns the last one's final hidden state (hidden_size,)."""
        device = self.runner.model.device
        positions = torch.arange(self.cache.length, self.cache.length + tokens.numel())[None]
        hidden = self.runner.forward(tokens[None].to(device), positions.to(device))
        self.held = torch.cat([self.held, tokens])
        return hidden[0, -1]


def _cache_for(model, *, capacity: int, block_size: int, placement: str, rank: int, world_size: int) -> ShardedKVCache:
    """This rank's (empty) ShardedKVCache for `model`, in its dtype and on its device."""
    c = model.config
    return ShardedKVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, value_dim=c.cache_value_dim,
                          capacity=capacity, block_size=block_size, placement=placement, rank=rank, world_size=world_size,
                          dtype=model.dtype, device=model.device)
