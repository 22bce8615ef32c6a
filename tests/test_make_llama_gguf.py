"""benchmarks/models/make_llama_gguf.py: a small random Llama GGUF loads in treeattn, decodes greedily, and is the
same model transformers reads from the file (its RoPE divided by the file's rope_freqs, as llama.cpp and
treeattn apply them)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_files import CHATML, add_tokenizer, vocabulary
from helpers.llama_checkpoints import treeattn_logits

import treeattn as ta

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "models" / "make_llama_gguf.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_llama_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tokenizer_source(path: Path) -> int:
    """A GGUF holding only a tiny byte-level BPE tokenizer (tests/gguf_files.py's); returns its size."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    add_tokenizer(writer)
    writer.add_chat_template(CHATML)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return len(vocabulary()[0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_gguf")
    n_tokens = _tokenizer_source(folder / "tokenizer.gguf")
    script = _script()
    args = script.parse_args(["--out", str(folder / "tiny.gguf"), "--type", "q8_0", "--layers", "2", "--hidden", "128",
                              "--heads", "4", "--kv-heads", "2", "--ffn", "256", "--vocab", "320",
                              "--max-position-embeddings", "512",
                              "--tokenizer", str(folder / "tokenizer.gguf")])
    info = script.write_random_llama(args)
    return folder, info, n_tokens, script


def test_the_file_has_the_shape_the_tokenizer_and_llama3_rope(tiny):
    folder, info, n_tokens, script = tiny
    reader = gguf.GGUFReader(str(folder / "tiny.gguf"))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "llama" and field("llama.block_count") == 2
    assert (field("llama.embedding_length"), field("llama.feed_forward_length")) == (128, 256)
    assert (field("llama.attention.head_count"), field("llama.attention.head_count_kv")) == (4, 2)
    assert field("llama.rope.freq_base") == 500000.0 and field("general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == 320 == field("llama.vocab_size")  # llama.cpp's n_vocab is the token count
    assert tokens[:n_tokens] == vocabulary()[0] and tokens[-1] == f"<|reserved_special_token_{320 - n_tokens - 1}|>"
    assert field("tokenizer.ggml.token_type")[n_tokens:] == [5] * (320 - n_tokens)  # UNUSED
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied, as Llama-3.2-1B
    assert tensors["blk.1.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert list(tensors["token_embd.weight"].shape) == [128, 320]
    # the converter's llama3 factors: 1 for short wavelengths, the factor 32 for long ones
    factors = np.array(tensors["rope_freqs.weight"].data)
    assert factors[0] == 1.0 and factors[-1] == 32.0 and np.all(np.diff(factors) >= 0)
    assert info["parameters"] == 320 * 128 + 2 * (128 + 4 * 32 * 128 * 2 + 2 * 2 * 32 * 128 + 128 + 3 * 128 * 256) + 128


def test_treeattn_loads_it_and_decodes_what_transformers_decodes(tiny):
    folder, _, _, _ = tiny
    transformers = pytest.importorskip("transformers")
    model = ta.load_model(folder / "tiny.gguf")
    assert (model.config.num_layers, model.config.num_heads, model.config.vocab_size) == (2, 4, 320)
    assert model.config.tie_word_embeddings
    prompt = ta.load_tokenizer(folder / "tiny.gguf").encode(" the theme").ids
    ours = ta.generate(model, [prompt], max_new_tokens=4).generated_ids[0]
    assert len(ours) == 4

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32)
    rope = next(t for t in gguf.GGUFReader(str(folder / "tiny.gguf")).tensors if t.name == "rope_freqs.weight")
    hf.model.rotary_emb.inv_freq /= torch.from_numpy(np.array(rope.data))  # transformers does not read rope_freqs
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        expected = hf(ids).logits
    assert ids[0, len(prompt):].tolist() == ours
    torch.testing.assert_close(treeattn_logits(model, ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("argv, message", [
    (["--type", "q5_1"], "--type must be one of q4_0, q8_0"),
    (["--heads", "3"], "--heads (3) must divide --hidden"),
    (["--ffn", "100"], "must be multiples of 32"),
    (["--vocab", "10"], "--vocab (10) must be at least the tokenizer's"),
])
def test_bad_shapes_fail_before_writing(tiny, argv, message):
    folder, _, _, script = tiny
    out = folder / "bad.gguf"
    args = script.parse_args(["--out", str(out), "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--ffn", "256",
                              "--vocab", "320", "--tokenizer", str(folder / "tokenizer.gguf"), *argv])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        script.write_random_llama(args)
    assert not out.exists()


def test_default_shape_is_llama_3_2_1b():
    args = _script().parse_args(["--out", "x.gguf", "--tokenizer", "t.gguf"])
    assert (args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab, args.rope_theta) == \
        (2048, 16, 32, 8, 8192, 128256, 500000.0)
    assert args.type == "q4_0" and math.isclose(args.hidden / args.heads, 64)


def test_the_cost_model_reads_the_files_shape_and_counts_its_weight_bytes(tiny):
    """`treeattn simulate FILE`: the config's shape; one rank's weight bytes = the file's matrices."""
    import json

    from typer.testing import CliRunner

    from treeattn.cli import app

    folder, _, _, _ = tiny
    result = CliRunner().invoke(app, ["simulate", str(folder / "tiny.gguf"), "--nproc", "1", "-n", "64",
                                      "--weight-dtype", "q8_0", "--layout", "helix", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.splitlines()[0])
    matrices = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(folder / "tiny.gguf")).tensors
                   if t.tensor_type == gguf.GGMLQuantizationType.Q8_0)
    assert record["weight_bytes_per_rank"] == matrices
