"""The layer graph: what the passes know about a traced model.

Everything here is per *sample* (micro-batch size 1) and unsharded; the cost model scales by micro-batch size
and divides by parallel degrees. Names are module FQNs as in ``model.named_modules()``.

- A `Layer` is a weight-bearing leaf module (Linear, HF Conv1D, Embedding, a norm, ...): the unit of a
  tensor-parallel decision.
- A `Unit` is what a pipeline stage owns: one repeated block (``blocks.3``, ``model.layers.3``) or another
  top-level weight-bearing module (``tok``, ``ln_f``, ``lm_head``). Units are listed in execution order.
- An `Edge` is a data-flow path between two layers that passes through no other layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

ACTIVATION_BYTES = 2
"""Bytes of an activation element at the default precision (bf16). The trace records each tensor at its own size
(the model is traced at the plan's precision; dropout masks at 1 byte, as the GPU's fused kernel keeps them)."""


@dataclass(kw_only=True, slots=True)
class Gemm:
    """One matrix product in a forward pass for one sample: [batch] x (m x k) @ (k x n)."""

    batch: int
    """Batch of a bmm (1 for an mm)."""
    m: int
    n: int
    k: int
    batch_scales: bool
    """True when `batch` grows with the micro-batch size (attention bmm); else `m` does (tokens of a Linear)."""
    dtype_bytes: int = ACTIVATION_BYTES
    """Bytes of an operand element: 2 runs at the cluster's 16-bit tensor-core rate, 4 at its fp32 rate."""
    fused: bool = False
    """Part of a fused kernel (attention): operands and product stay on chip, its HBM traffic is its kernel's."""
    inner_split: str | None = None
    """The dimension (``n`` or ``k``) an ``inner`` split of its layer divides (`Layer.inner`); None: none."""
    io_bytes: int = 0
    """A convolution (an implicit GEMM, `partc.passes.measure.conv_gemm`): HBM bytes per sample of its input, read
    once, and its output, written once; its weight (k x n per group) is read once a micro-batch. The m x k operand
    (the im2col matrix) is formed on chip and never stored. 0: a matrix product, whose operands are its
    matrices (`partc.passes.hw.gemm_bytes`)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k


@dataclass(kw_only=True, slots=True)
class Layer:
    """A weight-bearing leaf module."""

    fqn: str
    type: str
    """Class name of the module: ``Linear``, ``Conv1D``, ``Embedding``, ``LayerNorm``, ``LlamaRMSNorm``..."""
    kind: str
    """``linear`` (Linear, HF Conv1D), ``embedding``, ``norm`` or ``other``. Only linear and embedding layers
    can be split by tensor parallelism; the others are replicated."""
    unit: str
    """FQN of the `Unit` that owns this layer."""
    params: dict[str, tuple[int, ...]]
    """Full parameter FQN -> shape, for the parameters this module owns directly (tied duplicates included)."""
    num_params: int
    """Parameters owned by this layer, tied parameters counted once (at their first owner in execution order)."""
    in_features: int = 0
    """Input feature size (Linear/Conv1D), embedding dimension (Embedding), normalized size (norms)."""
    out_features: int = 0
    """Output feature size (Linear/Conv1D); vocabulary size (Embedding)."""
    col_groups: int = 0
    """A colwise split must divide this: attention heads for a projection whose output is viewed as heads (KV
    heads for K/V projections), else `out_features`. For an Embedding, ``rowwise`` shards the vocabulary and
    must divide `out_features`; ``colwise`` shards the embedding dimension."""
    row_groups: int = 0
    """A rowwise split must divide this: heads when the input was reshaped from heads, else `in_features`."""
    fused: int = 1
    """How many tensors the output is split into along features (3 for a fused QKV projection)."""
    split_stop: str = ""
    """Linear layers (and layers that multiply by packed weights, for their ``inner`` split): the first op past
    which the shard analysis cannot carry a colwise split of the output (``aten.unbind.int (unbind): unbind along
    the split dimension``), where a colwise output gets gathered; empty
    when the split reaches the next layers (or the layer is not a Linear). An nn.MultiheadAttention kept whole
    (kind ``other``): why (``pattern: ...``)."""
    inner: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Layers of kind ``other`` that a TP style ``inner`` can split inside (a mixture of experts' packed weights,
    `partc.passes.experts`): parameter FQN -> (dim, fused pieces) of its split. Empty when it cannot; for a layer
    whose ops multiply by its weights, `split_stop` then says why."""
    gemms: list[Gemm] = field(default_factory=list)
    fwd_flops: float = 0.0
    out_bytes: int = 0
    """Bytes of the layer output (16-bit activations)."""
    saved_bytes: int = 0
    """Bytes this layer's ops save for backward (parameters excluded)."""
    memory_bytes: int = 0
    """Bytes read and written by its non-GEMM ops (memory-bound time)."""


@dataclass(kw_only=True, slots=True)
class Unit:
    """What a pipeline stage owns: a repeated block or another top-level weight-bearing module."""

    fqn: str
    kind: str
    """``block`` (an element of a repeated ModuleList), or ``module``."""
    layers: list[str]
    """Layer FQNs in execution order."""
    num_params: int
    """Parameters owned by this unit, tied parameters counted once (at their first owner)."""
    param_bytes_per_tied: dict[str, int] = field(default_factory=dict)
    fwd_flops: float = 0.0
    """All forward FLOPs of the unit (its layers and the ops between them)."""
    core_gemms: list[Gemm] = field(default_factory=list)
    """GEMMs outside layers (attention scores and context); split over heads under TP."""
    saved_bytes: int = 0
    """All activation bytes saved for backward by the unit's ops (parameters excluded)."""
    saved_bytes_core: int = 0
    """The part of `saved_bytes` that selective recomputation drops (Korthikanti et al.'s attention core): what a
    fused attention op saves, less its inputs that the replay needs; for attention written out as matmul /
    softmax / dropout, the tensors with a heads dimension and two sequence dimensions."""
    saved_bytes_replicated: int = 0
    """The part of `saved_bytes` that TP does not divide (Korthikanti et al.'s "10": norm inputs, the inputs of
    colwise layers, what follows a rowwise layer such as its dropout mask)."""
    saved_bytes_replicated_linear: int = 0
    """The part of `saved_bytes_replicated` that linear layers save: the whole inputs of colwise layers, which stay
    whole under sequence parallelism (the program's Linear saves the all-gathered input; Megatron-Core gathers it
    again in backward instead); and what a layer of packed experts saves (`Layer.inner`: it runs on the tokens
    all-gathered)."""
    saved_bytes_fixed: int = 0
    """The part of `saved_bytes` in tensors that need no gradient and are no dropout mask (`measure.NodeStats.
    fixed_bytes`: rotary tables, positions, token ids): whole on every tp rank, also where the op saving them is
    split (counted in `saved_bytes_replicated` then too), and not split along the sequence under sequence
    parallelism."""
    saved_bytes_once: int = 0
    """The part of `saved_bytes_fixed` without the batch (rotary tables, position ids): saved once a micro-batch
    of any size, where the rest of `saved_bytes` grows with its samples."""
    op_saved_bytes: int = 0
    """The part of `saved_bytes` that the ops outside layers save (norms, activations, dropout, attention)."""
    op_saved_bytes_replicated: int = 0
    """The part of `op_saved_bytes` that TP does not divide: the share of those ops' memory-bound work each GPU
    does whole."""
    fused_saved_bytes: int = 0
    """What `Parallel.fuse_pointwise` saves of `saved_bytes` (`partc.passes.fuse`): the tensors only the pointwise
    regions' ops save, less the regions' inputs that nothing else keeps."""
    fused_saved_bytes_replicated: int = 0
    """The part of `fused_saved_bytes` in `saved_bytes_replicated` (the norms' saves and inputs)."""
    fused_gqa_saved_bytes: int = 0
    """What `Parallel.fuse_pointwise` saves beyond `fused_saved_bytes` where attention reads its keys and values
    unrepeated (``enable_gqa``): the repeated ones less the unrepeated ones."""
    fused_gqa_saved_bytes_replicated: int = 0
    fused_input_bytes: int = 0
    """The part of what the pointwise regions keep that enters the unit from before it (a block's first RMSNorm
    keeps the residual stream it receives): at a pipeline stage's first unit, the received input itself."""
    fused_replay_peak_bytes: int = 0
    """The most a pointwise region's replay holds in its backward (what its ops save, and its output), of the
    regions on values TP splits (SwiGLU's); `fused_replay_peak_bytes_replicated` of the others (the norms')."""
    fused_replay_peak_bytes_replicated: int = 0
    fused_replay_bytes: int = 0
    """Bytes the pointwise regions' ops read and write in forward: what their replay in backward moves again."""
    fused_replay_bytes_replicated: int = 0
    """The part of `fused_replay_bytes` of ops on values TP does not split."""
    cp_kv: list[tuple[int, str, int]] = field(default_factory=list)
    """(bytes per sample, the layer that made it, bytes per sample as attention takes it) of each key and value of
    the unit's causal attention (whole sequence; the first before grouped-query attention repeats their heads):
    what context parallelism all-gathers over cp, split over tp where that layer is colwise
    (`partc.passes.cost_axes.cp_bytes`), and what attention then saves for backward."""
    cp_out: list[tuple[int, str]] = field(default_factory=list)
    """(bytes per sample, the layer that made its queries) of the output of each causal attention of the unit
    (whole sequence): under context parallelism the program keeps it twice (`partc.passes.memory._cp_saved_bytes`),
    split over tp where that layer is colwise."""
    input_bytes: int = 0
    """Bytes of activations entering the unit: what full recomputation keeps per micro-batch."""
    memory_bytes: int = 0
    """Bytes read and written by non-GEMM ops outside layers (memory-bound time)."""
    kernels: int = 0
    """GPU kernels one forward of the unit launches (its layers' and the ops between them), whatever the
    micro-batch size: the floor `Cluster.kernel_launch_s` puts under its time."""
    signature: str = ""
    """Equal for units of identical structure (same layer types and shapes): TP decisions are shared."""


@dataclass(kw_only=True, slots=True)
class Edge:
    """Data flow from the output of layer `src` to an input of layer `dst` through non-layer ops."""

    src: str
    dst: str
    bytes: int
    """Bytes of the tensor leaving `src` (16-bit)."""
    shard_ok: bool
    """True when a feature-sharded `src` output can reach `dst` still sharded on its input features (only
    per-feature / per-head ops in between), so a colwise -> rowwise pair needs no collective."""
    routed: bool = False
    """`dst` reads a part of `src`'s output whose size depends on values (the tokens routed to one expert,
    `partc.value_sized`), `bytes` at its expected size: the program converts that part for `dst` alone."""
    index_bytes: int = 0
    """Bytes per sample of the integer tensors `dst` reads from `src` besides (a router's choice of experts): they
    carry no gradient and TP never converts them, but sequence parallelism all-gathers them with the tokens."""


@dataclass(kw_only=True, slots=True)
class RoutedExperts:
    """A mixture of experts written in plain PyTorch whose routing partc follows (`partc.passes.experts_routed.
    routed_splits`): an ``nn.ModuleList`` of identical experts, divided among the ep ranks by module."""

    fqn: str
    """The ``nn.ModuleList``."""
    experts: list[str]
    """Its expert modules, in expert order: rank r of an ep group holds experts [r·E/ep, (r+1)·E/ep)."""
    params: list[str]
    """Every expert's parameters."""
    unit: str
    """The unit holding the first expert (where the plan charges the layer's all-to-alls)."""
    rows: int
    """(token, expert) pairs per sample: tokens x k."""
    hidden: int
    """The tokens' hidden size (the width of a row sent)."""


def _fixed(fixed: list[int], fixed_seq: list[int], i: int, cp: int) -> float:
    """Bytes per micro-batch of the tensors without the batch crossing boundary i: those along the sequence hold
    s/cp positions on a context-parallel rank."""
    whole = fixed[i] if fixed else 0
    seq = fixed_seq[i] if fixed_seq else 0
    return whole - seq + seq / cp if cp > 1 else whole


@dataclass(kw_only=True, slots=True)
class ModelGraph:
    """The traced model, summarized for the passes."""

    name: str
    num_params: int
    """Trainable parameters, tied ones counted once."""
    seq_len: int
    """Tokens per sample (for tokens/s)."""
    units: list[Unit]
    layers: dict[str, Layer]
    edges: list[Edge]
    cut_bytes: list[int]
    """cut_bytes[i]: bytes per sample that cross a pipeline boundary placed after units[i] (len(units) - 1): the
    tensors that carry the batch."""
    cut_grad_bytes: list[int] = field(default_factory=list)
    """The part of `cut_bytes` that needs a gradient (it depends on a parameter): what a pipeline sends back across
    the boundary. Empty: all of it."""
    cut_fixed_bytes: list[int] = field(default_factory=list)
    """cut_fixed_bytes[i]: bytes per micro-batch, whatever its size, that cross the boundary after units[i]: tensors
    computed without a user input (rotary tables broadcast over the batch). Empty: none."""
    cut_grad_fixed_bytes: list[int] = field(default_factory=list)
    """The part of `cut_fixed_bytes` that needs a gradient. Empty: none."""
    cut_fixed_seq_bytes: list[int] = field(default_factory=list)
    """The part of `cut_fixed_bytes` in tensors along the sequence (a dim of `seq_len`: rotary tables 1 x s x d):
    under context parallelism each rank sends its s/cp positions of them. Empty: none."""
    cut_grad_fixed_seq_bytes: list[int] = field(default_factory=list)
    """The part of `cut_fixed_seq_bytes` that needs a gradient. Empty: none."""
    cut_ok: list[bool] = field(default_factory=list)
    """cut_ok[i]: a pipeline boundary after units[i] can be realized, no op before it reads one after it (units
    whose ops read each other both ways stay in one stage) and no tensor whose size depends on values crosses it
    (`cut_value_sized`); empty: every boundary can."""
    cut_value_sized: list[bool] = field(default_factory=list)
    """cut_value_sized[i]: a tensor whose size depends on values (a mixture's routed tokens, `partc.value_sized`)
    would cross the boundary after units[i] (a pipeline sends only shapes known before the step); empty: none."""
    cut_layer_outputs: list[dict[str, tuple[int, int, int]]] = field(default_factory=list)
    """cut_layer_outputs[i]: layer FQN -> (bytes per sample, per micro-batch, of those along the sequence) of that
    layer's own output among what crosses the boundary after units[i] (`cut_bytes`, `cut_fixed_bytes`,
    `cut_fixed_seq_bytes`): a colwise layer's output crosses as each TP rank's part, not gathered
    (`passes.cost_step.gather_bytes`); empty: none."""
    tied: dict[str, str] = field(default_factory=dict)
    """Parameter FQN -> the FQN of the parameter it shares storage with (first in execution order)."""
    first_unit_required: list[str] = field(default_factory=list)
    """Units that must be on the first stage (the embedding)."""
    last_unit_required: list[str] = field(default_factory=list)
    """Units that must be on the last stage (the head feeding the loss)."""
    info: dict[str, object] = field(default_factory=dict)
    """Free-form model facts for the plan's ``model`` section (hidden size, heads, vocab...)."""
    vocab_loss: dict[str, object] = field(default_factory=dict)
    """When the loss is a cross-entropy partc can compute on the vocabulary shards (`partc.vocab_loss`):
    ``head`` (the output layer's FQN), ``output`` (the flat model output it reads, the head's logits) and ``rows``
    (logit rows per sample it reads); empty when not, and `vocab_loss_why` says why."""
    vocab_loss_why: str = ""
    routed_experts: list[RoutedExperts] = field(default_factory=list)
    """Plain-PyTorch mixtures of experts that ep can divide (a layer of packed experts is `Layer.inner`)."""
    sums: list[tuple[str, ...]] = field(default_factory=list)
    """Layers whose outputs are read only through their elementwise sum (a token and a position embedding added,
    `passes.trace._sums`): when every one is colwise, the sum stays split in the program and is converted once
    for all of them (`passes.tp`), not once per layer."""
    edges_into: dict[str, list[str]] = field(init=False, repr=False, compare=False)
    """Layer -> the sources of its in-edges, in `edges` order: indexed once, on construction (the search prices
    hundreds of plans of one graph, each unit's edges read many times; `edges` is not changed afterwards)."""
    edges_out_of: dict[str, list[str]] = field(init=False, repr=False, compare=False)
    """Layer -> the destinations of its out-edges, in `edges` order (as `edges_into`)."""

    def __post_init__(self) -> None:
        self.edges_into, self.edges_out_of = {}, {}
        for e in self.edges:
            self.edges_into.setdefault(e.dst, []).append(e.src)
            self.edges_out_of.setdefault(e.src, []).append(e.dst)

    def boundary_bytes(self, i: int, micro_batch_size: float, cp: int = 1) -> float:
        """Bytes of one micro-batch across the pipeline boundary after units[i] (0 outside the model: before the
        first unit, after the last). `micro_batch_size` in samples a rank holds (b/cp under context parallelism,
        `cost_types.tokens`); a tensor without the batch but along the sequence is cut by `cp` too."""
        if not 0 <= i < len(self.cut_bytes):
            return 0
        return self.cut_bytes[i] * micro_batch_size + _fixed(self.cut_fixed_bytes, self.cut_fixed_seq_bytes, i, cp)

    def boundary_layer_bytes(self, i: int, fqns, micro_batch_size: float, cp: int = 1) -> float:
        """The part of `boundary_bytes` that is the own outputs of layers `fqns` (`cut_layer_outputs`)."""
        if not self.cut_layer_outputs or not 0 <= i < len(self.cut_layer_outputs):
            return 0
        return sum(per_sample * micro_batch_size + _fixed([fixed], [seq], 0, cp)
                   for fqn, (per_sample, fixed, seq) in self.cut_layer_outputs[i].items() if fqn in fqns)

    def boundary_grad_bytes(self, i: int, micro_batch_size: float, cp: int = 1) -> float:
        """The part of `boundary_bytes` that needs a gradient (all of it when the graph does not say)."""
        if not 0 <= i < len(self.cut_bytes):
            return 0
        if not self.cut_grad_bytes:
            return self.boundary_bytes(i, micro_batch_size, cp)
        return (self.cut_grad_bytes[i] * micro_batch_size
                + _fixed(self.cut_grad_fixed_bytes, self.cut_grad_fixed_seq_bytes, i, cp))

    def unit(self, fqn: str) -> Unit:
        for u in self.units:
            if u.fqn == fqn:
                return u
        raise KeyError(fqn)

    def to_networkx(self) -> nx.DiGraph:
        """Layers as nodes (with their attributes), edges as data flow."""
        g = nx.DiGraph()
        for layer in self.layers.values():
            g.add_node(layer.fqn, type=layer.type, kind=layer.kind, unit=layer.unit,
                       num_params=layer.num_params, fwd_flops=layer.fwd_flops)
        for e in self.edges:
            g.add_edge(e.src, e.dst, bytes=e.bytes, shard_ok=e.shard_ok)
        return g
