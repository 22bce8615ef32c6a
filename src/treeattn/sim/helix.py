"""Cost model of a whole decode step in a 2-D layout of the ranks: Helix parallelism and its baselines.

Helix (arXiv 2507.07120; TensorRT-LLM's docs/source/features/helix.md) runs each layer's attention over
N = KVP x TPA ranks: TPA (<= the KV heads) ranks split the heads, KVP ranks split the sequence. Every
rank computes the query, key and value projections of its TPA heads from the whole hidden state (the
weights of those projections are replicated across the KVP ranks), attends to its sequence shard, and
the partial states of a TPA slice combine across its KVP ranks. Then the same N ranks run the output
projection, the MLP and the LM head as N-way tensor parallelism: column- then row-parallel, one
all-reduce of the hidden state after the output projection and one after the MLP; per step, one
all-reduce of the embedded rows (the table split by vocabulary) and an all-gather of the logits.

A step's time is, per layer and rank, a roofline for every kernel (a fixed kernel overhead plus the
larger of bytes / achieved memory bandwidth and FLOPs / achieved peak) plus the exposed communication
(alpha-beta models of `treeattn.sim.collectives`; the paper's HOP-B overlap of the all-to-all with
attention is not priced: the all-to-all is exposed). Layouts (`LAYOUTS`):

    helix     attention KVP x TPA; output projection, MLP and LM head over all N ranks (combined by
              onepass: the output projection over the TPA ranks, see below).
    tp-only   attention TPA = N, KVP = 1: heads split N ways; past the KV heads each rank keeps a
              whole KV head (ceil(K / N) = 1): the cache is duplicated. MLA's latent KV is not split by
              heads at all: every TP rank keeps and reads the whole latent cache.
    kvp-only  attention KVP = N, TPA = 1, combined by onepass (every rank gets every head's output);
              the output projection, MLP and embedding table replicated on every rank; the LM head's
              rows split by vocabulary over N (treeattn's layout before issue 47).
    medha     attention KVP x TPA as helix; the output projection, MLP and LM head over the TPA ranks
              only, replicated across the KVP groups (Medha's layout, the paper's KVP baseline).
    dp-attention  attention data-parallel: each rank attends whole sequences (ceil(B / N) of them) with
              every head and holds the attention weights whole; the MLP and LM head over all N ranks
              on the gathered batch (an all-gather and a reduce-scatter of the hidden states a layer,
              priced as one all-reduce). The usual large-batch baseline (DeepSeek's attention DP).

The helix combine is the paper's all-to-all (`combine="alltoall"`: every rank then holds 1/KVP of its
TPA heads, which is the slice the N-way output projection needs) or treeattn's onepass allreduce
(`combine="onepass"`: every rank gets its TPA heads whole, so, as treeattn's engine does, the output
projection is row-parallel over the TPA ranks only, copied across the KV ranks, its all-reduce over TPA
ranks: none at TPA = 1). MoE layers (DeepSeek) read, per rank, the
expected number of distinct experts a batch activates divided over the FFN ranks (expert or tensor
parallelism read the same bytes); their dispatch is priced as the dense MLP's all-reduce (an
approximation). Groups of ranks are priced as contiguous (one node: exact inside an NVL72 rack).
All-reduces take the faster of NCCL's algorithms and, inside one node, the direct one-shot / two-shot
all-reduce of TensorRT-LLM's custom kernels (`collectives.direct_allreduce`): NCCL's intra-node chain
would charge 2 (p - 1) hops for the small hidden-state messages of decode. The LM head's logits are
gathered the same way (one direct step inside a node). Ranks that are processes of one host (the
calibrated cpu-local preset) share its memory bandwidth, and every collective issued after compute pays
the calibrated busy-round cost of a gloo collective (Cluster.busy_round_seconds).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from treeattn.sim.collectives import NO_COMM, CommCost, all_to_all, direct_allreduce, nccl_allreduce, ring_allgather
from treeattn.sim.hardware import Cluster

LAYOUTS: tuple[str, ...] = ("helix", "tp-only", "kvp-only", "medha", "dp-attention")
COMBINES: tuple[str, ...] = ("alltoall", "onepass")
# bytes per element; fp4 is the paper's 0.5 (block scales not counted), q8_0 and q4_0 are GGUF's blocks
# of 32 weights with one float16 scale (34 and 18 bytes)
ELEMENT_BYTES: dict[str, float] = {
    "float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8_e4m3": 1.0, "fp4": 0.5, "q8_0": 34 / 32, "q4_0": 18 / 32,
}
LSE_BYTES = 4  # the log-sum-exp of a partial state travels in float32
ONEPASS_BYTES = 8  # onepass's packed state travels in float64


def element_bytes(name: str, what: str) -> float:
    """Bytes per element of the storage format `name` (ELEMENT_BYTES); `what` names the argument."""
    if name not in ELEMENT_BYTES:
        raise ValueError(f"{what} must be one of {', '.join(ELEMENT_BYTES)}, got {name!r}")
    return ELEMENT_BYTES[name]


@dataclass(frozen=True)
class ModelShape:
    """The matrices of a decoder that set its decode cost. MLA (DeepSeek-V2/V3) when kv_lora_rank is
    set: kv_heads is then 1 (one latent shared by all heads), head_dim the query-key head size
    (nope + rope_dim) and v_head_dim the value head size. MoE when experts > 0: the first dense_layers
    layers have a dense MLP of width ffn, the others `experts` routed experts of width expert_ffn
    (active_experts of them per token) and shared_experts always-on ones.

    >>> MODELS["llama-3.1-405b"].weight_elements() / 1e9  # doctest: +ELLIPSIS
    405.8...
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    rope_dim: int = 0
    v_head_dim: int | None = None
    experts: int = 0
    active_experts: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def dv(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads a rank of a TPA group of `tp` keeps: ceil(K / tp); past K every rank keeps one (a copy)."""
        return math.ceil(self.kv_heads / tp)

    def kv_elements_per_token(self, tp: int) -> int:
        """Cached elements per token and layer on a rank of a TPA group of `tp`. MLA: the whole latent
        (kv_lora_rank + rope_dim) whatever tp is (it is not split by heads)."""
        if self.mla:
            return self.kv_lora_rank + self.rope_dim
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim

    def attention_flops_per_key(self, tp: int) -> int:
        """FLOPs per query row and cached token on a rank of a TPA group of `tp` (MLA: absorbed, scores
        over the latent + rope part, values over the latent)."""
        per_head = 2 * (self.kv_lora_rank + self.rope_dim + self.kv_lora_rank) if self.mla else 4 * self.head_dim
        return self.heads // tp * per_head

    def combine_dim(self) -> int:
        """Elements per head of a partial output as it is combined (MLA: the latent, as TensorRT-LLM's
        all-to-all sends it)."""
        return self.kv_lora_rank if self.mla else self.dv

    def qkv_elements(self, tp: int) -> int:
        """Weights of the query, key and value projections one rank of a TPA group of `tp` holds."""
        h, heads = self.hidden, self.heads // tp
        if not self.mla:
            return h * heads * self.head_dim + 2 * h * self.kv_heads_per_rank(tp) * self.head_dim
        q_in = self.q_lora_rank or h
        q_a = h * self.q_lora_rank if self.q_lora_rank else 0  # the latents' down-projections are replicated
        kv_a = h * (self.kv_lora_rank + self.rope_dim)
        nope = self.head_dim - self.rope_dim
        return q_a + q_in * heads * self.head_dim + kv_a + self.kv_lora_rank * heads * (nope + self.dv)

    def o_elements(self) -> int:
        return self.heads * self.dv * self.hidden

    def mlp_elements(self, layer: int) -> int:
        """Every weight of layer `layer`'s MLP (all experts)."""
        if self.experts and layer >= self.dense_layers:
            return 3 * self.hidden * self.expert_ffn * (self.experts + self.shared_experts) + self.hidden * self.experts
        return 3 * self.hidden * self.ffn

    def mlp_read_elements(self, layer: int, batch: int) -> float:
        """Weights of layer `layer`'s MLP a step of `batch` tokens reads: for MoE the expected number of
        distinct experts the tokens route to, E (1 - (1 - k / E)^B), plus the shared ones and the router."""
        if self.experts and layer >= self.dense_layers:
            distinct = self.experts * (1 - (1 - self.active_experts / self.experts) ** batch)
            return 3 * self.hidden * self.expert_ffn * (distinct + self.shared_experts) + self.hidden * self.experts
        return 3 * self.hidden * self.ffn

    def mlp_flops(self, layer: int, batch: int) -> float:
        moe = self.experts and layer >= self.dense_layers
        width = (self.active_experts + self.shared_experts) * self.expert_ffn if moe else self.ffn
        return 2 * batch * 3 * self.hidden * width

    def embedding_elements(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def weight_elements(self) -> int:
        """Every weight of the model (norms left out)."""
        layers = sum(self.qkv_elements(1) + self.o_elements() + self.mlp_elements(i) for i in range(self.layers))
        return layers + self.embedding_elements()


MODELS: dict[str, ModelShape] = {m.name: m for m in (
    # config.json of meta-llama/Llama-3.1-405B
    ModelShape("llama-3.1-405b", layers=126, hidden=16384, heads=128, kv_heads=8, head_dim=128, ffn=53248, vocab=128256),
    # config.json of deepseek-ai/DeepSeek-R1 (the DeepSeek-V3 architecture)
    ModelShape("deepseek-r1", layers=61, hidden=7168, heads=128, kv_heads=1, head_dim=192, ffn=18432, vocab=129280,
               q_lora_rank=1536, kv_lora_rank=512, rope_dim=64, v_head_dim=128, experts=256, active_experts=8,
               expert_ffn=2048, shared_experts=1, dense_layers=3),
    # config.json of meta-llama/Llama-3.2-1B (the shape of benchmarks/models/make_llama_gguf.py)
    ModelShape("llama-3.2-1b", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256,
               tied_embeddings=True),
    # config.json of HuggingFaceTB/SmolLM2-135M(-Instruct)
    ModelShape("smollm2-135m", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152,
               tied_embeddings=True),
    # config.json of google/gemma-3-270m (its sliding-window layers are priced as global ones)
    ModelShape("gemma-3-270m", layers=18, hidden=640, heads=4, kv_heads=1, head_dim=256, ffn=2048, vocab=262144,
               tied_embeddings=True),
)}


def shape_from_config(config, name: str) -> ModelShape:
    """The ModelShape of a loaded Llama-family config (treeattn.models.read_config of a checkpoint
    directory or .gguf file: Llama, Qwen2, Mistral, Gemma 3; sliding windows priced as global layers).

    >>> from treeattn.models.llama import LlamaConfig
    >>> c = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    ...                 num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
    >>> shape_from_config(c, "smollm2-135m") == MODELS["smollm2-135m"]
    True
    """
    needed = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    missing = [key for key in needed if not hasattr(config, key)]
    if missing:
        raise ValueError(f"MODEL {name!r}: the cost model prices Llama-family configs; "
                         f"{type(config).__name__} has no {missing[0]}")
    return ModelShape(name, layers=config.num_layers, hidden=config.hidden_size, heads=config.num_heads,
                      kv_heads=config.num_kv_heads, head_dim=config.head_dim, ffn=config.intermediate_size,
                      vocab=config.vocab_size, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


@dataclass(frozen=True)
class Layout:
    """How N = tp x kv ranks share a model: `kind` one of LAYOUTS, tp the attention TP width (TPA),
    kv the sequence shards (KVP).

    >>> Layout.of("helix", nproc=4, tp=2)
    Layout(kind='helix', tp=2, kv=2, dp=1)
    >>> Layout.of("helix", nproc=4, tp=2).ffn_ranks, Layout.of("kvp-only", nproc=4).ffn_ranks
    (4, 1)
    """

    kind: str
    tp: int
    kv: int
    dp: int = 1

    @classmethod
    def of(cls, kind: str, nproc: int, tp: int = 1) -> Layout:
        """The layout `kind` on `nproc` ranks; tp is read only by helix and medha (tp-only: tp = nproc,
        kvp-only: tp = 1)."""
        if kind not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {kind!r}")
        for name, value in (("nproc", nproc), ("tp", tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if kind == "tp-only":
            return cls(kind, nproc, 1)
        if kind == "kvp-only":
            return cls(kind, 1, nproc)
        if kind == "dp-attention":
            return cls(kind, 1, 1, nproc)
        if nproc % tp != 0:
            raise ValueError(f"tp ({tp}) must divide nproc ({nproc}): the sequence is split nproc / tp ways")
        return cls(kind, tp, nproc // tp)

    @property
    def nproc(self) -> int:
        return self.tp * self.kv * self.dp

    @property
    def ffn_ranks(self) -> int:
        """Ranks that split the MLP (and, but for dp-attention, the output projection)."""
        return {"helix": self.nproc, "tp-only": self.nproc, "kvp-only": 1, "medha": self.tp,
                "dp-attention": self.nproc}[self.kind]

    @property
    def o_ranks(self) -> int:
        """Ranks that split the attention's output projection."""
        return 1 if self.kind == "dp-attention" else self.ffn_ranks

    def local_batch(self, batch: int) -> int:
        """Sequences a rank attends to: all of them, but ceil(B / N) with dp-attention."""
        return -(-batch // self.dp)

    @property
    def lm_head_ranks(self) -> int:
        return self.tp if self.kind == "medha" else self.nproc


@dataclass(frozen=True)
class StepPrediction:
    """One decode step (every layer and the LM head) of `batch` sequences of seq_len cached tokens.

    weight_bytes_per_rank: the weights one rank holds; kv_bytes_per_rank: its KV cache (all sequences);
    attention/weights/comm_seconds: the step's time in attention kernels, in the other kernels
    (projections, MLP, LM head) and in exposed communication; predicted_seconds: their sum, the time per
    token (TTL); comm_bytes: bytes the busiest rank sends per step; fits_memory: whether weights + KV fit
    in the cluster's memory_capacity (None if unknown).
    """

    model: str
    layout: str
    nproc: int
    tp: int
    kv: int
    seq_len: int
    batch: int
    combine: str
    weight_bytes_per_rank: float
    kv_bytes_per_rank: float
    attention_seconds: float
    weights_seconds: float
    comm_seconds: float
    predicted_seconds: float
    comm_bytes: float
    fits_memory: bool | None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _kernel_seconds(cluster: Cluster, nbytes: float, flops: float, kernels: int = 1, ranks: int = 1) -> float:
    """Roofline of `kernels` kernels that together read nbytes and compute flops while `ranks` ranks
    work at once: ranks that are processes of one host (host_cores set) share its memory bandwidth
    and, beyond its cores, time-slice (as treeattn.sim.model.attention_seconds)."""
    bandwidth, slowdown = cluster.attention_bandwidth, 1.0
    if cluster.host_cores is not None and cluster.host_memory_bandwidth is not None:
        bandwidth = min(bandwidth, cluster.host_memory_bandwidth / min(ranks, cluster.host_cores))
        slowdown = max(1.0, ranks / cluster.host_cores)
    compute = flops / (cluster.peak_flops * cluster.flops_efficiency)
    return (kernels * cluster.kernel_overhead + max(nbytes / bandwidth, compute)) * slowdown


def _busy(cluster: Cluster, ranks: int) -> CommCost:
    """The calibrated extra cost of one collective issued right after compute among `ranks` ranks
    sharing a host (Cluster.busy_round_seconds; 0 on the GPU presets)."""
    return CommCost(cluster.busy_round_seconds(ranks)[1], 0, 0.0, "busy")


def o_ranks(layout: Layout, combine: str = "alltoall") -> int:
    """Ranks that split the output projection: Layout.o_ranks, but the TPA ranks alone in helix combined by
    onepass (every rank of a KV group then holds its heads' whole output: treeattn's engine).

    >>> o_ranks(Layout.of("helix", 4, tp=2)), o_ranks(Layout.of("helix", 4, tp=2), "onepass")
    (4, 2)
    """
    return layout.tp if layout.kind == "helix" and combine == "onepass" else layout.o_ranks


def weight_bytes_per_rank(model: ModelShape, layout: Layout, weight_dtype: str = "fp4", combine: str = "alltoall") -> float:
    """Weights one rank holds: query/key/value projections / tp (replicated across the KV ranks), the
    output projection / o_ranks(layout, combine), the MLP / ffn_ranks, the embeddings / lm_head_ranks.

    >>> m = MODELS["llama-3.2-1b"]
    >>> one = weight_bytes_per_rank(m, Layout.of("helix", 1), "bfloat16")
    >>> round(weight_bytes_per_rank(m, Layout.of("helix", 4, tp=4), "bfloat16") / one, 3)  # tp = N: 1/N
    0.25
    """
    wb = element_bytes(weight_dtype, "weight_dtype")
    o = model.o_elements() / o_ranks(layout, combine)
    per_layer = [model.qkv_elements(layout.tp) + o + model.mlp_elements(i) / layout.ffn_ranks for i in range(model.layers)]
    return wb * (sum(per_layer) + embedding_elements_per_rank(model, layout))


def embedding_elements_per_rank(model: ModelShape, layout: Layout) -> float:
    """The token embedding and LM head one rank holds: split by vocabulary over lm_head_ranks, but in
    kvp-only (treeattn before issue 47) the embedding table is whole on every rank and only the LM
    head's rows are split (a tied table: held whole).

    >>> m = MODELS["llama-3.2-1b"]  # tied
    >>> embedding_elements_per_rank(m, Layout.of("kvp-only", 4)) == m.vocab * m.hidden
    True
    """
    table = model.vocab * model.hidden
    if layout.kind != "kvp-only":
        return model.embedding_elements() / layout.lm_head_ranks
    return table if model.tied_embeddings else table + table / layout.lm_head_ranks


def allreduce(cluster: Cluster, ranks: int, nbytes: float) -> CommCost:
    """The faster of NCCL's all-reduce and, when the ranks share a node, the direct one.

    >>> from treeattn.sim import PRESETS
    >>> allreduce(PRESETS["gb200-nvl72"], 64, 4096).algorithm  # one hidden state of 2048 bf16
    'one-shot'
    >>> allreduce(PRESETS["gb200-nvl72"], 64, 32768).algorithm
    'two-shot'
    """
    cost = nccl_allreduce(cluster, ranks, nbytes)
    if ranks > 1 and cluster.nodes(ranks) == 1:
        direct = direct_allreduce(cluster, ranks, nbytes)
        cost = direct if direct.seconds < cost.seconds else cost
    return cost


def allgather(cluster: Cluster, ranks: int, nbytes: float) -> CommCost:
    """All-gather of nbytes per rank: NCCL's ring, or inside one node one direct step (every rank
    writes its piece to every peer at once), whichever is faster."""
    cost = ring_allgather(cluster, ranks, nbytes)
    if ranks > 1 and cluster.nodes(ranks) == 1:
        sent = (ranks - 1) * nbytes
        direct = CommCost(cluster.collective_overhead + cluster.intra.latency + sent / cluster.intra.bandwidth, 1, sent, "direct")
        cost = direct if direct.seconds < cost.seconds else cost
    return cost


def _combine_cost(cluster: Cluster, model: ModelShape, layout: Layout, batch: int, act: float, combine: str) -> CommCost:
    """The partial states of a TPA slice combined across its KV ranks."""
    if layout.kv == 1:
        return NO_COMM
    heads = model.heads // layout.tp
    if layout.kind == "helix" and combine == "alltoall":
        return all_to_all(cluster, layout.kv, batch * heads * (model.combine_dim() * act + LSE_BYTES))
    cost = allreduce(cluster, layout.kv, (batch * heads * (model.combine_dim() + 1) + 1) * ONEPASS_BYTES)
    return CommCost(cost.seconds + cluster.host_read_seconds, cost.rounds, cost.bytes_sent, "onepass")


def layer_read_bytes(model: ModelShape, layout: Layout, layer: int, seq_len: int, batch: int,
                     sizes: tuple[float, float, float], combine: str = "alltoall") -> tuple[float, float]:
    """(KV cache bytes, weight bytes) one rank reads in layer `layer` of a decode step; sizes are the
    bytes per element of (weights, KV cache, activations). The paper's roofline (its appendix) in
    bytes: KV B x 2 ceil(K / TPA) Hsz x S / KVP, weights (Q / TPA + ceil(K / TPA)) H Hsz + the output
    projection + 3 H F / TPF.

    >>> m = MODELS["llama-3.1-405b"]
    >>> kv, w = layer_read_bytes(m, Layout.of("helix", 64, tp=8), 0, 1_000_000, 8, (0.5, 0.5, 2))
    >>> kv == 8 * 2 * 1 * 128 * 125_000 * 0.5
    True
    """
    wb, kvb, _ = sizes
    kv = layout.local_batch(batch) * math.ceil(seq_len / layout.kv) * model.kv_elements_per_token(layout.tp) * kvb
    weights = (model.qkv_elements(layout.tp) + model.o_elements() / o_ranks(layout, combine)
               + model.mlp_read_elements(layer, batch) / layout.ffn_ranks)
    return kv, weights * wb


def _layer_seconds(cluster: Cluster, model: ModelShape, layout: Layout, layer: int, seq_len: int, batch: int,
                   sizes: tuple[float, float, float], combine: str) -> tuple[float, float, CommCost]:
    """(attention seconds, other kernels' seconds, communication) of one layer on the busiest rank."""
    wb, kvb, act = sizes
    tokens, local = math.ceil(seq_len / layout.kv), layout.local_batch(batch)
    kv_read, _ = layer_read_bytes(model, layout, layer, seq_len, batch, sizes, combine)
    n = layout.nproc
    attention = _kernel_seconds(cluster, kv_read, local * tokens * model.attention_flops_per_key(layout.tp), ranks=n)
    qkv = model.qkv_elements(layout.tp)
    o = model.o_elements() / o_ranks(layout, combine)
    mlp_read = model.mlp_read_elements(layer, batch) / layout.ffn_ranks
    weights = (_kernel_seconds(cluster, qkv * wb, 2 * local * qkv, ranks=n)
               + _kernel_seconds(cluster, o * wb, 2 * local * o, ranks=n)
               + _kernel_seconds(cluster, mlp_read * wb, model.mlp_flops(layer, batch) / layout.ffn_ranks, kernels=2, ranks=n))
    comm = _combine_cost(cluster, model, layout, batch, act, combine)
    if layout.kv > 1:
        comm = comm + _busy(cluster, layout.kv)
    if layout.ffn_ranks > 1:  # after the MLP (dp-attention: around the MLP)
        comm = comm + allreduce(cluster, layout.ffn_ranks, batch * model.hidden * act) + _busy(cluster, layout.ffn_ranks)
    split = o_ranks(layout, combine) if layout.kind != "dp-attention" else 1
    if split > 1:  # after the output projection
        comm = comm + allreduce(cluster, split, batch * model.hidden * act) + _busy(cluster, split)
    return attention, weights, comm


def predict_step(cluster: Cluster, model: ModelShape, layout: Layout, seq_len: int, *, batch: int = 1,
                 weight_dtype: str = "fp4", kv_dtype: str = "fp4", activation_dtype: str = "bfloat16",
                 combine: str = "alltoall") -> StepPrediction:
    """Predict one decode step of `model` in `layout` with `batch` sequences of `seq_len` cached tokens.

    >>> from treeattn.sim import PRESETS
    >>> gb200, r1 = PRESETS["gb200-nvl72"], MODELS["deepseek-r1"]
    >>> helix = predict_step(gb200, r1, Layout.of("helix", 64, tp=1), 1_000_000)
    >>> tp = predict_step(gb200, r1, Layout.of("tp-only", 64), 1_000_000)
    >>> tp.kv_bytes_per_rank == 64 * helix.kv_bytes_per_rank  # MLA's latent: TP keeps it whole
    True
    >>> tp.predicted_seconds > helix.predicted_seconds
    True
    """
    for name, value in (("seq_len", seq_len), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {', '.join(COMBINES)}, got {combine!r}")
    if model.heads % layout.tp != 0:
        raise ValueError(f"tp ({layout.tp}) must divide the {model.name}'s {model.heads} query heads")
    sizes = (element_bytes(weight_dtype, "weight_dtype"), element_bytes(kv_dtype, "kv_dtype"),
             element_bytes(activation_dtype, "activation_dtype"))
    attention = weights = 0.0
    comm = NO_COMM
    per_layer: dict[bool, tuple[float, float, CommCost]] = {}
    for layer in range(model.layers):
        moe = bool(model.experts) and layer >= model.dense_layers
        if moe not in per_layer:
            per_layer[moe] = _layer_seconds(cluster, model, layout, layer, seq_len, batch, sizes, combine)
        a, w, c = per_layer[moe]
        attention, weights, comm = attention + a, weights + w, comm + c
    lm = model.vocab * model.hidden / layout.lm_head_ranks
    weights += _kernel_seconds(cluster, lm * sizes[0], 2 * batch * lm, ranks=layout.nproc)
    comm = comm + allgather(cluster, layout.lm_head_ranks, batch * model.vocab / layout.lm_head_ranks * 4)
    comm = comm + _busy(cluster, layout.lm_head_ranks)
    if layout.kind != "kvp-only" and layout.lm_head_ranks > 1:  # the vocabulary-split embedding's rows
        comm = comm + allreduce(cluster, layout.lm_head_ranks, batch * model.hidden * sizes[2])
    kv_bytes = (layout.local_batch(batch) * model.layers * math.ceil(seq_len / layout.kv)
                * model.kv_elements_per_token(layout.tp) * sizes[1])
    held = weight_bytes_per_rank(model, layout, weight_dtype, combine)
    fits = None if cluster.memory_capacity is None else held + kv_bytes <= cluster.memory_capacity
    return StepPrediction(
        model=model.name, layout=layout.kind, nproc=layout.nproc, tp=layout.tp, kv=layout.kv, seq_len=seq_len,
        batch=batch, combine=combine if layout.kind == "helix" and layout.kv > 1 else ("onepass" if layout.kv > 1 else "none"),
        weight_bytes_per_rank=held, kv_bytes_per_rank=kv_bytes, attention_seconds=attention, weights_seconds=weights,
        comm_seconds=comm.seconds, predicted_seconds=attention + weights + comm.seconds, comm_bytes=comm.bytes_sent,
        fits_memory=fits,
    )


def helix_tp_choices(model: ModelShape, nproc: int) -> list[int]:
    """The attention TP widths Helix allows on `nproc` ranks: divisors of nproc that divide the KV heads
    (TPA <= K: no KV head is duplicated) and the query heads.

    >>> helix_tp_choices(MODELS["smollm2-135m"], 6), helix_tp_choices(MODELS["deepseek-r1"], 8)
    ([1, 3], [1])
    """
    return [t for t in range(1, nproc + 1) if nproc % t == 0 and model.kv_heads % t == 0 and model.heads % t == 0]
