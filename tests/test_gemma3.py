"""Gemma 3 (text) in treeattn's own models, against transformers' Gemma3ForCausalLM.

Tiny checkpoints the tests write themselves (tests/gemma3_files.py): a Hugging Face directory of
model_type gemma3_text, one of gemma3 (image-text, the text model inside), and a gemma3 GGUF with
the real file's tensor types (Q4_K, Q5_0, Q6_K, Q8_0, F32) and a Gemma SentencePiece vocabulary.
The prompts are longer than the window (4), so window and global layers both matter. float32
throughout: logits agree to float32 rounding (1e-4 on logits of size ~1-10 is ~100x that).
"""

from __future__ import annotations

import json
import re

import gguf
import pytest
import torch

transformers = pytest.importorskip("transformers")

from gemma3_files import TOKENS, VOCAB, WINDOW, hf_gemma3, write_gemma3_gguf  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.cli import app  # noqa: E402
from treeattn.engine import SamplingParams  # noqa: E402
from treeattn.models import load_model, load_tokenizer, read_config  # noqa: E402
from treeattn.models.attention import LocalAttention  # noqa: E402
from treeattn.models.gemma3 import Gemma3Config, Gemma3Model  # noqa: E402
from treeattn.parallel import spawn  # noqa: E402

PROMPT = [2, 280, 290, 295, 300, 270, 281, 285, 290, 291, 299, 270, 275, 276, 283, 284, 292, 288, 273, 296, 301]
TOL = 1e-4


def ours_logits(model, ids: list[int]) -> torch.Tensor:
    """(S, V) float32 prefill logits of our model over `ids`, no cache."""
    positions = torch.arange(len(ids))[None]

    def store(layer, k, v):
        return k, v, positions

    with torch.no_grad():
        return model.logits(model(torch.tensor([ids]), positions, store, LocalAttention()))[0]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    text = hf_gemma3()
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


# -------------------------------------------------------------- the engine: tokens equal transformers'

PROMPTS = [PROMPT, PROMPT[:9] + [277, 279, 286]]
NEW = 8


def _greedy_uncached(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, recomputing the whole sequence at every step (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def _engine_runs(rank: int, world_size: int, path: str) -> list:
    torch.set_num_threads(1)
    import torch.distributed as dist

    model = load_model(path)
    groups = {1: dist.new_group([0]), 2: None}
    out = []
    for p, options in [(1, dict(decode="local")), (2, dict(decode="tree")), (2, dict(decode="ring")),
                       (2, dict(decode="tree", placement="interleaved", prefix_cache=True))]:
        if rank >= p:
            continue
        with ta.Engine(model, group=groups[p], timeout_s=60, cache_tokens=512, block_size=4, prefill_chunk=8, **options) as engine:
            if engine.is_driver:
                handles = [engine.submit(prompt, SamplingParams(max_new_tokens=NEW)) for prompt in PROMPTS]
                out.append((p, options, [h.result(timeout=120).token_ids for h in handles]))
    return out


def test_engine_tokens_equal_transformers_uncached_greedy(files):
    refs = [_greedy_uncached(files["text"], prompt, NEW) for prompt in PROMPTS]
    path = files["root"] / "text"
    for p, options, tokens in spawn(_engine_runs, 2, str(path), timeout=300)[0]:
        assert tokens == refs, (p, options)
