"""Gemma 3 (text) in treeattn's own models, against transformers' Gemma3ForCausalLM.

Tiny checkpoints the tests write themselves (tests/gemma3_files.py): a Hugging Face directory of
model_type gemma3_text, one of gemma3 (image-text, the text model inside), and a gemma3 GGUF with
the real file's tensor types (Q4_K, Q5_0, Q6_K, Q8_0, F32) and a Gemma SentencePiece vocabulary.
The prompts are longer than the window (4), so window and global layers both matter. float32
throughout: logits agree to float32 rounding (1e-4 on logits of size ~1-10 is ~100x that).

The engine runs Gemma 3 with the hybrid KV cache (treeattn.cache.window): the global layer's keys
and values sharded in the paged cache, the window layers' last W - 1 positions per sequence on
every rank; its greedy tokens must equal transformers' uncached recomputation in every mode.
"""

from __future__ import annotations

import json
import re

import gguf
import pytest
import torch

from conftest import skip_unless_installed  # noqa: E402

skip_unless_installed("transformers")  # not imported: the ranks import this module too

from gemma3_files import TOKENS, VOCAB, WINDOW, hf_gemma3, write_gemma3_gguf  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.cli import app  # noqa: E402
from treeattn.engine import SamplingParams  # noqa: E402
from treeattn.models import load_model, load_tokenizer, read_config  # noqa: E402
from treeattn.models.gemma3 import Gemma3Config, Gemma3Model  # noqa: E402
from treeattn.parallel import spawn  # noqa: E402
from treeattn.cache.window import SPARE_ROWS  # noqa: E402
from gemma3_files import ours_logits  # noqa: E402

PROMPT = [2, 280, 290, 295, 300, 270, 281, 285, 290, 291, 299, 270, 275, 276, 283, 284, 292, 288, 273, 296, 301]
TOL = 1e-4


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    text = hf_gemma3(context=512)  # room for a follow-up of 130 tokens after the 157 of the longest prompt's sequence
    text.save_pretrained(root / "text")
    hf_gemma3(multimodal=True).save_pretrained(root / "multimodal")
    write_gemma3_gguf(root / "tiny.gguf", text)
    return dict(root=root, text=text)


def test_hf_text_directory_matches_transformers(files):
    model = load_model(files["root"] / "text")
    assert isinstance(model, Gemma3Model) and isinstance(model.config, Gemma3Config)
    c = model.config
    assert c.layer_windows == (WINDOW,) * 5 + (None,) and c.rope_theta == 1e6 and c.rope_local_theta == 1e4
    assert c.query_pre_attn_scalar == 256 and c.tie_word_embeddings
    torch.testing.assert_close(ours_logits(model, PROMPT), hf_logits(files["text"], PROMPT), atol=TOL, rtol=0)


def test_hf_multimodal_directory_loads_its_text_model(files):
    raw = json.loads((files["root"] / "multimodal" / "config.json").read_text())
    assert raw["model_type"] == "gemma3" and "text_config" in raw
    model = load_model(files["root"] / "multimodal")
    torch.testing.assert_close(ours_logits(model, PROMPT), hf_logits(files["text"], PROMPT), atol=TOL, rtol=0)


def test_hf_config_transformers4_spelling_and_refusals(files, tmp_path):
    from treeattn.models.loader import config_from_dict

    raw = dict(architectures=["Gemma3ForCausalLM"], hidden_size=64, intermediate_size=256, num_hidden_layers=12,
               num_attention_heads=2, num_key_value_heads=1, head_dim=128, vocab_size=VOCAB, rope_theta=1e6,
               rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512,
               sliding_window_pattern=6)
    c = config_from_dict(raw)
    assert c.layer_windows == ((512,) * 5 + (None,)) * 2 and c.rope_type == "linear" and c.rope_scaling == {"factor": 8.0}
    assert c.rope_local_theta == 1e4 and c.query_pre_attn_scalar == 256  # transformers' default
    with pytest.raises(ValueError, match=r"config.json: attn_logit_softcapping=50.0 is not supported"):
        config_from_dict({**raw, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match=r"text_config"):
        config_from_dict({"architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(ValueError, match=r"'layer_types' must list 12"):
        config_from_dict({**raw, "layer_types": ["full_attention"]})


def test_gguf_matches_transformers_loading_the_same_file(files):
    path = files["root"] / "tiny.gguf"
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    model = load_model(path)
    assert isinstance(model, Gemma3Model)
    c = read_config(path)
    assert c.layer_windows == (WINDOW,) * 5 + (None,) and c.rope_local_theta == 1e4 and c.bos_token_id == 2
    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(files["root"], gguf_file="tiny.gguf", dtype=torch.float32).eval()
    torch.testing.assert_close(ours_logits(model, PROMPT), hf_logits(theirs, PROMPT), atol=TOL, rtol=0)
    # The Q5_0 / Q8_0 matrices hold the HF model's weights (up to quantization); the norms its weights exactly.
    ref = files["text"].model.layers[0]
    torch.testing.assert_close(model.layers[0].input_layernorm.weight, ref.input_layernorm.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(model.layers[0].self_attn.q_proj.weight, ref.self_attn.q_proj.weight, atol=0.02, rtol=0)


def test_gguf_tokenizer_is_gemmas(files):
    """SentencePiece with byte fallback, no prefix space, space runs respelled, BOS as the metadata
    says: the same ids as transformers' tokenizer built from the same file."""
    path = files["root"] / "tiny.gguf"
    ours = load_tokenizer(path)
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(files["root"], gguf_file="tiny.gguf")
    for text in ["the cat", " the world", "the  cat   sat\n\nblue sky", "<start_of_turn>user\nhi<end_of_turn>", "ünï 🎉 x"]:
        ids = ours.encode(text).ids
        assert ids == theirs(text).input_ids, text
        assert ids[0] == 2 and ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("the cat").ids == [2] + [TOKENS.index(p) for p in ("t", "he", "▁cat")]  # BOS once, no prefix space


def test_chat_is_refused_in_one_line_without_a_template(files):
    result = CliRunner().invoke(app, ["generate", str(files["root"] / "tiny.gguf"), "--chat", "--prompt", "hi"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert re.search(r"--chat: .*tiny\.gguf has no chat template", result.stderr), result.stderr


@pytest.mark.parametrize("option, value", [("decode_step", "static")])
def test_what_a_hybrid_cache_cannot_run_is_refused_before_any_rank_starts(files, option, value):
    import multiprocessing

    from treeattn.engine.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{option}=.*hybrid KV cache") as refused:
        ta.Engine(str(files["root"] / "tiny.gguf"), nproc=2, **{option: value})
    assert refused.value.option == option and "\n" not in str(refused.value)
    assert not multiprocessing.active_children()


def test_rms_norm_is_x_over_rms_times_one_plus_weight_and_follows_its_weight():
    """Gemma3RMSNorm in float32 takes the row-wise kernel with weight_offset=1 (1 + w): within float32
    rounding of the float64 formula, also after the weight is written in place (nothing cached), and for
    a norm made under inference_mode; bfloat16 keeps the torch path (the product in float32, cast at the end)."""
    from treeattn.models.gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(64, 1e-6)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for step in range(2):
            norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(step + 1)))
            x64 = x.double()
            expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.double())
            assert torch.allclose(norm(x).double(), expected, rtol=1e-6, atol=1e-6), step
        low = norm(x.bfloat16())
        assert low.dtype == torch.bfloat16 and torch.allclose(low.double(), expected, rtol=2e-2, atol=2e-2)
        made_here = Gemma3RMSNorm(64, 1e-6)  # inference tensors: no version counter to read
        made_here.weight.copy_(norm.weight)
        assert torch.equal(made_here(x), norm(x))


# ------------------------------------------------- the hybrid KV cache: window layers keep their window

def test_window_cache_keeps_the_window_and_rolls_back_over_drafts():
    from treeattn.cache.window import WindowKVCache, hybrid_windows, paged_layers

    assert hybrid_windows((4, None, 4)) == {0: 4, 2: 4} and paged_layers((4, None, 4)) == [1]
    assert hybrid_windows((4, 4)) == {} and paged_layers((4, 4)) == [0, 1]  # all windowed: the paged cache keeps all
    cache = WindowKVCache({0: 4}, num_kv_heads=1, head_dim=2)
    rows = torch.arange(60, dtype=torch.float32)[:, None, None].expand(60, 1, 2)  # row i holds position i's value i

    def step(start, n):
        """The rows returned hold every position the new queries' windows see once, with its values;
        any other row is one they cannot see (before the window, or after the queries)."""
        k, v, pos = cache.extend(0, 7, start, rows[start : start + n], rows[start : start + n] + 100)
        seen = (pos >= max(0, start - 3)) & (pos < start + n)
        assert sorted(pos[seen].tolist()) == list(range(max(0, start - 3), start + n))
        assert torch.equal(k[seen, 0, 0], pos[seen].float()) and torch.equal(v[seen, 0, 0], pos[seen].float() + 100)
        return pos

    step(0, 6)  # a short prompt
    assert cache.nbytes() == (3 + SPARE_ROWS) * 2 * 2 * 4  # a ring of W - 1 + SPARE_ROWS rows of keys and values
    step(6, 3)  # a token and two drafts
    assert sorted(p for p in step(7, 2).tolist() if p < 1 << 62) == list(range(9))  # drafts rejected: 7 again, in place
    step(9, 1)
    pos = step(10, 30)  # a prompt chunk longer than the spare rows: kept rows then the new ones, in order
    assert pos.tolist() == list(range(7, 40))
    step(40, 1)  # the chunk's last W - 1 positions were kept
    with pytest.raises(RuntimeError,
                       match=r"sequence 7 starts at position 20 .* needs positions \[17, 20\) kept, but holds \[22, 41\)"):
        step(20, 1)
    step(0, 2)  # position 0: the sequence starts afresh (preempted and recomputed)
    cache.release(7)
    assert cache.nbytes() == 0
    with pytest.raises(RuntimeError, match="holds nothing"):
        step(5, 1)


def test_window_checkpoints_save_restore_and_drop():
    """A checkpoint holds the window of every window layer at a boundary; a sequence restored from
    it sees exactly those positions; the prefix tree matches only up to a checkpointed node and
    lists what it drops (least recently used over the limit, or evicted with its node)."""
    from treeattn.cache.blocks import ShardedBlockPool
    from treeattn.cache.prefix import PrefixCache
    from treeattn.cache.window import WindowKVCache

    cache = WindowKVCache({0: 4, 2: 6}, num_kv_heads=1, head_dim=2)
    rows = torch.arange(40, dtype=torch.float32)[:, None, None].expand(40, 1, 2)
    for layer in (0, 2):
        cache.extend(layer, 1, 0, rows[:30], rows[:30] + 100)  # a 30-token prompt chunk
    cache.save(1, 28, checkpoint=5)  # 2 positions behind the sequence's end: still in its rings
    with pytest.raises(RuntimeError, match=r"checkpoint 6 of sequence 1 at position 8 needs positions \[5, 8\) of layer 0"):
        cache.save(1, 8, checkpoint=6)  # overwritten long ago: refused, never saved wrong
    cache.release(1)
    cache.restore(2, 5)
    for layer, window in ((0, 4), (2, 6)):
        k, v, pos = cache.extend(layer, 2, 28, rows[28:29], rows[28:29] + 100)
        seen = (pos > 28 - window) & (pos <= 28)
        assert sorted(pos[seen].tolist()) == list(range(29 - window, 29))
        assert torch.equal(k[seen, 0, 0], pos[seen].float()) and torch.equal(v[seen, 0, 0], pos[seen].float() + 100)
    with pytest.raises(KeyError, match="no checkpoint 6"):
        cache.restore(3, 6)
    cache.drop(5)
    assert cache.checkpoints == 0

    pool = ShardedBlockPool(world_size=2, blocks_per_rank=8, block_size=2, placement="interleaved")
    tree = PrefixCache(pool, checkpoints=2)
    tokens = list(range(10))
    blocks = [pool.allocate(j) for j in range(5)]
    tree.insert(tokens, blocks)
    assert tree.match(tokens) == [] and tree.match_checkpointed(tokens) == ([], None)  # no checkpoint: no hit
    first, second = tree.add_checkpoint(tokens, 2), tree.add_checkpoint(tokens, 4)
    assert tree.add_checkpoint(tokens, 4) is None and tree.add_checkpoint([7, 7, 7, 7], 2) is None  # has one / not cached
    assert tree.match_checkpointed(tokens) == (blocks[:4], second)
    assert tree.match_checkpointed(tokens[:7]) == (blocks[:2], first)  # the deepest checkpoint of the matched path
    third = tree.add_checkpoint(tokens, 5)  # over the limit: the least recently matched (second) goes
    assert tree.take_dropped() == (second,) and tree.take_dropped() == ()
    assert tree.match_checkpointed(tokens[:9]) == (blocks[:2], first)
    assert tree.match_checkpointed(tokens) == (blocks, third)
    for block in blocks:
        pool.decref(block)
    tree.clear()  # evicted with their nodes
    assert sorted(tree.take_dropped()) == sorted((first, third)) and tree.num_checkpoints == 0
    with pytest.raises(ValueError, match="checkpoints must be None or an int >= 1, got 0"):
        PrefixCache(pool, checkpoints=0)


PROMPTS = [PROMPT, PROMPT[:9] + [277, 279, 286], [2] + [280, 290, 295, 300, 301, 270] * 25]  # the last: 151 tokens
NEW = 6
FOLLOW_UP = [277, 279] + [270 + 7 * i % 32 for i in range(128)]  # 130 new tokens: a token-parallel or ring step


def _greedy_uncached(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, recomputing the whole sequence at every step (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


CASES = [(1, dict(decode="local")),
         (2, dict(decode="tree", prefill_chunk=256)),  # the 151-token prompt: one token-parallel step
         (2, dict(decode="ring", placement="interleaved", speculate="ngram", draft_tokens=3)),
         (2, dict(decode="tree", max_batch_size=1, prefill="ring"))]  # one sequence at a time, ring prefill steps


def _engine_runs(rank: int, world_size: int, path: str) -> tuple:
    """Every case's tokens, requests submitted at once (continuous batching), and rank 0's engine
    stats and each rank's KV bytes; then decode_methods' engine on both ranks (one prefill per
    prompt, set_decode per method: treeattn.eval.runner.shared_prefill_rows)."""
    from treeattn.engine import EngineConfig
    from treeattn.eval.runner import shared_prefill_rows

    torch.set_num_threads(1)
    import torch.distributed as dist

    model = load_model(path)
    groups = {1: dist.new_group([0]), 2: None}
    out = []
    for p, options in CASES:
        if rank >= p:
            continue
        options = dict(dict(cache_tokens=512, block_size=4, prefill_chunk=8), **options)
        with ta.Engine(model, group=groups[p], timeout_s=60, **options) as engine:
            if engine.is_driver:
                handles = [engine.submit(prompt, SamplingParams(max_new_tokens=NEW)) for prompt in PROMPTS]
                tokens = [h.result(timeout=120).token_ids for h in handles]
                stats = engine.stats()
                # the conversation goes on: its 156 computed tokens start from the window checkpoint of its end
                follow_up = engine.submit(PROMPTS[2] + tokens[2] + FOLLOW_UP, SamplingParams(max_new_tokens=NEW))
                tokens.append(follow_up.result(timeout=120).token_ids)
                hit = engine.stats()["prefix_hit_tokens"] - stats["prefix_hit_tokens"]
                out.append((p, options, tokens, stats, [m.kv_bytes for m in engine.rank_measurements()], hit))
    return out, shared_prefill_rows(model, [PROMPTS[2], PROMPT], METHODS, EngineConfig(block_size=16),
                                    SamplingParams(max_new_tokens=NEW))


METHODS = (("tree", "onepass"), ("ring", "allreduce"), ("tree", "allreduce"))


@pytest.fixture(scope="module")
def ranks_ran(files):
    return spawn(_engine_runs, 2, str(files["root"] / "text"), timeout=300)[0]


@pytest.fixture(scope="module")
def engine_runs(ranks_ran):
    return ranks_ran[0]


def test_engine_tokens_equal_transformers_uncached_greedy(files, engine_runs):
    """Local, tree and ring decoding, a token-parallel prefill step, speculative decoding and
    sequences queued behind a full batch: the same greedy tokens as transformers' recomputation."""
    refs = [_greedy_uncached(files["text"], prompt, NEW) for prompt in PROMPTS]
    refs.append(_greedy_uncached(files["text"], PROMPTS[2] + refs[2] + FOLLOW_UP, NEW))
    assert [(p, o) for p, o, *_ in engine_runs] == [(p, dict(dict(cache_tokens=512, block_size=4, prefill_chunk=8), **o))
                                                    for p, o in CASES]
    for p, options, tokens, stats, _, follow_up_hit in engine_runs:
        assert tokens == refs, (p, options)
        # the prefix cache starts the follow-up from a window checkpoint: 151 + 5 computed tokens, 39 blocks of 4
        assert follow_up_hit == 156, (p, options)


def test_engine_keeps_only_the_global_layers_paged(files, engine_runs):
    """The paged arena holds the one global layer of six; the window layers a ring of W - 1 +
    SPARE_ROWS positions per sequence, whatever its length, and the prefix cache's window
    checkpoints W - 1 positions each, at most max_batch_size of them."""
    per_slot = 1 * 2 * 1 * 256 * 4  # one layer, keys and values, 1 KV head of 256, float32
    for p, options, _, stats, kv_bytes, _ in engine_runs:
        arena = (stats["blocks_total"] // p + 1) * 4 * per_slot  # blocks of every rank + the pad block
        windows = (len(PROMPTS) + 1) * 5 * (WINDOW - 1 + SPARE_ROWS) * per_slot  # a ring per sequence and window layer
        checkpoints = options.get("max_batch_size", 16) * 5 * (WINDOW - 1) * per_slot
        assert all(arena <= b <= arena + windows + checkpoints for b in kv_bytes), (p, options, kv_bytes, arena)


def test_generate_json_reports_global_and_window_bytes(files, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(PROMPT))
    result = CliRunner().invoke(app, ["generate", str(files["root"] / "tiny.gguf"), "--prompt-ids", str(ids), "--max-new-tokens",
                                      "3",
                                      "--no-stop", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["kv_bytes_per_token"] == 1 * 2 * 256 * 4  # the global layer only
    assert report["kv_window_bytes"] == 5 * (WINDOW - 1 + SPARE_ROWS) * 2 * 256 * 4  # five window layers, a ring each


def test_demo_long_on_a_base_model_prints_kv_memory_against_a_full_cache(files):
    """`treeattn demo --long` path on the tiny Gemma GGUF (no chat template: a plain-text prompt),
    tree and ring on 2 ranks giving the same tokens, and the KV memory lines."""
    result = CliRunner().invoke(app, ["demo", "--long", "--model", str(files["root"] / "tiny.gguf"), "--context", "120",
                                      "--nproc", "2",
                                      "--new-tokens", "2", "--no-reference"])
    assert result.exit_code == 0, result.output
    assert "as plain text to complete (no chat template)" in result.stdout
    windows = 5 * (WINDOW - 1 + SPARE_ROWS) * 2 * 256 * 4 / 1024  # KiB: five window layers, a ring each
    assert re.search(rf"KV cache per rank \(measured, 2 ranks\): .* per token 2\.00 KiB \(global layers\) \+ {windows:.2f} KiB "
                     rf"of windows",
                     result.stdout), result.stdout
    assert re.search(r"a full cache of all 6 layers for \d+ positions: .* \(12\.00 KiB per token\)", result.stdout), result.stdout
    # why a rank can hold more than 1/p of a full cache: the windows, whole on every rank, and the arena's spare blocks
    assert re.search(r"why: of a rank's [\d.]+ MiB, [\d.]+ MiB are the 5 window layers' last \d+ positions, kept whole on every "
                     r"rank, and [\d.]+ MiB the paged blocks of the 1 global layers \(room for [\d,]+ positions",
                     result.stdout), result.stdout
    # the 84-token prompt fills no block of 256: ring finds no cached prefix and says so (test_methods_share_one_prefill)
    assert "ring (pass-KV) found none of tree (onepass)'s prefill in the prefix cache" in result.stdout, result.stdout


def test_methods_share_one_prefill(files, ranks_ran):
    """treeattn.eval.runner.shared_prefill_rows on 2 ranks: each method after the first switches the
    engine's decode (Engine.set_decode) and takes the prompt's prefill from the prefix cache, up to
    the window checkpoint at its last full block; every method's tokens are transformers' greedy ones."""
    rows = ranks_ran[1]
    for prompt, row in zip((PROMPTS[2], PROMPT), rows):
        reference = _greedy_uncached(files["text"], prompt, NEW)
        assert [r.generated_ids[0] for _, _, r in row] == [reference] * len(METHODS)
        assert [(r.decode, r.method) for _, _, r in row] == list(METHODS)
        cached = [r.cached_prompt_tokens[0] for _, _, r in row]
        assert cached == [0] + [len(prompt) // 16 * 16] * 2, cached  # a checkpoint at the last full block, <= 16 behind
