"""treeattn.hf: transformers' own models decoding with the KV cache sharded across ranks.

Random-weight tiny configs of Llama, Qwen2 (sliding window on some layers), Qwen3 (q/k norms,
sliding window), Mistral (sliding window), Gemma 2 (logit softcap, alternating windows, scaled
queries) and Phi-3 (fused qkv, sliding window), saved with save_pretrained and loaded back on
every rank. Windows are shorter than the prompt, so they bite in prefill and decode; the Gemma 2
softcap is small enough to change the scores. Also Gemma 3 (text): alternating sliding/full layers
with a different RoPE base per kind, q/k norms.

Oracle: the model's UNCACHED greedy recomputation (a full forward over the whole sequence per new
token, with its own attention), never transformers' cached generate(). On p = 1 (one process,
no torch.distributed), p = 2 and p = 3 (real gloo groups: one spawn of 3 ranks runs every
architecture on all 3, then on the sub-group of the first 2): greedy tokens equal, the logits of every generated step and of the
sharded
prefill within 1e-4. At p = 3 the contiguous placement of 16 slots leaves the last rank no
prompt token in generate's prefill (it runs the placeholder token of ShardedCache.prefill).
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import treeattn as ta  # noqa: E402
import treeattn.hf as tahf  # noqa: E402
from treeattn.hf.compat import cache_keyword  # noqa: E402

PROMPT_LEN, NEW_TOKENS, VOCAB = 12, 4, 96
TOL = 1e-4
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None)  # no eos: every run generates NEW_TOKENS tokens
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "mistral": ("MistralConfig", dict(sliding_window=5)),
    "gemma2": ("Gemma2Config", dict(sliding_window=4, attn_logit_softcapping=0.5, final_logit_softcapping=3.0,
                                    query_pre_attn_scalar=6)),
    "phi3": ("Phi3Config", dict(sliding_window=6, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=4, query_pre_attn_scalar=6, sliding_window_pattern=2)),
}


def make_model(arch: str, seed: int = 0):
    config_class, extra = ARCHS[arch]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger weights than the init's 0.02 std: scores that matter, softcaps that bite
        for name, param in model.named_parameters():
            if name.endswith("proj.weight") or name.endswith("qkv_proj.weight"):
                param.normal_(0.0, 0.3)
    return model.eval()


def uncached_greedy(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full forward over the whole sequence for every new token, with transformers' eager attention
    (the plain math: transformers 5.17 ran Gemma 2 on SDPA by default, which drops its softcap).
    Returns the sequence (B, N + new) and the logits of each step (new, B, V)."""
    model.set_attn_implementation("eager")
    seq, step_logits = prompt, []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(seq, use_cache=False).logits[:, -1].float()
            step_logits.append(logits)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq, torch.stack(step_logits)


def prompt_ids(batch: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """arch -> (checkpoint dir, oracle sequence, oracle step logits)."""
    root = tmp_path_factory.mktemp("hf_models")
    saved = {}
    for arch in ARCHS:
        model = make_model(arch)
        model.save_pretrained(root / arch)
        seq, logits = uncached_greedy(model, prompt_ids(), NEW_TOKENS)
        saved[arch] = (str(root / arch), seq, logits)
    return saved


def run_arch(path: str, method: str, group=None) -> dict:
    """tahf.generate and a sharded prefill of one checkpoint on this rank: generated ids, step
    logits, and the max error of this rank's prefill logits against the full forward."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = prompt_ids()
    out = tahf.generate(model, prompt, max_new_tokens=NEW_TOKENS, method=method, return_dict_in_generate=True,
                        output_logits=True, group=group)
    model.set_attn_implementation("eager")
    full = model(prompt, use_cache=False).logits
    cache = tahf.ShardedCache(model, capacity=PROMPT_LEN, method=method, group=group)
    previous = model.config._attn_implementation
    model.set_attn_implementation(tahf.ATTN_IMPLEMENTATION)
    with torch.no_grad(), cache.prefill(prompt) as part:
        logits = model(input_ids=part.input_ids, position_ids=part.position_ids, **{cache_keyword(model): cache}).logits
    model.set_attn_implementation(previous)
    mine = 0 if part.placeholder else part.input_ids.shape[1]
    prefill_error = 0.0 if part.placeholder else (logits - full[:, part.position_ids[0]]).abs().max().item()
    return {"sequences": out.sequences, "logits": torch.stack(out.logits).float(), "prefill_error": prefill_error,
            "prefill_tokens": mine, "placeholder": part.placeholder}


SHARDED = {3: "tree", 2: "allreduce"}  # p -> method: the 3 ranks of one spawn, then the first 2 of them


def _group_cases(rank: int, paths: dict, method: str, group) -> dict:
    reports = {arch: run_arch(path, method, group) for arch, path in paths.items()}
    # ranks with different prompts: the same ValueError on every rank, no hang
    model = transformers.AutoModelForCausalLM.from_pretrained(paths["llama"]).eval()
    torch.manual_seed(rank)  # different RNG states: tahf.generate must seed every rank alike
    reports["sampled"] = tahf.generate(model, prompt_ids(), max_new_tokens=6, do_sample=True, top_k=20, method=method,
                                       group=group)
    try:
        tahf.generate(model, (prompt_ids() + rank) % VOCAB, max_new_tokens=2, method=method, group=group)
        reports["disagreement"] = "no error"
    except ValueError as exc:
        reports["disagreement"] = str(exc)
    return reports


def _rank_worker(rank: int, world_size: int, paths: dict) -> dict:
    """p -> this rank's reports, for each p of SHARDED this rank belongs to (one spawn: rank start-up dominates)."""
    import torch.distributed as dist

    groups = {2: dist.new_group([0, 1]), 3: dist.group.WORLD}  # every rank creates every group
    return {p: _group_cases(rank, paths, method, groups[p]) for p, method in SHARDED.items() if rank < p}


@functools.lru_cache(maxsize=None)
def _spawned(paths: tuple) -> list[dict]:
    return ta.spawn(_rank_worker, max(SHARDED), dict(paths), timeout=120.0)


def check_against_oracle(arch, report, seq, logits, where):
    assert torch.equal(report["sequences"], seq), f"{where} {arch}: {report['sequences'].tolist()} != oracle {seq.tolist()}"
    torch.testing.assert_close(report["logits"], logits, rtol=0, atol=TOL, msg=lambda m: f"{where} {arch} step logits: {m}")
    assert report["prefill_error"] < TOL, f"{where} {arch}: prefill logits off by {report['prefill_error']}"


def test_one_process_matches_uncached_greedy(saved_models):
    """p = 1 without torch.distributed: ops.attention over the whole cache."""
    for arch, (path, seq, logits) in saved_models.items():
        check_against_oracle(arch, run_arch(path, "allreduce"), seq, logits, "p=1")


@pytest.mark.parametrize("p,method", [(2, "allreduce"), (3, "tree")])
def test_sharded_matches_uncached_greedy(saved_models, p, method):
    paths = tuple((arch, entry[0]) for arch, entry in saved_models.items())
    assert SHARDED[p] == method
    reports = [by_p[p] for by_p in _spawned(paths)[:p]]
    for rank, by_arch in enumerate(reports):
        assert torch.equal(by_arch["sampled"], reports[0]["sampled"]), "sampling must agree across ranks"
        assert by_arch["disagreement"] == reports[0]["disagreement"], "every rank must raise the same error"
        assert "tahf.generate: every rank must pass the same input_ids" in by_arch["disagreement"], by_arch["disagreement"]
        for arch, (_, seq, logits) in saved_models.items():
            check_against_oracle(arch, by_arch[arch], seq, logits, f"p={p} rank {rank}")
    # the prompt was really split: every token of it prefilled on exactly one rank
    assert sum(r["llama"]["prefill_tokens"] for r in reports) == PROMPT_LEN
    assert all(r["llama"]["prefill_tokens"] < PROMPT_LEN for r in reports)


# ------------------------------------------------------------------------ bad input


def tiny_llama():
    config = transformers.LlamaConfig(**COMMON)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(
    "make,pattern",
    [
        (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4)),
         "BloomForCausalLM does not route its attention through transformers' AttentionInterface"),
        (lambda: transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1)),
         "MambaForCausalLM does not route its attention"),
        (lambda: transformers.LlamaModel(transformers.LlamaConfig(**COMMON)), "LlamaModel has no causal LM head"),
        (lambda: transformers.T5ForConditionalGeneration(
            transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4)),
         "T5ForConditionalGeneration is an encoder-decoder model"),
    ],
    ids=["bloom-alibi", "mamba-not-softmax", "no-lm-head", "encoder-decoder"],
)
def test_unsupported_models_name_their_class(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        tahf.generate(make().eval(), prompt_ids(), max_new_tokens=2)


def test_attention_with_arguments_it_does_not_implement_raises():
    """GPT-OSS passes attention sinks (s_aux): dropping them would be a silent wrong answer."""
    config = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=2, num_experts_per_tok=1,
                                       sliding_window=4)
    model = transformers.GptOssForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match=r"GptOssAttention passes \['s_aux'\]"):
        tahf.generate(model, prompt_ids(), max_new_tokens=2)
    assert model.config._attn_implementation != tahf.ATTN_IMPLEMENTATION, "the model's attention must be restored"


def test_left_padding_and_unsupported_options_are_rejected():
    model, prompt = tiny_llama(), prompt_ids(batch=2)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="attention_mask has zeros"):
        tahf.generate(model, prompt, max_new_tokens=2, attention_mask=mask)
    with pytest.raises(ValueError, match="num_beams=2"):
        tahf.generate(model, prompt, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tahf.generate(model, prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="placement"):
        tahf.generate(model, prompt, max_new_tokens=2, placement="striped")


def test_batch_without_padding_matches_uncached_greedy():
    model, prompt = tiny_llama(), prompt_ids(batch=2)
    out = tahf.generate(model, prompt, max_new_tokens=3)
    assert torch.equal(out, uncached_greedy(model, prompt, 3)[0])


def test_unsupported_transformers_version_is_named():
    with pytest.raises(ImportError, match="transformers >= 5.0.0, < 6.0.0 .* found transformers 4.57.1"):
        tahf.check_transformers_version("4.57.1")
    tahf.check_transformers_version()  # the installed one


def test_attention_outside_a_cache_block_raises():
    model = tiny_llama()
    model.set_attn_implementation(tahf.ATTN_IMPLEMENTATION)
    with pytest.raises(RuntimeError, match="LlamaAttention: attn_implementation='treeattn' runs only inside"):
        model(prompt_ids())


def test_cache_keyword_follows_the_models_forward():
    class Renamed(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return input_ids

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_keyword(Renamed()) == "cache" and cache_keyword(Older()) == "past_key_values"
