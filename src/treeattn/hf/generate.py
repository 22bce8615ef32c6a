"""tahf.generate: transformers' generate() with the KV cache sharded across ranks.

On every rank of the group, with the same model and input_ids:

1. The ranks agree first (one small all-gather): batch, prompt (a digest), max_new_tokens,
   sampling, placement, method, model (a digest of its config). Ranks that disagree all raise
   the same ValueError instead of hanging.
2. Sharded prefill of all prompt tokens but the last: each rank runs only the tokens the placement
   gives it, with their absolute position ids; attention is ring_attention across the ranks.
3. model.generate(input_ids, cache=cache, ...) (past_key_values= before transformers renamed it): transformers runs the last
   prompt token
   and every new token on every rank; each layer's attention is tree_decode over the shards, so
   every rank computes the same logits and picks the same tokens. Logits processors, stopping
   criteria, return_dict_in_generate, eos handling are transformers' own.
4. A digest of the generated ids is compared across ranks; a mismatch raises (never silently
   different outputs).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from treeattn.cache.placement import PLACEMENTS
from treeattn.hf.attention import ATTN_IMPLEMENTATION
from treeattn.hf.cache import ShardedCache
from treeattn.hf.compat import cache_keyword, check_model
from treeattn.parallel import comm
from treeattn.parallel.metadata import UNKNOWN, gather_metadata, metadata_device
from treeattn.parallel.tree_decode import METHODS

# generate() options that need a cache other than one sharded sequence per batch row.
UNSUPPORTED_OPTIONS = {
    "num_beams": 1, "num_return_sequences": 1, "assistant_model": None, "prompt_lookup_num_tokens": None,
    "past_key_values": None, "cache": None, "cache_implementation": None,
}


def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    group: dist.ProcessGroup | None = None,
    placement: str = "contiguous",
    method: str | None = None,
    **generate_kwargs,
):
    """Generate with `model` (a transformers causal LM) on every rank of `group`, the KV cache
    sharded across the ranks (prefill: ring_attention; decode: tree_decode).

    Args:
        model: the same transformers causal LM on every rank (e.g. AutoModelForCausalLM.from_pretrained),
            in eval mode. Its attention implementation is set to "treeattn" for the call and
            restored afterwards.
        input_ids: int64 (B, N), N >= 1, the same on every rank; the B prompts have the same length
            (no padding: an attention_mask with zeros is rejected).
        max_new_tokens: tokens to generate per sequence (transformers may stop earlier at eos).
        do_sample: sample instead of greedy. Every rank's torch RNG is then seeded with a seed
            drawn on rank 0, so all ranks draw the same tokens.
        group: process group (None: the default world group, or one process if torch.distributed
            is not initialized).
        placement: "contiguous" or "interleaved": which rank holds which token.
        method: tree_decode's combine, "allreduce" (default), "tree" or "twolevel".
        **generate_kwargs: passed to model.generate (temperature, top_k, eos_token_id,
            return_dict_in_generate, output_scores, ...). Beam search, several sequences per
            prompt, assisted decoding and a caller's cache are rejected.

    Returns:
        What model.generate returns (a (B, N + new) tensor, or a GenerateOutput), identical on
        every rank.

    Raises:
        ValueError: an unsupported model (naming its class), option or input, or ranks that
            disagree. RuntimeError: ranks that generated different tokens.
    """
    method = "allreduce" if method is None else method
    local_error = None
    try:
        _check_arguments(model, input_ids, max_new_tokens, do_sample, placement, method, generate_kwargs)
    except (ValueError, TypeError) as exc:
        local_error = exc
    _agree(model, input_ids, max_new_tokens, do_sample, placement, method, group, local_error)

    B, N = input_ids.shape
    cache = ShardedCache(model, capacity=N + max_new_tokens, batch_size=B, group=group, placement=placement, method=method)
    if do_sample:
        _share_seed(group)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"{type(model).__name__} did not accept attn_implementation={ATTN_IMPLEMENTATION!r}")
    given_cache = {cache_keyword(model): cache}
    try:
        with torch.no_grad():
            if N > 1:  # the last prompt token runs as generate()'s first step, on every rank
                with cache.prefill(input_ids[:, :-1]) as part:
                    model(input_ids=part.input_ids, position_ids=part.position_ids, use_cache=True, logits_to_keep=1,
                          **given_cache)
            with cache.decode():
                output = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=do_sample, **given_cache,
                                        **generate_kwargs)
    finally:
        model.set_attn_implementation(previous)
    _check_identical(output, group)
    return output


def _check_arguments(model, input_ids, max_new_tokens, do_sample, placement, method, options) -> None:
    check_model(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be an int64 tensor (B, N) with N >= 1, got {shape}")
    if input_ids.dtype != torch.int64:
        raise TypeError(f"input_ids must be int64, got {input_ids.dtype}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {type(do_sample).__name__}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
    if model.training:
        raise ValueError(f"{type(model).__name__} is in training mode; call model.eval() first")
    for name, default in UNSUPPORTED_OPTIONS.items():
        if options.get(name, default) != default:
            raise ValueError(f"tahf.generate does not support {name}={options[name]!r} (one sharded sequence per batch row)")
    mask = options.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise ValueError(
            "attention_mask has zeros (padding): tahf.generate takes prompts of one length without padding; "
            "run prompts of different lengths as separate calls"
        )


def _agree(model, input_ids, max_new_tokens, do_sample, placement, method, group, local_error) -> None:
    """Every rank must call with the same model and arguments: compared in one all-gather."""
    fields = {"B (input_ids.shape[0])": UNKNOWN, "N (input_ids.shape[1])": UNKNOWN, "input_ids": UNKNOWN,
              "max_new_tokens": UNKNOWN, "do_sample": UNKNOWN, "placement": UNKNOWN, "method": UNKNOWN, "model": UNKNOWN}
    if local_error is None:
        fields.update({
            "B (input_ids.shape[0])": input_ids.shape[0], "N (input_ids.shape[1])": input_ids.shape[1],
            "input_ids": _digest(input_ids.cpu().numpy().tobytes()), "max_new_tokens": max_new_tokens,
            "do_sample": int(do_sample), "placement": PLACEMENTS.index(placement), "method": METHODS.index(method),
            "model": _digest(model.config.to_json_string(use_diff=False).encode()),
        })
    if _world_size(group) > 1:
        gather_metadata("tahf.generate", fields, group, must_match=tuple(fields), local_error=local_error)
    elif local_error is not None:
        raise local_error


def _share_seed(group) -> None:
    """Seed every rank's torch RNG with one seed drawn on rank 0 (sampling must agree)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if _world_size(group) > 1:
        seed = comm.broadcast(seed.to(metadata_device(group)), 0, group).cpu()
    torch.manual_seed(int(seed))


def _check_identical(output, group) -> None:
    """Raise on every rank if the ranks' generated ids differ."""
    if _world_size(group) == 1:
        return
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    fields = {"generated ids": _digest(sequences.cpu().numpy().tobytes())}
    try:
        gather_metadata("tahf.generate", fields, group, must_match=("generated ids",), local_error=None)
    except ValueError as exc:
        raise RuntimeError(f"ranks generated different tokens ({exc})") from None


def _world_size(group) -> int:
    """Ranks in `group`; 1 without torch.distributed."""
    distributed = group is not None or (dist.is_available() and dist.is_initialized())
    return comm.group_size(group) if distributed else 1


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
