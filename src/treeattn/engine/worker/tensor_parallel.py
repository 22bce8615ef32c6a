"""Tensor parallelism beside the sharded KV cache (the Helix layout): the plan applied to a loaded model from outside.

    layout = HelixLayout(world_size=4, tp=2, rank=r)      # rank r -> (kv_index r // 2, tp_index r % 2)
    cuts = tensor_parallel_cuts(model.config, layout)      # parameter name -> Cut: this rank's share of it
    groups = helix_groups(layout)                          # collective: the KV and TP subgroups (new_group)
    shard_model(model, cuts)                               # a loaded model keeps its share (loaders read only it)
    connect(model, layout, cuts, world_group, groups.tp)   # head counts and the all-reduces (RankRunner does it)

N ranks = T tensor-parallel ranks x N / T KV ranks (TensorRT-LLM's Helix, arXiv 2507.07120). The
model classes stay free of ranks (like gpt-fast's tp.py and torchtitan's parallelize functions):
this module narrows their parameters and hooks two modules per block. One layer's data flow on
rank (j, t) (kv index j, tp index t), for a model of Hq query and Hkv KV heads, hidden size d:

    x (replicated) -> q/k/v_proj, column-parallel by heads over the TP dimension: rank t computes its
        Hq / T query heads and their KV heads (Hkv / T of them, or when T > Hkv the one KV head its
        queries share: KV heads are then replicated T / Hkv times)
    -> its KV shard's attention over its heads, combined across the KV dimension (the KV group of
        slice t: onepass, one collective, as without tensor parallelism): every rank of slice t
        holds its heads' whole attention output (B, S, Hq / T * D)
    -> o_proj, row-parallel over the TP group (T ranks): rank (j, t) multiplies slice t's columns,
        all of them (it holds its heads' whole output); ALL-REDUCE (sum) over the TP group gives
        o_proj(x) on every rank (T = 1: no collective, o_proj whole on every rank)
    -> MLP over all N ranks: gate/up column-parallel (rank r: its N-th of the intermediate rows),
        down row-parallel on the same columns; ALL-REDUCE (sum) over the N ranks.

Per layer: one combine over the KV group (N / T ranks; none when T = N), one all-reduce of the step's
hidden rows (B * S * d values) over the TP group (none when T = 1) and one over the N ranks. Per step:
one all-reduce of the embedded rows (the table is split by vocabulary: each rank looks up its rows,
the others give zeros) and the LM head's all-gather of the logits (each rank its N-th of the
vocabulary, as today). o_proj over the TP group rather than over all N ranks: splitting it over the
KV ranks too would cost an all-reduce over N a layer to save (1 - T / N) of a matrix the size of q's
(SmolLM2 on 2 ranks at T = 1: 30 collectives a token for 166K weights a layer).

Weights a rank holds: attention's q/k/v and o_proj / T, MLP / N, embeddings and LM head / N (a tied
table once). Splits along a matrix's input dimension (o_proj, down_proj) land on multiples of 32
columns wherever the share allows, so a packed GGUF matrix splits on its block boundaries; a packed
matrix whose share does not is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from treeattn.engine.errors import ConfigError
from treeattn.models.shards import Cut, shard_model
from treeattn.parallel import comm

ALIGN = 32
"""Input-dimension splits land on multiples of this many columns where the share allows: a GGUF block."""


@dataclass(frozen=True)
class HelixLayout:
    """N = world_size ranks as tp tensor-parallel x world_size // tp KV ranks; this is `rank`.

    Rank r is tp index r % tp and kv index r // tp: the ranks of one KV group (the same heads, the
    sequence sharded) are tp apart, the ranks of one TP group (the same sequence shard) adjacent.

    Example::

        >>> layout = HelixLayout(world_size=4, tp=2, rank=3)
        >>> layout.kv, layout.kv_index, layout.tp_index, layout.kv_members(1), layout.tp_members(1)
        (2, 1, 1, [1, 3], [2, 3])
    """

    world_size: int
    tp: int
    rank: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world_size % self.tp:
            raise ConfigError("tp", f"tp must divide nproc={self.world_size}, got tp={self.tp}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def kv(self) -> int:
        return self.world_size // self.tp

    @property
    def kv_index(self) -> int:
        return self.rank // self.tp

    @property
    def tp_index(self) -> int:
        return self.rank % self.tp

    def kv_members(self, tp_index: int) -> list[int]:
        """Group ranks of the KV group of tensor-parallel slice `tp_index`, in kv-index order."""
        return [tp_index + self.tp * j for j in range(self.kv)]

    def tp_members(self, kv_index: int) -> list[int]:
        return [kv_index * self.tp + t for t in range(self.tp)]


@dataclass
class HelixGroups:
    """The process groups of a layout: kv (this rank's KV group: its slice's ranks that shard the
    sequence), tp (this rank's TP group) and world (the group of all N ranks; None: the default)."""

    layout: HelixLayout
    kv: object
    tp: object
    world: object


def helix_groups(layout: HelixLayout, group=None) -> HelixGroups:
    """Collective over `group` (None: the world): every rank makes every KV and TP subgroup with
    torch.distributed.new_group, in the same order; returns this rank's."""
    if layout.world_size == 1:  # one process, perhaps without torch.distributed: nothing to make
        return HelixGroups(layout, group, group, group)
    to_global = [comm.global_rank(group, r) for r in range(layout.world_size)]
    kv = tp = None
    for t in range(layout.tp):
        made = dist.new_group([to_global[r] for r in layout.kv_members(t)])
        kv = made if t == layout.tp_index else kv
    for j in range(layout.kv):
        made = dist.new_group([to_global[r] for r in layout.tp_members(j)])
        tp = made if j == layout.kv_index else tp
    return HelixGroups(layout, kv, tp, group)


def split_bounds(length: int, parts: int, align: int = 1) -> list[int]:
    """parts + 1 bounds splitting [0, length) into near-equal parts, on multiples of `align` when
    length is one and the parts stay near-equal: the units of `align` divide evenly, or there are at
    least 8 a part (a part then differs from another by one unit at most); else on multiples of 1.

    >>> split_bounds(128, 2, 32), split_bounds(96, 2, 32), split_bounds(10, 4), split_bounds(288, 2, 32)
    ([0, 64, 128], [0, 48, 96], [0, 2, 5, 7, 10], [0, 144, 288])
    >>> split_bounds(8192 + 32, 3, 32)[1] % 32
    0
    """
    units = length // align
    unit = align if length % align == 0 and units >= parts and (units % parts == 0 or units >= 8 * parts) else 1
    units = length // unit
    return [(i * units // parts) * unit for i in range(parts + 1)]


def _heads(config, layout: HelixLayout) -> tuple[slice, slice]:
    """This rank's query heads and KV heads (ranges of head indices)."""
    t, tp, hq, hkv = layout.tp_index, layout.tp, config.num_heads, config.num_kv_heads
    q = slice(t * hq // tp, (t + 1) * hq // tp)
    if hkv % tp == 0:
        return q, slice(t * hkv // tp, (t + 1) * hkv // tp)
    kv = t // (tp // hkv)  # tp % hkv == 0 (check_tensor_parallel): this slice's queries share one KV head
    return q, slice(kv, kv + 1)


def check_tensor_parallel(config, tp: int, nproc: int) -> None:
    """What a model of `config` needs of tp (ConfigError naming tp, one line): a family this plan
    covers, query heads divisible by tp, and KV heads that tp divides or that divide tp."""
    hq, hkv = config.num_heads, config.num_kv_heads
    if nproc % tp:
        raise ConfigError("tp", f"tp={tp} must divide nproc={nproc}")
    if hq % tp:
        raise ConfigError("tp", f"tp={tp} must divide the model's {hq} query heads")
    if hkv % tp and tp % hkv:
        raise ConfigError("tp", f"tp={tp}: the model's {hkv} KV heads can neither be split {tp} ways nor replicated "
                                f"(tp must divide {hkv} or be a multiple of it)")
    if config.vocab_size < nproc:
        raise ConfigError("tp", f"tp={tp}: a vocabulary of {config.vocab_size} cannot be split over nproc={nproc} ranks")


def check_block_cuts(config, tp: int, nproc: int, block: int = ALIGN) -> None:
    """For a checkpoint whose matrices may be kept packed (a GGUF file, weight_format not "dequantize";
    `block`: its o_proj / down_proj blocks' width, 256 for K-quants): every rank's input-dimension
    share must start and end on a block; ConfigError naming tp (one line) otherwise, before any rank starts."""
    for rank in range(nproc):
        cuts = tensor_parallel_cuts(config, HelixLayout(nproc, tp, rank))
        for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
            cut = cuts.get(name)
            if cut is not None and (cut.start % block or cut.stop % block):
                raise ConfigError("tp", f"tp={tp} on nproc={nproc}: rank {rank}'s columns [{cut.start}, {cut.stop}) of "
                                        f"{name.removeprefix('layers.0.')} are not whole blocks of {block} packed weights; "
                                        "use weight_format='dequantize' or another layout")


def _is_mla(config) -> bool:
    from treeattn.models.deepseek import DeepseekConfig

    return isinstance(config, DeepseekConfig)


def _o_cut(config, layout: HelixLayout) -> Cut:
    """o_proj's columns of this rank: its slice's heads' columns, all of them (after the combine every rank of
    a KV group holds those heads' whole output): row-parallel over the TP group, copied across the KV ranks."""
    q = _heads(config, layout)[0]
    unit = config.v_head_dim if _is_mla(config) else config.head_dim
    return Cut(1, q.start * unit, q.stop * unit)


def _mlp_cuts(prefix: str, intermediate: int, layout: HelixLayout) -> dict[str, Cut]:
    """A gated MLP's (gate/up column-parallel, down row-parallel) cuts over all ranks."""
    b, r = split_bounds(intermediate, layout.world_size, ALIGN), layout.rank
    cuts = {f"{prefix}{proj}.{kind}": Cut(0, b[r], b[r + 1]) for proj in ("gate_proj", "up_proj") for kind in ("weight", "bias")}
    cuts[prefix + "down_proj.weight"] = Cut(1, b[r], b[r + 1])
    return cuts


def _attention_cuts(config, layout: HelixLayout, a: str) -> dict[str, Cut]:
    """One attention layer's cuts: Llama's q/k/v by heads; MLA's query and up-projections by heads
    (its latent projection whole: the latent cache is every head's); o_proj by columns."""
    q, kv = _heads(config, layout)
    cuts = {a + "o_proj.weight": _o_cut(config, layout)}
    if _is_mla(config):
        per = (("q_proj" if config.q_lora_rank is None else "q_b_proj", config.qk_head_dim),
               ("kv_b_proj", config.qk_nope_head_dim + config.v_head_dim))
        cuts.update({f"{a}{proj}.weight": Cut(0, q.start * size, q.stop * size) for proj, size in per})
        return cuts
    hd = config.head_dim
    for proj, heads in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        for kind in ("weight", "bias"):
            cuts[f"{a}{proj}.{kind}"] = Cut(0, heads.start * hd, heads.stop * hd)
    return cuts


def _layer_mlp_cuts(config, layout: HelixLayout, i: int) -> dict[str, Cut]:
    """Layer i's MLP cuts: the dense MLP's, or each routed and shared expert's (DeepSeek MoE)."""
    m = f"layers.{i}.mlp."
    if not (_is_mla(config) and config.n_routed_experts > 0 and i >= config.first_k_dense_replace):
        return _mlp_cuts(m, config.intermediate_size, layout)
    cuts = {}
    for e in range(config.n_routed_experts):
        cuts.update(_mlp_cuts(f"{m}experts.{e}.", config.moe_intermediate_size, layout))
    if config.n_shared_experts:
        cuts.update(_mlp_cuts(f"{m}shared_experts.", config.moe_intermediate_size * config.n_shared_experts, layout))
    return cuts


def tensor_parallel_cuts(config, layout: HelixLayout) -> dict[str, Cut]:
    """Parameter name -> this rank's Cut, for every parameter the layout splits (module doc); the
    others (norms, o_proj's and down_proj's biases, a router, MLA's latent projection) stay whole."""
    n, r = layout.world_size, layout.rank
    cuts: dict[str, Cut] = {}
    for i in range(config.num_layers):
        cuts.update(_attention_cuts(config, layout, f"layers.{i}.self_attn."))
        cuts.update(_layer_mlp_cuts(config, layout, i))
    share = -(-config.vocab_size // n)  # the runner's vocabulary split: rank r has ids [r * share, (r + 1) * share)
    vocab = Cut(0, min(r * share, config.vocab_size), min((r + 1) * share, config.vocab_size))
    cuts["embed_tokens.weight"] = cuts["lm_head.weight"] = vocab
    return cuts


def share_fraction(config, tp: int, nproc: int) -> float:
    """The largest fraction of a model's parameters (of `config`) one rank of the layout holds (the
    engine's memory check), counted on "meta" skeletons (no memory)."""
    from treeattn.models.families import model_class

    def count(model) -> int:
        return sum(p.numel() for p in model.parameters())

    whole = count(model_class(config)(config, device="meta"))
    shares = []
    for rank in range(nproc):
        skeleton = model_class(config)(config, device="meta")
        shard_model(skeleton, tensor_parallel_cuts(config, HelixLayout(nproc, tp, rank)))
        shares.append(count(skeleton))
    return max(shares) / whole


def local_heads(config, layout: HelixLayout) -> tuple[int, int]:
    """(query heads, KV heads) this rank runs."""
    q, kv = _heads(config, layout)
    return q.stop - q.start, kv.stop - kv.start


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary over a group: this rank holds rows [start, stop) of
    it (`table`, an nn.Embedding or a packed one); a lookup gives those rows and zeros for the
    others, and one all-reduce (sum) over `group` gives every rank every row (exactly: one addend
    of each sum is nonzero)."""

    def __init__(self, table: nn.Module, start: int, stop: int, group) -> None:
        super().__init__()
        self.table, self.start, self.stop, self.group = table, start, stop, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = (tokens >= self.start) & (tokens < self.stop)
        local = torch.where(mine, tokens - self.start, torch.zeros_like(tokens))
        if self.stop > self.start:
            rows = self.table(local)
            rows = torch.where(mine[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device)).contiguous()
        else:  # an empty share (a vocabulary smaller than the ranks' shares)
            rows = torch.zeros(*tokens.shape, self.width, dtype=torch.float32, device=tokens.device)
        return comm.all_reduce(rows, dist.ReduceOp.SUM, self.group)

    @property
    def width(self) -> int:
        weight = getattr(self.table, "weight", None)
        return weight.shape[1] if weight is not None else self.table.columns


def _sum_over(group):
    """A forward hook: the module's output, all-reduced (sum) over `group`."""

    def hook(module, args, output):
        return comm.all_reduce(output.contiguous(), dist.ReduceOp.SUM, group)

    return hook


def _bias_once(module: nn.Module, index: int) -> None:
    """A row-parallel layer's bias counts once in the sum: the rank of index 0 in the summing group keeps it,
    the others hold zeros."""
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor) and index != 0:
        with torch.no_grad():
            bias.zero_()


def connect(model: nn.Module, layout: HelixLayout, cuts: dict[str, Cut], group, tp_group=None) -> None:
    """Make a sharded model (shard_model, or a loader's shares) run its layout: every attention
    layer runs its query and KV heads; o_proj all-reduces over this rank's TP group (`tp_group`; None
    where the layout needs none: T = 1, or T = N, whose TP group is `group`), down_proj over `group`
    (all N ranks); the embedding table looks up by vocabulary (VocabParallelEmbedding); a tied LM head
    is the same share of the table. Marks the model (model.helix = layout; model.helix_sums = (o_proj's group or None,
    down_proj's group): what the compiled decode segments sum over, engine.worker.compiled_decode)."""
    if 1 < layout.tp < layout.world_size and tp_group is None:
        raise ValueError(f"tp_group: tp={layout.tp} on {layout.world_size} ranks sums o_proj over its TP group, got None")
    o_group = group if layout.kv == 1 else tp_group
    config = model.config
    heads, kv_heads = local_heads(config, layout)
    for handle in model.__dict__.pop("_helix_hooks", []):  # connected before (an earlier engine): hooked anew
        handle.remove()
    hooks = model.__dict__["_helix_hooks"] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        experts = [*getattr(mlp, "experts", ()), *filter(None, [getattr(mlp, "shared_experts", None)])]
        _bias_once(attn.o_proj, layout.tp_index)  # once in its TP group's sum
        for proj in (e.down_proj for e in experts or [mlp]):
            _bias_once(proj, layout.rank)
        if layout.tp > 1:
            hooks.append(attn.o_proj.register_forward_hook(_sum_over(o_group)))
        hooks.append((mlp if experts else mlp.down_proj).register_forward_hook(_sum_over(group)))  # a MoE: one sum
    vocab = cuts["embed_tokens.weight"]
    table = model.embed_tokens
    table = table.table if isinstance(table, VocabParallelEmbedding) else table
    if model.lm_head is None:  # tied: the head is this rank's rows of the table
        model.lm_head = table
    model.embed_tokens = VocabParallelEmbedding(table, vocab.start, vocab.stop, group)
    model.helix = layout
    model.helix_sums = (o_group if layout.tp > 1 else None, group)  # what the hooks sum over (compiled_decode's too)


def shard_loaded(model: nn.Module, layout: HelixLayout) -> nn.Module:
    """A loaded model holding this rank's share of `layout` (in place; nothing to do for a model a
    loader read as shares: its `helix_cuts`, or one already sharded). Returns the model."""
    if getattr(model, "helix_cuts", None) is None:
        cuts = tensor_parallel_cuts(model.config, layout)
        shard_model(model, cuts)
        model.helix_cuts = cuts
    return model


__all__ = ["ALIGN", "check_block_cuts", "HelixGroups", "HelixLayout", "VocabParallelEmbedding", "check_tensor_parallel",
           "connect",
           "helix_groups", "local_heads", "share_fraction", "shard_loaded", "split_bounds", "tensor_parallel_cuts"]
