"""GGUF loading against the Hugging Face checkpoints the files were written from.

Tiny random transformers models (Llama: untied, permuted Q/K; Qwen2: q/k/v bias, tied) are written
as GGUF files in F16, Q8_0 and Q4_1 by gguf's own writer and quantizer (tests/gguf_files.py). The
loaded weights must equal exactly what the file holds (the HF weight quantized and dequantized by
gguf), which also checks the names and the Q/K permutation; the prefill logits must match the HF
model carrying those same round-tripped weights. The tokenizer and chat template come from the
file. Bad files fail with one error naming the file and the key or tensor at fault.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf_files import CHATML, VOCAB, gguf_name, roundtrip, roundtrip_model, write_gguf  # noqa: E402
from helpers.llama_checkpoints import treeattn_logits  # noqa: E402

from treeattn.models import load_model, load_tokenizer, read_config  # noqa: E402
from treeattn.models.chat import encode_chat, end_of_turn_id, messages, read_chat_template  # noqa: E402
from treeattn.models.gguf import unpermute_rows  # noqa: E402
from treeattn.models.packed import is_packed  # noqa: E402
from helpers.gguf_models import COMMON, hf_model  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def models():
    return {arch: hf_model(arch) for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("arch,qtype", [("llama", Q.F16), ("llama", Q.Q8_0), ("llama", Q.Q4_1), ("llama", Q.Q4_0),
                                        ("qwen2", Q.Q8_0)])
def test_weights_and_logits_match_the_checkpoint(models, tmp_path, arch, qtype):
    hf = models[arch]
    path = tmp_path / f"tiny-{arch}.{qtype.name}.gguf"
    write_gguf(path, hf, qtype, arch=arch)
    model = load_model(path)

    ours = dict(model.named_parameters())
    for hf_name, weight in hf.state_dict().items():
        if hf_name == "lm_head.weight" and hf.config.tie_word_embeddings:
            assert model.lm_head is None
            continue
        expected = weight.float().numpy()
        if expected.ndim == 2:
            expected = roundtrip(expected, qtype)
        name = hf_name.removeprefix("model.")
        assert np.array_equal(ours[name].detach().numpy(), expected), f"{name} ({gguf_name(hf_name)})"

    reference = roundtrip_model(hf, qtype)
    ids = torch.randint(0, VOCAB, (1, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(treeattn_logits(model, ids), expected, atol=1e-4, rtol=0)
    assert expected[0, -1].std() > 0.1
    if qtype != Q.F16:  # quantization moved the weights, so the original model is only close
        assert not torch.equal(ours["layers.0.self_attn.q_proj.weight"], hf.model.layers[0].self_attn.q_proj.weight)


def test_config_tokenizer_and_template_come_from_the_file(models, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, models["qwen2"], Q.F16, arch="qwen2", context_length=96)
    config = read_config(path)
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim) == ("Qwen2ForCausalLM", 2, 4, 2, 16)
    assert config.qkv_bias and config.tie_word_embeddings and config.max_position_embeddings == 96
    assert config.rope_theta == 1e6 and config.eos_token_ids == (2,) and config.bos_token_id == 1

    tokenizer = load_tokenizer(path)
    assert tokenizer.encode(" the").ids == [tokenizer.token_to_id("Ġthe")]  # merges applied
    assert tokenizer.encode("<|im_end|>").ids == [2]                         # control token kept whole
    assert tokenizer.decode(tokenizer.encode("héllo, the world").ids) == "héllo, the world"

    template = read_chat_template(path)
    assert template.template == CHATML and template.eos_token == "<|im_end|>"
    ids = encode_chat(tokenizer, template, messages("hi", system="be brief"))
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert end_of_turn_id(tokenizer, template) == 2


def test_shared_readers_parse_an_unchanged_file_once(models, tmp_path, monkeypatch):
    """Inside shared_readers() (ta.Engine's checks, `treeattn serve`'s start-up) the chat template,
    the config, the tokenizer and the memory check's sizes come from one parse of the file; outside
    it, and for a file written again, the file is parsed anew."""
    import treeattn.engine.checks as checks
    import treeattn.models.gguf as gguf_module
    from treeattn.engine import EngineConfig

    path = tmp_path / "tiny.gguf"
    write_gguf(path, models["llama"], Q.Q8_0, arch="llama", context_length=96)
    parsed = []
    monkeypatch.setattr(gguf_module, "_Reader", lambda p, *rest: parsed.append(p) or gguf.GGUFReader(p))

    assert gguf_module.open_gguf(path) is not gguf_module.open_gguf(path) and len(parsed) == 2
    parsed.clear()
    config = checks.with_device(str(path), EngineConfig(nproc=2, weight_format="packed", cache_tokens=256, block_size=16))
    with gguf_module.shared_readers():
        template = read_chat_template(path)
        with gguf_module.shared_readers():  # nested, as serve's block around the Engine's
            files = checks.check_engine(str(path), config)
        assert len(parsed) == 1 and gguf_module.open_gguf(str(path)) is gguf_module.open_gguf(path)
        assert template.template == CHATML and files.config.num_layers == 2 and files.tokenizer is not None
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # "written again"
        gguf_module.open_gguf(path)
        assert len(parsed) == 2
    gguf_module.open_gguf(path)
    assert len(parsed) == 3 and gguf_module._SHARED.readers == {}

    import treeattn.engine.client as client  # ta.Engine's own checks: one parse (stopped before the model is loaded)
    from treeattn.engine import Engine

    parsed.clear()
    monkeypatch.setattr(client, "GroupChannel", lambda *args: (_ for _ in ()).throw(RuntimeError("checks passed")))
    with pytest.raises(RuntimeError, match="checks passed"):
        Engine(str(path), nproc=1, cache_tokens=256, block_size=16)
    assert len(parsed) == 1


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_whole_array_dequantization_is_bit_for_bit_gguf_quants(qtype):
    import gguf.quants

    from treeattn.models.gguf import dequantize_blocks

    rng = np.random.default_rng(0)
    values = (rng.standard_normal((64, 256)) * rng.uniform(1e-4, 1e3, (64, 1))).astype(np.float32)
    values[3] = 0.0
    raw = gguf.quants.quantize(values, qtype)  # (64, bytes per row): what a file holds
    expected = gguf.quants.dequantize(raw, qtype)
    got = dequantize_blocks(raw, qtype).reshape(expected.shape)
    assert got.dtype == np.float32 and got.tobytes() == expected.tobytes()
    noise = rng.integers(0, 256, raw.shape, dtype=np.uint8)  # any bytes, inf/NaN scales included
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in both
        expected = gguf.quants.dequantize(noise, qtype)
        got = dequantize_blocks(noise, qtype).reshape(expected.shape)
    finite = np.isfinite(expected)
    assert np.array_equal(np.isfinite(got), finite) and got[finite].tobytes() == expected[finite].tobytes()
    assert np.array_equal(np.isnan(got), np.isnan(expected))


def test_unpermute_inverts_llama_cpp_permutation():
    from gguf_files import permute

    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    assert np.array_equal(unpermute_rows(permute(w, 6), 6), w)
    assert not np.array_equal(permute(w, 6), w)


# ------------------------------------------------------------------------------- bad files


def test_unsupported_architecture_names_it_and_the_supported_ones(models, tmp_path):
    path = tmp_path / "falcon.gguf"
    write_gguf(path, models["qwen2"], Q.F16, arch="falcon")
    with pytest.raises(ValueError, match=r"falcon\.gguf: unsupported architecture 'falcon'.*supported: llama, mistral, qwen2"):
        load_model(path)


def test_undequantizable_tensor_type_names_the_tensor(models, tmp_path):
    path = tmp_path / "q81.gguf"
    write_gguf(path, models["llama"], Q.F16, raw_types={"blk.1.ffn_up.weight": Q.Q8_1})
    with pytest.raises(ValueError, match=r"q81\.gguf: tensor 'blk\.1\.ffn_up\.weight' has type Q8_1, which"):
        load_model(path)


def test_truncated_and_corrupt_files(models, tmp_path):
    good = tmp_path / "good.gguf"
    write_gguf(good, models["llama"], Q.Q8_0)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match=r"truncated\.gguf: truncated: tensor data ends at byte \d+, the file has "
                                         rf"{len(data) * 2 // 3}$"):
        load_model(truncated)
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"header\.gguf: "):
        load_model(header_cut)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"XXXX" + data[4:])
    with pytest.raises(ValueError, match=r"corrupt\.gguf: not a readable GGUF file"):
        load_model(corrupt)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        load_model(tmp_path / "missing.gguf")


def test_missing_tokenizer_and_template_are_none(models, tmp_path):
    path = tmp_path / "bare.gguf"
    write_gguf(path, models["llama"], Q.F16, tokenizer=False, chat_template=None)
    model = load_model(path)
    assert model.tokenizer is None and model.chat_template is None
    with pytest.raises(ValueError, match="chat messages, but the model has no tokenizer"):
        from treeattn.engine.generate import generate

        generate(model, [{"role": "user", "content": "hi"}], max_new_tokens=1)


def test_sentencepiece_tokenizer_matches_transformers_gguf_tokenizer(tmp_path):
    """tokenizer.ggml.model "llama" (SentencePiece BPE, byte fallback, BOS added) against
    transformers' tokenizer built from the same file."""
    from gguf_files import SPM_PIECES, write_spm_gguf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "vocab_size": 259 + len(SPM_PIECES)})
    write_spm_gguf(tmp_path / "spm.gguf", transformers.LlamaForCausalLM(config).eval())
    ours = load_tokenizer(tmp_path / "spm.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["the cat", "hello world", "the world the cat", "ünï 🎉 cat\n"]:
        ids = ours.encode(text).ids
        assert ids == theirs(text).input_ids, text
        assert ids[0] == 1 and ours.decode(ids) == text
    # Text that starts with a space: SentencePiece's dummy prefix gives "▁" + "▁the" (as Llama 2's
    # tokenizer and llama.cpp do); transformers' GGUF conversion drops that "▁".
    assert ours.encode(" the").ids == [1, ours.token_to_id("▁"), ours.token_to_id("▁the")]


def test_metadata_arrays_read_in_one_pass_equal_the_gguf_readers(tmp_path):
    """open_gguf reads arrays of strings and numbers in one pass; every field (its types, length,
    whole contents and single items) must equal what gguf.GGUFReader reads."""
    from treeattn.models.gguf import open_gguf

    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["", "a", "\u2581\u2581", "日本", "x" * 300])
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.ints", list(range(-3, 40)))
    writer.add_array("test.empty", [])
    writer.add_string("test.scalar", "one")
    writer.add_uint32("test.number", 7)
    writer.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, reference = open_gguf(path), gguf.GGUFReader(path)
    assert ours.fields.keys() == reference.fields.keys()
    for key, expected in reference.fields.items():
        got = ours.fields[key]
        assert (got.types, got.contents(), len(got.data)) == (expected.types, expected.contents(), len(expected.data)), key
        for i in range(len(expected.data)):
            assert got.contents(i) == expected.contents(i), (key, i)
    assert ours.fields["test.strings"].contents() == ["", "a", "\u2581\u2581", "日本", "x" * 300]
    np.testing.assert_array_equal(ours.tensors[0].data, reference.tensors[0].data)


# ------------------------------------------------------------------------------- converted copies


def _same_model(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
    assert torch.equal(a.inv_freq, b.inv_freq) and a.config == b.config and a.chat_template == b.chat_template
    text = "<|im_start|>user\nhéllo, the world<|im_end|>"
    assert a.tokenizer.encode(text).ids == b.tokenizer.encode(text).ids


def test_a_converted_copy_loads_the_same_model_without_reading_the_file(models, tmp_path, monkeypatch):
    import treeattn.models.gguf as gguf_module
    from treeattn.models import gguf_cache

    path = tmp_path / "tiny.gguf"
    write_gguf(path, models["llama"], Q.Q4_1, arch="llama")
    monkeypatch.setenv("TREEATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TREEATTN_GGUF_CACHE", "0")
    reference = load_model(path)
    assert not (tmp_path / "cache").exists()  # off: nothing written
    monkeypatch.setenv("TREEATTN_GGUF_CACHE", "1")
    _same_model(load_model(path), reference)  # converts and writes the copy
    entries = list((tmp_path / "cache" / "gguf").glob("*.safetensors"))
    assert entries == [gguf_cache.entry_path(path, torch.float32)]

    def unread(*args, **kwargs):
        raise AssertionError("the GGUF file was read")

    with monkeypatch.context() as m:
        m.setattr(gguf_module, "open_gguf", unread)
        _same_model(load_model(path), reference)  # from the copy alone
    monkeypatch.setenv("TREEATTN_GGUF_CACHE", "0")
    packed_reference = load_model(path, weight_format="packed")
    monkeypatch.setenv("TREEATTN_GGUF_CACHE", "1")
    _same_model(load_model(path, weight_format="packed"), packed_reference)  # packed weights: their own copy
    assert sorted(entries[0].parent.glob("*.safetensors")) == sorted([entries[0],
                                                                      gguf_cache.entry_path(path, torch.float32, "packed")])
    with monkeypatch.context() as m:
        m.setattr(gguf_module, "open_gguf", unread)
        from_copy = load_model(path, weight_format="packed")  # the packed layers, from the copy alone
    _same_model(from_copy, packed_reference)
    kinds = lambda model: [(name, type(module).__name__, getattr(module, "fmt", None)) for name, module in model.named_modules()]
    assert kinds(from_copy) == kinds(packed_reference) and is_packed(from_copy)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(treeattn_logits(from_copy, ids), treeattn_logits(packed_reference, ids))
    half = load_model(path, dtype=torch.bfloat16)  # another dtype: its own entry
    assert half.dtype == torch.bfloat16 and len(list(entries[0].parent.glob("*.safetensors"))) == 3

    write_gguf(path, models["llama"], Q.Q8_0, arch="llama")  # the file written again: the old copy is stale
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    monkeypatch.setenv("TREEATTN_GGUF_CACHE", "off")
    fresh = load_model(path)
    monkeypatch.setenv("TREEATTN_GGUF_CACHE", "1")
    _same_model(load_model(path), fresh)
    assert not entries[0].exists() and gguf_cache.entry_path(path, torch.float32).exists()
    assert not torch.equal(fresh.layers[0].mlp.up_proj.weight, reference.layers[0].mlp.up_proj.weight)

    entry = gguf_cache.entry_path(path, torch.float32)
    entry.write_bytes(entry.read_bytes()[:1000])  # a damaged copy is converted and written again
    _same_model(load_model(path), fresh)
    _same_model(load_model(path), fresh)
    assert entry.stat().st_size > 1000 and not list(entry.parent.glob(".tmp-*"))


def test_a_load_without_the_tokenizer_has_the_same_weights_and_writes_no_copy(models, tmp_path, monkeypatch):
    """with_tokenizer=False (the engine's ranks: they run token ids) skips building the tokenizer and
    the template and gives the same weights; with the cache on it writes no copy, which would lack
    them; a rank's load (treeattn.engine.worker.rank.load_model) is such a load."""
    import treeattn.models.gguf_tokenizer as gguf_tokenizer
    from treeattn.engine.worker.rank import load_model as rank_load_model

    path = tmp_path / "tiny.gguf"
    write_gguf(path, models["llama"], Q.Q8_0, arch="llama")
    monkeypatch.setenv("TREEATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TREEATTN_GGUF_CACHE", "1")
    with monkeypatch.context() as m:
        m.setattr(gguf_tokenizer, "tokenizer_from_gguf", lambda *a, **k: pytest.fail("the tokenizer was built"))
        bare = load_model(path, with_tokenizer=False)
        ranks = rank_load_model(str(path), None, torch.device("cpu"), "packed")
        assert ranks.tokenizer is None and ranks.chat_template is None
    assert bare.tokenizer is None and bare.chat_template is None
    assert not (tmp_path / "cache").exists()
    full = load_model(path)  # writes the copy, with the tokenizer
    assert full.tokenizer is not None and full.chat_template is not None
    for name, tensor in full.state_dict().items():
        assert torch.equal(tensor, bare.state_dict()[name]), name
    from_copy = load_model(path, with_tokenizer=False)
    assert from_copy.tokenizer is None and torch.equal(from_copy.lm_head.weight, full.lm_head.weight)


def test_a_reader_without_the_tokenizer_steps_over_its_arrays_and_keeps_everything_else(models, tmp_path):
    """open_gguf(path, tokenizer=False) (a load without the tokenizer: an engine's rank) does not parse
    the tokenizer's arrays: they have no field; every other field, every tensor and the config are the
    full reader's; shared_readers keeps the two kinds apart."""
    from treeattn.models.gguf import open_gguf, read_gguf_config, shared_readers

    path = tmp_path / "tiny.gguf"
    write_gguf(path, models["llama"], Q.Q8_0, arch="llama")
    full, lite = open_gguf(path), open_gguf(path, tokenizer=False)
    skipped = sorted(set(full.fields) - set(lite.fields))
    assert "tokenizer.ggml.tokens" in skipped and all(
        k.startswith("tokenizer.") and full.fields[k].types[0] == gguf.GGUFValueType.ARRAY for k in skipped
    )
    assert "tokenizer.ggml.eos_token_id" in lite.fields and set(lite.fields) <= set(full.fields)
    assert all(lite.fields[k].contents() == full.fields[k].contents() for k in lite.fields)
    assert [(t.name, t.data_offset, t.n_bytes) for t in lite.tensors] == [(t.name, t.data_offset,
                                                                           t.n_bytes) for t in full.tensors]
    assert read_gguf_config(lite, path=path) == read_gguf_config(full, path=path)
    with shared_readers():
        assert open_gguf(path, tokenizer=False) is not open_gguf(path) and "tokenizer.ggml.tokens" in open_gguf(path).fields
