"""Prompt log-probabilities (SamplingParams.prompt_logprobs, treeattn.engine.worker.prompt_logprobs).

Every prompt token's logprob and its top-k equal the float64 log-softmax of transformers' forward
over the prompt (within float32 rounding), on one rank and on two spawned ranks under every kind of
prefill step: chunked (several chunks, the short ones replicated on every rank), token-parallel
("split") and ring. A prompt already in the prefix cache is computed again (cached_prompt_tokens 0)
and gives the same values; the packing over row blocks and vocabulary chunks equals one log-softmax of all the
logits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llama_checkpoints import VOCAB, make_checkpoint  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.engine import SamplingParams  # noqa: E402
from treeattn.engine.worker import prompt_logprobs as pl  # noqa: E402

_G = torch.Generator().manual_seed(5)
LONG = torch.randint(0, VOCAB, (200,), generator=_G).tolist()  # one split or ring step on 2 ranks (>= 64 rows a rank)
SHORT = torch.randint(0, VOCAB, (70,), generator=_G).tolist()
TOP = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prompt_logprobs") / "llama"
    hf = make_checkpoint("llama", directory)
    return directory, hf.double().eval()


def _check(result, hf, prompt) -> None:
    assert result.finish_reason == "length" and result.cached_prompt_tokens == 0
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1], dim=-1)  # row i predicts prompt[i + 1]
    got = torch.tensor([e.logprob for e in result.prompt_logprobs[1:]], dtype=torch.float64)
    torch.testing.assert_close(got, expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=2e-5, rtol=0)
    top_values, top_ids = expected.topk(TOP, dim=-1)
    for entry, values, ids in zip(result.prompt_logprobs[1:], top_values.tolist(), top_ids.tolist()):
        assert entry.rank >= 1 and (entry.rank == 1) == (entry.logprob >= values[0] - 1e-5)
        assert [lp for _, lp in entry.top] == pytest.approx(values, abs=2e-5)
        close = abs(values[0] - values[1]) < 1e-5  # a near tie may order either way
        assert close or [a for a, _ in entry.top] == ids


@pytest.mark.parametrize("nproc, prefill, chunk", [(1, "auto", 48), (2, "split", 160), (2, "ring", 512)])
def test_prompt_logprobs_equal_the_models_log_softmax(checkpoint, nproc, prefill, chunk):
    directory, hf = checkpoint
    with ta.Engine(str(directory), nproc=nproc, block_size=16, cache_tokens=1024, prefill=prefill, prefill_chunk=chunk,
                   threads_per_rank=1) as engine:
        engine.generate(LONG, max_new_tokens=1)  # the prompt is now in the prefix cache
        long, short = engine.generate([LONG, SHORT], max_new_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
        plain, = engine.generate(SHORT, max_new_tokens=2, ignore_eos=True)
    _check(long, hf, LONG)
    _check(short, hf, SHORT)
    assert plain.prompt_logprobs is None and plain.token_ids == short.token_ids


def test_row_blocks_and_vocab_chunks_equal_one_log_softmax(monkeypatch):
    from treeattn.models import random_model

    model = random_model(ta.LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                        num_kv_heads=1, head_dim=8), seed=1, std=0.5)
    hidden, targets = torch.randn(23, 16, generator=_G), torch.randint(0, 300, (23,), generator=_G)
    whole = pl.score_rows(model, hidden, targets, top=3)  # one block, one chunk (the whole vocabulary)
    monkeypatch.setattr(pl, "ROWS_PER_BLOCK", 5)  # 5 blocks, the last short
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(pl, "CHUNK_BYTES", 5 * 4 * 64)  # chunks of 64 columns: 5 a block, the last 44
    assert pl.vocab_columns(5, 300) == 64 and pl.vocab_columns(3, 300) == 106
    packed = pl.score_rows(model, hidden, targets, top=3)
    torch.testing.assert_close(packed, whole, atol=2e-6, rtol=0)  # float32 rounding: the logsumexp merged by chunks
    logp = torch.log_softmax(model.logits(hidden).double(), dim=-1)
    for got in (packed, whole):
        torch.testing.assert_close(got[:, 0], logp[torch.arange(23), targets], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[:, 2:5], logp.topk(3).values, atol=1e-5, rtol=0)
        rank = (logp > logp[torch.arange(23), targets][:, None]).sum(dim=-1) + 1
        assert torch.equal(got[:, 1].long(), rank)
        assert torch.equal(got[:, 5:].long(), logp.topk(3).indices)
    assert pl.score_rows(model, hidden, targets, top=0).shape == (23, 2)  # no top k asked: none computed
    pl.chunk_pool(2)  # made before get_num_threads says 2: its threads check their own count
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the 5 chunks of a block: runs of 2 and 3 on 2 pool threads
    pooled = pl.score_rows(model, hidden, targets, top=3)  # MKL's tiny products round apart with 1 and 2 threads
    torch.testing.assert_close(pooled, packed, atol=2e-6, rtol=0)
    assert torch.equal(pooled[:, 1], packed[:, 1]) and torch.equal(pooled[:, 5:], packed[:, 5:])


@pytest.mark.skipif(pl.reduction_kernel(torch.device("cpu")) is None, reason="numba is not installed")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_compiled_pass_gives_the_torch_calls_values(monkeypatch, threads):
    """ops.logits_cpu_kernel's one pass a row (the default on the CPU) against _ChunkReducer's torch calls: the same
    maxima, counts (so ranks) and top ids, sums of exp within float32 rounding."""
    from treeattn.models import random_model

    model = random_model(ta.LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                        num_kv_heads=1, head_dim=8), seed=2, std=0.5)
    hidden, targets = torch.randn(23, 16, generator=_G), torch.randint(0, 300, (23,), generator=_G)
    pl.chunk_pool(2)
    monkeypatch.setattr(pl, "ROWS_PER_BLOCK", 5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(pl, "CHUNK_BYTES", 5 * 4 * 64)
    compiled = pl.score_rows(model, hidden, targets, top=4)
    monkeypatch.setattr(pl, "reduction_kernel", lambda device: None)
    calls = pl.score_rows(model, hidden, targets, top=4)
    torch.testing.assert_close(compiled, calls, atol=1e-6, rtol=0)
    assert torch.equal(compiled[:, 1], calls[:, 1]) and torch.equal(compiled[:, 6:], calls[:, 6:])


def test_a_target_logit_rounded_apart_is_not_counted_above_itself(monkeypatch):
    """With several vocabulary chunks the count of larger logits compares each chunk with the target's logit
    computed first; were that product to round the target's logit below its chunk's, the rank is still
    1 + the other tokens above it."""
    from treeattn.models import random_model

    model = random_model(ta.LlamaConfig(vocab_size=40, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                                        num_kv_heads=1, head_dim=4), seed=3, std=0.5)
    hidden, targets = torch.randn(6, 8, generator=_G), torch.randint(0, 40, (6,), generator=_G)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(pl, "CHUNK_BYTES", 6 * 4 * 16)  # 3 chunks
    want = pl.score_rows(model, hidden, targets, top=0)
    logits = model.logits

    def lowered(hidden, vocab=None, weight=None):  # the targets' product (vocab None, weight given) rounds down
        out = logits(hidden, vocab, weight)
        return out.nextafter(torch.full_like(out, -torch.inf)) if vocab is None and weight is not None else out

    monkeypatch.setattr(model, "logits", lowered)
    assert torch.equal(pl.score_rows(model, hidden, targets, top=0), want)


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "3"])
def test_bad_prompt_logprobs_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="^prompt_logprobs must be None or an int in \\[0, 20\\], got"):
        SamplingParams(prompt_logprobs=value)


def test_docstring_examples_run():
    import doctest

    from treeattn.engine import request

    for obj in (request.RequestResult, pl.score_rows, pl.dense_head, pl.prepacked_head, pl.vocab_columns, pl._take,
                pl.chunk_pool):
        finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in finder.find(obj, globs={}):
            runner.run(test)
        assert runner.failures == 0 and runner.tries > 0, obj


def _packed_head_model(fmt: str):
    """A tiny random model whose output projection is kept packed in `fmt` (300 x 64)."""
    import gguf
    import gguf.quants

    from treeattn.models import random_model
    from treeattn.models.packed import PackedLinear
    from treeattn.ops.packed_linear import unpack_blocks

    model = random_model(ta.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=32, num_layers=1, num_heads=2,
                                        num_kv_heads=1, head_dim=32), seed=2, std=0.5)
    quantized = gguf.quants.quantize(model.lm_head.weight.detach().numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    model.lm_head = PackedLinear(fmt, *unpack_blocks(fmt, quantized))
    return model


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_packed_head_is_dequantized_once_and_gives_the_packed_layers_values(fmt, monkeypatch):
    """A GGUF file's packed output projection where ops.dense_linear takes MKL's product (Intel; forced here):
    score_rows multiplies its float32 copy (dense_head, made once for every block and step), within float32 rounding
    of the packed layer's own product (its kernel for a block of 16 rows or fewer: another summation order) and of
    float64."""
    from treeattn.models.packed import PackedLinear
    from treeattn.ops import dense_linear

    model = _packed_head_model(fmt)
    monkeypatch.setattr(dense_linear, "MKL_VENDORS", (dense_linear.cpu_vendor(),))  # MKL's product: the plain copy
    made = []
    monkeypatch.setattr(PackedLinear, "dequantized", lambda self, real=PackedLinear.dequantized: made.append(1) or real(self))
    monkeypatch.setattr(pl, "ROWS_PER_BLOCK", 20)  # > MAX_KERNEL_ROWS: the packed layer dequantizes too
    hidden, targets = torch.randn(50, 64, generator=_G), torch.randint(0, 300, (50,), generator=_G)
    dense = pl.score_rows(model, hidden, targets, top=3)
    assert torch.equal(pl.score_rows(model, hidden, targets, top=3), dense) and len(made) == 1  # kept for the next call
    monkeypatch.setattr(pl, "dense_head", lambda model: None)  # the packed layer's own product, a block at once
    rows = slice(0, 40)  # the two full blocks (the last one, 10 rows, takes the packed kernel: another summation order)
    packed = pl.score_rows(model, hidden[rows], targets[rows], top=3)
    torch.testing.assert_close(packed, dense[rows], atol=2e-6, rtol=0)  # the logsumexp merged by chunks or not
    assert torch.equal(packed[:, 1], dense[rows, 1]) and torch.equal(packed[:, 5:], dense[rows, 5:])
    logp = torch.log_softmax(hidden.double() @ model.lm_head.dequantized().double().T, dim=-1)
    torch.testing.assert_close(dense[:, 0], logp[torch.arange(50), targets], atol=1e-5, rtol=0)
    torch.testing.assert_close(dense[:, 2:5], logp.topk(3).values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_prepacked_head_replaces_the_copy_and_gives_its_values(fmt, monkeypatch):
    """Where ops.dense_linear takes oneDNN (forced here: no vendor on MKL's side), a packed head is multiplied by runs
    of its rows held in oneDNN's blocked layout (prepacked_head) instead of a float32 copy: the runs hold the head's
    values, no plain copy is kept beside them, full blocks score to the plain copy's values bit for bit (oneDNN's
    product of a prepacked weight is the plain weight's), and every block within float32 rounding of float64."""
    from treeattn.ops import dense_linear

    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        pytest.skip("torch without oneDNN's linear op: nothing is prepacked")
    model = _packed_head_model(fmt)
    monkeypatch.setattr(dense_linear, "MKL_VENDORS", ())
    monkeypatch.setattr(pl, "ROWS_PER_BLOCK", 20)
    monkeypatch.setattr(pl, "CHUNK_BYTES", 20 * 4 * 64)  # 64 columns a chunk of a 20-row block: 5 chunks, the last 44
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the plain path's chunks: the same 64 columns
    chunks, columns = pl.prepacked_head(model)
    head = model.lm_head.dequantized()
    assert columns == 64 and [c.shape[0] for c in chunks] == [64, 64, 64, 64, 44] and all(c.is_mkldnn for c in chunks)
    assert torch.equal(torch.cat([c.to_dense() for c in chunks]), head)  # the packing holds the head's values
    hidden, targets = torch.randn(67, 64, generator=_G), torch.randint(0, 300, (67,), generator=_G)
    assert torch.equal(model.lm_head.dequantized_rows(targets), head[targets])  # the targets' rows, as the chunks'
    got = pl.score_rows(model, hidden, targets, top=3)
    assert "_prompt_logprobs_copy" not in model.lm_head.__dict__ and pl.prepacked_head(model)[0] is chunks  # kept, no copy
    monkeypatch.setattr(pl, "prepacked_head", lambda model: None)  # the plain float32 copy, oneDNN's product too
    rows = slice(0, 60)  # the three full blocks (the last, 7 rows, takes wider chunks on the plain path)
    assert torch.equal(got[rows], pl.score_rows(model, hidden[rows], targets[rows], top=3))
    logp = torch.log_softmax(hidden.double() @ head.double().T, dim=-1)
    torch.testing.assert_close(got[:, 0], logp[torch.arange(67), targets], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[:, 2:5], logp.topk(3).values, atol=1e-5, rtol=0)


def test_the_float32_product_follows_the_cpu_vendor(monkeypatch):
    """ops.dense_linear's rule: MKL's sgemm (F.linear, bit for bit) on MKL_VENDORS' CPUs (Intel), oneDNN's matmul
    elsewhere where torch has it; prepack_float32 packs only for oneDNN."""
    from treeattn.ops import dense_linear

    x, w = torch.randn(33, 576, generator=_G), torch.randn(300, 576, generator=_G) * 0.05
    monkeypatch.setattr(dense_linear, "MKL_VENDORS", (dense_linear.cpu_vendor(),))
    assert not dense_linear.onednn_float32() and dense_linear.prepack_float32(w, 33) is w
    assert torch.equal(dense_linear.linear_float32(x, w), torch.nn.functional.linear(x, w))
    monkeypatch.setattr(dense_linear, "MKL_VENDORS", ())
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    assert dense_linear.onednn_float32() == onednn and dense_linear.prepack_float32(w, 33).is_mkldnn == onednn
    packed = dense_linear.prepack_float32(w, 33)
    assert torch.equal(dense_linear.linear_float32(x, packed), dense_linear.linear_float32(x, w))
    monkeypatch.setattr(dense_linear, "MKL_VENDORS", (dense_linear.cpu_vendor(),))  # the rule changed after packing
    assert torch.equal(dense_linear.linear_float32(x, packed), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("vendors", ["mkl", "onednn"])
def test_the_heads_float32_product_is_within_float32_rounding_and_strict_only(vendors, monkeypatch):
    """ops.dense_linear.linear_float32 (oneDNN's matmul on the CPU, the prompt rows' LM head product): every logit
    within 16 * 2**-24 * sum |x_i w_i| of its float64 dot product (float32 accumulation: 3.1 measured; a bfloat16
    product would be ~2**16 times that); and where torch's float32 matmul precision allows bfloat16 ("medium"), it
    is F.linear's, bit for bit."""
    import doctest

    from treeattn.ops import dense_linear

    monkeypatch.setattr(dense_linear, "MKL_VENDORS", (dense_linear.cpu_vendor(),) if vendors == "mkl" else ())
    x, w = torch.randn(33, 576, generator=_G), torch.randn(300, 576, generator=_G) * 0.05
    got = dense_linear.linear_float32(x, w).double()
    terms = x.double()[:, None, :] * w.double()[None, :, :]
    bound = 16 * 2.0**-24 * terms.abs().sum(dim=-1)
    assert ((got - terms.sum(dim=-1)).abs() <= bound).all()
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert not dense_linear.onednn_float32()
        assert torch.equal(dense_linear.linear_float32(x, w), torch.nn.functional.linear(x, w))
    finally:
        torch.set_float32_matmul_precision(before)
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    assert dense_linear.onednn_float32() == (onednn and vendors == "onednn")
    assert doctest.testmod(dense_linear).failed == 0
