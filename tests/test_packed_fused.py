"""q/k/v and gate/up multiplied as one packed matrix (models.packed.fuse_projections): bit for bit the parts' own products.

The CPU kernel computes every output row by itself; a fused call runs on one thread as each part did, and
fuse_packed only stacks parts whose rows fall in the same row groups as alone. So the fused products, the
hidden states of a fused model and its greedy tokens equal the unfused ones exactly.
"""

from __future__ import annotations

import gguf
import gguf.quants
import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf_files import write_gguf  # noqa: E402
from helpers.gguf_models import hf_model  # noqa: E402
from helpers.packed import weights  # noqa: E402

from treeattn.models import load_model  # noqa: E402
from treeattn.models.attention import LocalAttention  # noqa: E402
from treeattn.models.packed import (ARENA_ALIGN, PackedLinear, fuse_packed, fuse_projections, pack_arena,  # noqa: E402
                                   weight_bytes)
from treeattn.ops.packed_linear import kernel_module, unpack_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
FORMATS = [("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1), ("q8_0", Q.Q8_0)]


def packed(fmt, qtype, rows, cols, seed, bias=False):
    blocks = unpack_blocks(fmt, gguf.quants.quantize(weights(rows, cols, seed), qtype))
    b = torch.randn(rows, generator=torch.Generator().manual_seed(seed)) if bias else None
    return PackedLinear(fmt, *blocks, b), (blocks, b)


@pytest.mark.parametrize("fmt,qtype", FORMATS)
def test_a_fused_call_equals_the_parts_calls_bit_for_bit(fmt, qtype):
    assert kernel_module() is not None
    shapes = [(64, 1), (32, 2), (30, 3)]  # the last part's rows need not fill a row group
    for bias in (False, True):
        parts, copies = zip(*(packed(fmt, qtype, rows, 96, seed, bias) for rows, seed in shapes))
        alone = [PackedLinear(fmt, *blocks, b) for blocks, b in copies]  # never fused: their own buffers
        before = weight_bytes(torch.nn.ModuleList(parts))
        fused = fuse_packed(list(parts))
        assert fused is not None and weight_bytes(torch.nn.ModuleList(parts)) == before  # views, not a second copy
        for rows in (1, 3, 16, 40):  # 40: prefill-sized, the parts run one by one
            x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
            for dtype in (torch.float32, torch.bfloat16):
                xs = x.to(dtype)
                got = fused(xs)
                for y, part, ref in zip(got, parts, alone):
                    assert y.dtype == dtype and torch.equal(y, ref(xs)) and torch.equal(part(xs),
                                                                                        ref(xs)), (fmt, rows, dtype, bias)


def test_pack_arena_keeps_fused_and_single_layers_bit_for_bit():
    """pack_arena moves a fused matrix's stacked buffers and a lone layer's into one allocation; the parts view the
    moved rows again (still current), and every product is the same bits as before."""
    parts, _ = zip(*(packed("q4_1", Q.Q4_1, rows, 64, seed) for rows, seed in ((32, 1), (30, 2))))
    lone, _ = packed("q8_0", Q.Q8_0, 8, 64, 3)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.lone = parts[0], parts[1], lone

    holder = Holder()
    fused = fuse_packed(list(parts))
    holder.__dict__["fused"] = fused
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    before = [*fused(x), *(p(x) for p in parts), lone(x)]
    size = weight_bytes(holder)
    assert pack_arena(holder) == sum(t.numel() * t.element_size() for t in (*fused.whole.buffers(), *lone.buffers()))
    moved = [*fused.whole.buffers(), *lone.buffers()]
    starts = sorted(t.data_ptr() for t in moved)  # one allocation: every buffer aligned, side by side
    assert all(p % ARENA_ALIGN == 0 for p in starts) and starts[-1] - starts[0] < sum(t.nbytes + ARENA_ALIGN for t in moved)
    assert fused.current() and weight_bytes(holder) == size
    after = [*fused(x), *(p(x) for p in parts), lone(x)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_what_cannot_be_fused_bit_for_bit_is_left_alone():
    a, _ = packed("q4_1", Q.Q4_1, 30, 64, 0)
    b, _ = packed("q4_1", Q.Q4_1, 32, 64, 1)
    c, _ = packed("q4_0", Q.Q4_0, 32, 64, 2)
    d, _ = packed("q4_1", Q.Q4_1, 32, 96, 3)
    assert fuse_packed([a, b]) is None  # 30 rows first: its last rows would join a group of the next part's
    assert fuse_packed([b, c]) is None and fuse_packed([b, d]) is None  # formats, columns
    assert fuse_packed([b, a]) is not None
    assert fuse_packed([b, torch.nn.Linear(64, 32)]) is None


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    paths = {}
    for fmt, qtype in FORMATS:
        paths[fmt] = root / f"llama.{fmt}.gguf"
        write_gguf(paths[fmt], hf_model("llama"), qtype)
    paths["qwen2"] = root / "qwen2.q8_0.gguf"  # q/k/v bias
    write_gguf(paths["qwen2"], hf_model("qwen2"), Q.Q8_0, arch="qwen2")
    return paths


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0", "qwen2"])
def test_a_fused_model_gives_the_unfused_models_hidden_states_bit_for_bit(files, name):
    from treeattn.cache.sharded import ShardedKVCache

    plain = load_model(files[name], weight_format="packed", with_tokenizer=False)
    model = load_model(files[name], weight_format="packed", with_tokenizer=False)
    assert fuse_projections(model) == 2 * len(model.layers) and fuse_projections(model) == 0  # once
    assert model.state_dict().keys() == plain.state_dict().keys() and weight_bytes(model) == weight_bytes(plain)
    assert all(layer.self_attn.fused.current() and layer.mlp.fused.current() for layer in model.layers)
    c = model.config
    hidden = []
    for m in (plain, model):
        cache = ShardedKVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, capacity=32)
        out = []
        with torch.inference_mode():
            for step, tokens in enumerate(([5, 7, 9, 11], [13], [17])):  # a prefill (4 rows: the kernel) and two decode steps
                positions = torch.arange(len(tokens)).unsqueeze(0) + (0 if step == 0 else 3 + step)
                out.append(m(torch.tensor([tokens]), positions, cache.update(cache.extend(positions)), LocalAttention()))
        hidden.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*hidden))
