"""Generation end to end: greedy tokens identical to transformers' generate, on p = 1, 2, 3 gloo ranks,
tree (every method) and ring decoding, both placements; sampling identical for every p; batches;
errors before work, and a rank failing mid-generation ending every rank.

One spawn of 3 ranks runs all multi-rank cases: the ranks build sub-groups of 1 and 2 ranks, so
p = 1, 2, 3 share one process start.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from conftest import skip_unless_installed  # noqa: E402

skip_unless_installed("transformers")  # not imported: the ranks import this module too

from helpers.llama_checkpoints import ARCHS, VOCAB, make_checkpoint  # noqa: E402

from treeattn.engine.generate import NonFiniteLogitsError, generate, stream  # noqa: E402
from treeattn.engine.request import SamplingParams  # noqa: E402
from treeattn.engine.worker.sampling import sample  # noqa: E402
from treeattn.models import load_model  # noqa: E402
from treeattn.parallel import SpawnError, spawn  # noqa: E402

NEW_TOKENS = 32
PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(10)).tolist()
SHORT = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(11)).tolist()
SAMPLING = dict(temperature=0.9, top_k=40, top_p=0.9, seed=7)

# (decode, tree method, placement, prefill) per number of ranks; block_size 4 spreads 44 slots well.
CASES = {
    1: [("tree", "allreduce", "contiguous", "auto"), ("ring", "allreduce", "interleaved", "auto")],
    2: [("tree", "allreduce", "contiguous", "auto"), ("tree", "tree", "interleaved", "auto"),
        ("ring", "allreduce", "contiguous", "auto"), ("ring", "allreduce", "interleaved", "split")],
    3: [("tree", "allreduce", "interleaved", "auto"), ("tree", "twolevel", "contiguous", "auto"),
        ("tree", "tree", "contiguous", "split"), ("ring", "allreduce", "interleaved", "auto"),
        ("ring", "allreduce", "contiguous", "auto")],
}


def _hf_greedy(hf, prompt, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {arch: (root / arch, make_checkpoint(arch, root / arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(checkpoints):
    refs = {arch: _hf_greedy(hf, PROMPT) for arch, (_, hf) in checkpoints.items()}
    refs["llama-short"] = _hf_greedy(checkpoints["llama"][1], SHORT)
    with torch.no_grad():
        refs["llama-logits"] = checkpoints["llama"][1](torch.tensor([PROMPT])).logits[0]
    return refs


@pytest.fixture(scope="module")
def ranks(checkpoints):
    """Run every multi-rank case once: the list of the 3 ranks' result dicts."""
    dirs = {arch: str(directory) for arch, (directory, _) in checkpoints.items()}
    return spawn(_engine_cases, 3, dirs, timeout=300)


def _engine_cases(rank: int, world_size: int, dirs: dict) -> dict:
    torch.set_num_threads(1)
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    models = {arch: load_model(directory) for arch, directory in dirs.items()}
    out: dict = {}
    for p, cases in CASES.items():
        if rank >= p:
            continue
        group = groups[p]
        for arch, model in models.items():
            for decode, method, placement, prefill in cases:
                result = generate(model, PROMPT, max_new_tokens=NEW_TOKENS, decode=decode, method=method,
                                  placement=placement, prefill=prefill, block_size=4, group=group)
                out[(arch, p, decode, method, placement, result.prefill)] = result.generated_ids[0]
        for placement in ("contiguous", "interleaved"):
            result = generate(models["llama"], PROMPT, max_new_tokens=12, placement=placement, block_size=4, group=group,
                              **SAMPLING)
            out[("sampled", p, placement)] = result.generated_ids[0]
    # p = 3 only, on the world group
    llama = models["llama"]
    result = generate(llama, [PROMPT, SHORT], max_new_tokens=NEW_TOKENS, placement="interleaved", block_size=4)
    out["batch"] = result.generated_ids
    out["kv_bytes_per_rank"] = result.kv_bytes_per_rank
    out["comm_per_token"] = {decode: generate(llama, PROMPT, max_new_tokens=8, decode=decode).comm_bytes_per_token
                             for decode in ("tree", "ring")}
    out["ring_prefill_logits"] = {placement: _ring_prefill_logits(llama, rank,
                                                                  placement) for placement in ("contiguous", "interleaved")}
    for name, kwargs in {
        "mismatch": dict(max_new_tokens=4 + rank),
        "local-on-3": dict(decode="local"),
        "too-long": dict(max_context=10),
    }.items():
        try:
            generate(models[kwargs.pop("model", "llama")], PROMPT, **kwargs)
            out[name] = None
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
    # non-finite weights on every rank: every rank raises the same error, naming the layer
    broken = copy.deepcopy(llama)
    with torch.no_grad():
        broken.layers[1].input_layernorm.weight[3] = float("nan")
    try:
        generate(broken, PROMPT, max_new_tokens=4, placement="interleaved", block_size=4)
        out["nan"] = None
    except NonFiniteLogitsError as exc:
        out["nan"] = str(exc)
    return out


def _ring_attend(q, k, v, *, q_pos, kv_pos, window):
    """ring_attention as the model's attention (this rank's own queries, every rank's keys; no window here)."""
    from treeattn.parallel import ring_attention

    assert window is None or window >= len(PROMPT)
    return ring_attention(q, k, v, causal=True, q_pos=q_pos, kv_pos=kv_pos)[0]


def _ring_prefill_logits(model, rank, placement):
    """Ring-prefill PROMPT on the 3 ranks; return this rank's (token indices, logits)."""
    from treeattn.cache import ShardedKVCache

    cfg = model.config
    cache = ShardedKVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           capacity=len(PROMPT), placement=placement, block_size=2, rank=rank, world_size=3)
    ids, positions = torch.tensor([PROMPT]), torch.arange(len(PROMPT)).unsqueeze(0)
    slots = cache.extend(positions)
    mine = slots.owned
    with torch.inference_mode():
        hidden = model(ids[:, mine], positions[:, mine], cache.update(slots), _ring_attend)
        return mine, model.logits(hidden)[0]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tokens_match_transformers_on_every_p_placement_and_method(ranks, references, arch):
    results = {key: tokens for key, tokens in ranks[0].items() if isinstance(key, tuple) and key[0] == arch}
    assert len(results) == sum(len(c) for c in CASES.values())
    for key, tokens in results.items():
        assert tokens == references[arch], f"{key}: {tokens} != transformers {references[arch]}"
    # ring and tree, one rank or three: every rank holds the same tokens
    for other in ranks[1:]:
        for key, tokens in other.items():
            if isinstance(key, tuple) and key[0] == arch:
                assert tokens == references[arch], key


def test_prefill_kinds_were_both_exercised(ranks):
    prefills = {key[-1] for key in ranks[0] if isinstance(key, tuple) and key[0] in ARCHS}
    assert prefills == {"ring", "split"}


def test_ring_prefill_logits_match_transformers(ranks, references):
    for placement in ("contiguous", "interleaved"):
        logits = torch.empty_like(references["llama-logits"])
        seen = torch.zeros(len(PROMPT), dtype=torch.bool)
        for per_rank in ranks:
            index, part = per_rank["ring_prefill_logits"][placement]
            logits[index], seen[index] = part, True
        assert seen.all()
        torch.testing.assert_close(logits, references["llama-logits"], atol=1e-4, rtol=0)


def test_sampling_gives_the_same_tokens_for_every_p_and_placement(ranks, checkpoints):
    sampled = {key: tokens for key, tokens in ranks[0].items() if isinstance(key, tuple) and key[0] == "sampled"}
    assert len(sampled) == 6
    single = generate(load_model(checkpoints["llama"][0]), PROMPT, max_new_tokens=12, **SAMPLING).generated_ids[0]
    assert all(tokens == single for tokens in sampled.values()), sampled
    greedy = generate(load_model(checkpoints["llama"][0]), PROMPT, max_new_tokens=12).generated_ids[0]
    assert single != greedy  # the sampling really sampled


def test_batch_of_prompts_of_different_lengths(ranks, references):
    assert ranks[0]["batch"] == [references["llama"], references["llama-short"]]
    # the interleaved cache spreads the 44 slots of both sequences over the 3 ranks
    kv = ranks[0]["kv_bytes_per_rank"]
    assert len(kv) == 3 and max(kv) - min(kv) <= max(kv) // 2


def test_tree_decode_sends_fewer_bytes_than_ring_decode(ranks):
    comm = ranks[0]["comm_per_token"]
    assert 0 < comm["tree"] < comm["ring"]


def test_bad_arguments_fail_on_every_rank_before_any_work(ranks):
    for per_rank in ranks:
        assert "max_new_tokens" in per_rank["mismatch"] and "every rank must pass the same" in per_rank["mismatch"]
        assert "decode='local' runs on one rank, but nproc=3" in per_rank["local-on-3"]
        assert "prompt of 12 tokens + max_new_tokens=64 needs 76 positions, more than max_context=10" in per_rank["too-long"]


def test_non_finite_logits_stop_every_rank_and_name_the_layer(ranks):
    messages = {per_rank["nan"] for per_rank in ranks}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "non-finite logits (NaN or inf) for sequence(s) [0] at new token 0" in message
    assert "Non-finite weights: layers.1.input_layernorm.weight" in message


def _fail_mid_generation(rank: int, world_size: int, directory: str) -> None:
    model = load_model(directory)
    if rank == 1:  # rank 1's model raises in the forward pass of the 4th step
        forward, calls = model.layers[0].forward, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("rank 1 fails at step 4")
            return forward(*args, **kwargs)

        model.layers[0].forward = failing
    generate(model, PROMPT, max_new_tokens=NEW_TOKENS)


def test_a_rank_failing_mid_generation_ends_every_rank(checkpoints):
    with pytest.raises(SpawnError, match="rank 1 fails at step 4") as info:
        spawn(_fail_mid_generation, 2, str(checkpoints["llama"][0]), timeout=30)
    # rank 0 ends too (spawn ends a rank still running GRACE_S after the first failure): no hang
    assert set(info.value.failures) == {0, 1}


# ------------------------------------------------------------------------- single process


@pytest.fixture(scope="module")
def llama(checkpoints):
    return load_model(checkpoints["llama"][0])


def test_single_process_matches_transformers_and_streams(llama, references):
    steps = []
    result = generate(llama, PROMPT, max_new_tokens=NEW_TOKENS, on_token=steps.append)
    assert result.generated_ids[0] == references["llama"]
    assert [s.tokens[0] for s in steps] == references["llama"] and steps[-1].finished == [True]
    assert "".join(s.texts[0] for s in steps) == result.texts[0]  # the steps' texts are the result's, piece by piece
    assert result.decode_steps == NEW_TOKENS - 1 and result.finish_reasons == ["length"]
    run = stream(llama, PROMPT, max_new_tokens=5)
    assert [s.tokens[0] for s in run] == references["llama"][:5] and run.result.generated_ids[0] == references["llama"][:5]


def test_bfloat16_model_generates(checkpoints):
    model = load_model(checkpoints["qwen2"][0], dtype=torch.bfloat16)
    result = generate(model, [PROMPT, SHORT], max_new_tokens=6)
    assert [len(g) for g in result.generated_ids] == [6, 6]
    assert all(0 <= t < VOCAB for g in result.generated_ids for t in g)


def test_stop_token_ids_end_a_sequence(llama, references):
    stop = references["llama"][6]
    first = references["llama"].index(stop)
    result = generate(llama, PROMPT, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop], ignore_eos=True)
    assert result.generated_ids[0] == references["llama"][: first + 1] and result.finish_reasons == ["stop"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_weights_raise_instead_of_giving_tokens(llama, temperature):
    broken = copy.deepcopy(llama)
    with torch.no_grad():
        broken.layers[0].self_attn.k_proj.weight[0, 0] = float("nan")
    tokens = []
    with pytest.raises(NonFiniteLogitsError, match=r"non-finite logits .* at new token 0.*"
                                                     r"Non-finite weights: layers.0.self_attn.k_proj.weight"):
        generate(broken, PROMPT, max_new_tokens=4, temperature=temperature, on_token=tokens.append)
    assert tokens == []  # nothing non-finite became a token


def test_non_finite_final_norm_is_named(llama):
    broken = copy.deepcopy(llama)
    with torch.no_grad():
        broken.norm.weight[0] = float("inf")
        broken.norm.weight[1] = float("-inf")
    with pytest.raises(NonFiniteLogitsError, match="Non-finite weights: norm.weight"):
        generate(broken, [PROMPT, SHORT], max_new_tokens=2)


def test_logits_going_non_finite_mid_decode_stop_at_that_token(llama, references):
    """The 4th logits computed (the prefill's, then three decode steps') hold a NaN. Counted in the
    model's own call, not set from on_token: the driver may run a step ahead of the callbacks."""
    broken = copy.deepcopy(llama)
    calls, seen = [], []
    finite = broken.logits

    def logits(hidden):
        calls.append(None)
        out = finite(hidden)
        if len(calls) == 4:
            out[..., references["llama"][5]] = float("nan")
        return out

    broken.logits = logits
    with pytest.raises(NonFiniteLogitsError, match="at new token 3"):
        generate(broken, PROMPT, max_new_tokens=8, on_token=lambda step: seen.append(step.tokens[0]))
    assert seen == references["llama"][:3]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(prompts=[]), ValueError, "prompts must be a non-empty list"),
        (dict(prompts=[[1, 2], []]), ValueError, "prompt 1 must be a non-empty list"),
        (dict(prompts=[1, VOCAB]), ValueError, rf"prompt 0: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
        (dict(prompts=[1.0, 2.0]), ValueError, "prompt 0 must be a non-empty list"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
        (dict(temperature=-1.0), ValueError, "temperature must be a finite number >= 0"),
        (dict(temperature=float("inf")), ValueError, "temperature must be a finite number >= 0.*got inf"),
        (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0.*got nan"),
        (dict(stop_token_ids=[2.7]), ValueError, r"stop_token_ids must be a sequence of ints >= 0, got \[2.7\]"),
        (dict(stop_token_ids=[-1]), ValueError, r"stop_token_ids must be a sequence of ints >= 0, got \[-1\]"),
        (dict(stop_token_ids=[VOCAB]), ValueError, f"stop_token_ids: token id {VOCAB} is outside the vocabulary"),
        (dict(stop_token_ids="2"), ValueError, "stop_token_ids must be a sequence of ints >= 0, got '2'"),
        (dict(stop_tokens=[2]), TypeError, "stop_tokens is no longer an option of generate\\(\\): use stop_token_ids"),
        (dict(max_context=10**12), ValueError,
         r"^max_context: 1 rank\(s\) x .* of KV cache\) = .* more than the .* of memory of this machine"),
        (dict(max_new_tokens=10**12), ValueError, r"^max_new_tokens: 1 rank\(s\) x .* more than the"),
        (dict(prompts=[PROMPT, SHORT], num_samples=2), ValueError,
         "num_samples=2 samples completions of one prompt, got 2 prompts"),
        (dict(top_p=0.0), ValueError, r"top_p must be a number in \(0, 1\]"),
        (dict(top_k=-1), ValueError, r"top_k must be an int >= 0 \(0 = all tokens\)"),
        (dict(decode="flash"), ValueError, r"decode must be one of \('local', 'tree', 'ring'\)"),
        (dict(method="star"), ValueError, "method must be one of"),
        (dict(placement="striped"), ValueError, "placement must be one of"),
        (dict(prefill="tree"), ValueError, "prefill must be one of"),
        (dict(max_context=20), ValueError,
         "prompt of 12 tokens \\+ max_new_tokens=32 needs 44 positions, more than max_context=20"),
    ],
)
def test_bad_arguments_are_named(llama, kwargs, error, match):
    args = dict(prompts=PROMPT, max_new_tokens=NEW_TOKENS) | kwargs
    with pytest.raises(error, match=match):
        generate(llama, args.pop("prompts"), **args)


# ----------------------------------------------------------------------------------- sampling


def test_greedy_is_argmax_and_takes_no_draw():
    logits = torch.randn(5, 50)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, SamplingParams(), generator), logits.argmax(-1))
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(0).get_state())


def test_top_k_and_top_p_restrict_the_support_and_keep_the_proportions():
    probs = torch.tensor([0.45, 0.3, 0.15, 0.1])
    logits = probs.log().expand(20000, 4)
    generator = torch.Generator().manual_seed(1)
    counts = torch.bincount(sample(logits, SamplingParams(temperature=1.0, top_k=2), generator), minlength=4).float() / 20000
    assert counts[2:].sum() == 0
    torch.testing.assert_close(counts[:2], torch.tensor([0.6, 0.4]), atol=0.02, rtol=0)
    counts = torch.bincount(sample(logits, SamplingParams(temperature=1.0, top_p=0.7), generator), minlength=4).float() / 20000
    assert counts[2:].sum() == 0  # 0.45 + 0.3 reaches 0.7: the rest is cut
    counts = torch.bincount(sample(logits, SamplingParams(temperature=1.0, top_p=0.8), generator), minlength=4).float() / 20000
    assert counts[3] == 0 and counts[2] > 0
    counts = torch.bincount(sample(logits, SamplingParams(temperature=1.0), generator), minlength=4).float() / 20000
    torch.testing.assert_close(counts, probs, atol=0.02, rtol=0)


def test_same_seed_same_draws():
    logits = torch.randn(3, 100)
    draws = [sample(logits, SamplingParams(temperature=0.7, top_p=0.95), torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert torch.equal(draws[0], draws[1])
    many = [sample(logits, SamplingParams(temperature=5.0), torch.Generator().manual_seed(s)) for s in range(8)]
    assert len({tuple(d.tolist()) for d in many}) > 1
