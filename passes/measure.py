"""Measure an exported graph on meta tensors, node by node: GEMM shapes, bytes moved, bytes saved for backward.

The exported program runs once more under a dispatch mode and ``saved_tensors_hooks``; every kernel and every
tensor autograd saves is attributed to the FX node being interpreted. One sample (micro-batch size 1).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.fx._pytree as fx_pytree
from torch.export.graph_signature import InputKind
from torch.utils.flop_counter import flop_registry

from partc._torch import TorchDispatchMode
from partc.errors import PartcError, first_line
from partc.frames import innermost, stack_trace_frames
from partc.ir import Gemm
from partc.passes.export import GRAD_ENABLED, VALUE_SHAPED_HINT, failure_hint
from partc.passes.same_shapes import SameShapes

aten = torch.ops.aten


# Ops that move no data: aliases not flagged `is_view` (matmul's and reshape's decompositions emit `_unsafe_view`
# of every GEMM output) and allocations that leave memory uninitialized.
NO_TRAFFIC_OPS = (aten._unsafe_view, aten.empty_like, aten.empty, aten.new_empty, aten.empty_strided)
# Dropout runs (as exported, and on meta) as its composite: a floating-point keep-mask drawn by `bernoulli_`,
# scaled by `div_`, then multiplied in. A GPU runs `aten.native_dropout` instead, one fused kernel that reads the
# input and writes the output and a 1-byte bool mask (Korthikanti et al. count the mask at 1 byte too). So a mask
# (the output of `MASK_OPS`) is saved at `MASK_BYTES` per element, and its traffic is that of the fused kernel:
# written once at `MASK_BYTES` by `bernoulli_`, never read or rescaled by the ops that use it.
MASK_OPS = (aten.bernoulli, aten.bernoulli_)
MASK_BYTES = 1
# The attention core that selective recomputation replays (Korthikanti et al.): what a fused attention op saves
# is dropped, except its own inputs, which the replay needs (an input nothing else saves is kept in its place).
# Outside such an op (attention written out as matmul / softmax / dropout), the core is what carries two
# sequence dimensions after a heads dimension (scores, probabilities, their dropout mask).
CORE_OPS = (aten.scaled_dot_product_attention.default,)
# On meta the attention op runs its math decomposition (scores and probabilities materialized, upcast to fp32 for a
# 16-bit input). `measure(..., fused_attention=False)` counts that path at the input's precision (a GPU's unfused
# kernels, as Megatron-LM 2021 ran them); `fused_attention=True` counts what a fused kernel (FlashAttention, or
# memory-efficient attention with a mask) does instead: the same GEMM FLOPs, run in on-chip memory; HBM traffic of
# its inputs and output; saved for backward its inputs, its output and the log-sum-exp (fp32, one per query row and
# head), and no s x s tensor. The kernel writes its output as [batch, seq, heads, head_dim] (a transposed view of
# [..., heads, seq, head_dim]), so the usual transpose-and-reshape after it is a view, not a copy. Selective
# recomputation drops only what the kernel alone keeps (the log-sum-exp): its inputs are needed for the replay and
# its output is the next layer's input.
LSE_BYTES = 4
# GEMMs of a mixture of experts that `flop_registry` does not count (`grouped_gemm` prices them by their shapes), as
# do ops of other namespaces (custom ops) that multiply like one.
GROUPED_GEMM_OPS = (aten._grouped_mm, aten._scaled_grouped_mm)
# Convolutions (Conv1d/2d/3d and their transposes, any groups): priced as the implicit GEMM cuDNN runs
# (`conv_gemm`), with their own HBM traffic (`Gemm.io_bytes`).
CONV_OPS = (aten.convolution, aten._convolution)
# Batch norm in training runs as two kernels on a GPU (PyTorch's batch_norm_collect_statistics, then
# batch_norm_elemt): the first reads the input for the batch's mean and variance, the second reads it again to
# normalize and writes the output. On meta it is one op, whose traffic (input and output once) misses that read.
# Arguments: input, weight, bias, running_mean, running_var, training, ...
BATCH_NORM_OPS = (aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional)


@dataclass(slots=True)
class NodeStats:
    gemms: list[Gemm] = field(default_factory=list)
    conv_flops: float = 0.0
    """FLOPs of other ops `flop_registry` counts that are neither a GEMM nor a convolution."""
    memory_bytes: int = 0
    saved: list[tuple[int, int, bool]] = field(default_factory=list)
    """(storage key, bytes at 16-bit, dropped by selective recomputation) per tensor first saved by this node."""
    fixed: list[tuple[torch.fx.Node, int]] = field(default_factory=list)
    """Of `saved`, the tensors that need no gradient and are no dropout mask (rotary tables and their casts,
    positions, token ids, masks made from positions): (the node whose value it is, an input of this one or this one
    itself; bytes). The same whole tensor on every tp rank whatever splits the op's other inputs, and not along the
    sequence-split stream under sequence parallelism; where the node carries no batch (`passes.cuts`), one a
    micro-batch whatever its size."""
    core_input_bytes: int = 0
    """For an attention-core op: bytes of its inputs that no op saves, which selective recomputation must keep
    to replay it (they offset what it drops)."""
    requires_grad: bool = False
    """Whether the node's output needs a gradient (it depends on a parameter): a pipeline sends one back for it."""
    all_saved: list[tuple[int, int]] = field(default_factory=list)
    """(storage key, bytes) of every tensor this node's ops save, also those saved before (parameters excluded):
    what a program that drops some ops' saves still keeps (`partc.passes.fuse`)."""
    out_key: tuple[int, int] | None = None
    """(storage key, bytes) of the node's output, for the nodes `measure` is asked to `watch`."""
    kernels: int = 0
    """GPU kernels the node launches in forward: one per dispatched op that moves data or computes (views and
    allocations launch none; a fused attention op is one)."""


def activation_bytes(t: torch.Tensor, numel: int | None = None) -> int:
    """Bytes of `t` (or `numel` of its elements): the model is traced at the plan's precision, so its size."""
    numel = t.numel() if numel is None else numel
    return numel * t.element_size()


def grouped_gemm(args: tuple, kwargs: dict, out, core_bytes: int | None = None, fused: bool = False) -> Gemm | None:
    """A GEMM-like op that `flop_registry` does not know, priced by its operand shapes: `aten._grouped_mm` (what
    a mixture of experts runs: `torch.nn.functional.grouped_mm`) and an op of another namespace that multiplies
    like one (Hugging Face's `transformers::grouped_mm_fallback`, a custom op that loops over experts). None when
    the shapes are not those of a product (the op's traffic is then counted as any other op's).

    Shapes of a grouped product (rows sorted by group, `offs` the groups' cumulative row counts):
    ``(S, K) @ (G, K, N) -> (S, N)``: each of the S rows runs through its one group's weight, 2 S K N FLOPs
    whatever the split. In a top-k-of-n MoE the rows are the S = tokens x k (token, expert) pairs, so every token
    pays for exactly k experts, while all n experts' weights are read. How the rows split among the G groups
    depends on the routing, which a meta trace cannot know: it is taken as uniform (S / G rows per group, the
    expected k/n share of the tokens per expert), which sets the per-expert GEMM shape the cost model prices.
    ``(G, M, K) @ (G, K, N) -> (G, M, N)`` is a batched product; ``(M, K) @ (K, N) -> (M, N)`` (an op of another
    namespace) a plain one."""
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or len(tensors) < 2:
        return None
    a, b = tensors[0], tensors[1]
    if not (a.is_floating_point() and b.is_floating_point()):
        return None
    dtype_bytes = core_bytes or a.element_size()
    if a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[1] and tuple(out.shape) == (a.shape[0], b.shape[2]):
        rows, groups = a.shape[0], b.shape[0]
        batch, m = (groups, rows // groups) if rows % groups == 0 else (1, rows)
        return Gemm(batch=batch, m=m, n=b.shape[2], k=a.shape[1], batch_scales=False, dtype_bytes=dtype_bytes,
                    fused=fused)
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1] \
            and tuple(out.shape) == (a.shape[0], a.shape[1], b.shape[2]):
        return Gemm(batch=a.shape[0], m=a.shape[1], n=b.shape[2], k=a.shape[2], batch_scales=False,
                    dtype_bytes=dtype_bytes, fused=fused)
    if a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and tuple(out.shape) == (a.shape[0], b.shape[1]):
        return Gemm(batch=1, m=a.shape[0], n=b.shape[1], k=a.shape[1], batch_scales=False, dtype_bytes=dtype_bytes,
                    fused=fused)
    return None


def conv_gemm(args: tuple, out) -> Gemm | None:
    """A convolution (``aten.convolution``: input, weight, bias, stride, padding, dilation, transposed,
    output_padding, groups) as the implicit GEMM cuDNN runs for it, per group (``batch`` = groups):

    * m = output pixels (``N x prod(out spatial)``), n = output channels / groups, k = input channels / groups x
      kernel volume: each output pixel's channels are a dot product of its receptive field with the filters;
    * transposed (the data gradient of a convolution): m = input pixels (``N x prod(in spatial)``), n = output
      channels / groups, k = input channels / groups x kernel volume: each input pixel scatters into kernel
      volume outputs, so a stride leaves no zeros to multiply.

    ``2 batch m n k`` are the FLOPs `torch.utils.flop_counter` counts for the op. Its HBM traffic is the input
    and output once (`Gemm.io_bytes`) and the weight, not the m x k operand. None when the shapes are not those
    of a convolution (its traffic is then counted as any other op's)."""
    if len(args) < 9 or not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    x, w, transposed, groups = args[0], args[1], bool(args[6]), int(args[8])
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) or x.dim() < 3 or w.dim() != x.dim() \
            or groups < 1:
        return None
    kvol = math.prod(int(d) for d in w.shape[2:])
    if transposed:
        m = int(x.shape[0]) * math.prod(int(d) for d in x.shape[2:])
        n, k = int(w.shape[1]), int(w.shape[0]) // groups * kvol
    else:
        m = int(out.shape[0]) * math.prod(int(d) for d in out.shape[2:])
        n, k = int(w.shape[0]) // groups, int(w.shape[1]) * kvol
    dtype_bytes = x.element_size()
    return Gemm(batch=groups, m=m, n=n, k=k, batch_scales=False, dtype_bytes=dtype_bytes,
                io_bytes=(x.numel() + out.numel()) * dtype_bytes)


class _Recorder(TorchDispatchMode):
    """Attributes dispatched kernels to the FX node being interpreted."""

    def __init__(self):
        super().__init__()
        self.node: torch.fx.Node | None = None
        self.core_bytes: int | None = None
        """While an attention core runs: its input's element size, at which its GEMMs and (unfused) internals are
        counted. PyTorch's math kernel upcasts 16-bit inputs to fp32; a GPU's kernels (Megatron-LM's fused softmax,
        FlashAttention) compute at the input's precision with fp32 accumulation on chip."""
        self.fused_core = False
        """While a fused attention core runs: only its GEMMs are recorded (`measure` adds the rest)."""
        self.stats: dict[torch.fx.Node, NodeStats] = defaultdict(NodeStats)
        self.inputs: dict[int, torch.fx.Node] = {}
        """While a node runs: the storage of each of its tensor inputs -> the node that made it."""
        self.mask_storages: set[int] = set()
        """Storages of dropout keep-masks (outputs of `MASK_OPS`): saved at `MASK_BYTES` per element."""
        self._masks: list[torch.Tensor] = []  # kept alive so that no other tensor reuses a mask's storage key

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in MASK_OPS and isinstance(out, torch.Tensor):
            self.mask_storages.add(out.untyped_storage()._cdata)
            self._masks.append(out)
            if self.node is not None:
                self.stats[self.node].memory_bytes += out.numel() * MASK_BYTES
            return out
        if self.node is None:
            return out
        st = self.stats[self.node]
        if not func.is_view and packet not in NO_TRAFFIC_OPS and not self.fused_core:
            st.kernels += 1
        if packet in (aten.mm, aten.addmm):
            a, b = (args[1], args[2]) if packet is aten.addmm else (args[0], args[1])
            st.gemms.append(Gemm(batch=1, m=a.shape[0], n=b.shape[1], k=a.shape[1], batch_scales=False,
                                 dtype_bytes=self.core_bytes or a.element_size(), fused=self.fused_core))
        elif packet in (aten.bmm, aten.baddbmm):
            a, b = (args[1], args[2]) if packet is aten.baddbmm else (args[0], args[1])
            st.gemms.append(Gemm(batch=a.shape[0], m=a.shape[1], n=b.shape[2], k=a.shape[2], batch_scales=True,
                                 dtype_bytes=self.core_bytes or a.element_size(), fused=self.fused_core))
        elif packet in CONV_OPS and (gemm := conv_gemm(args, out)) is not None:
            st.gemms.append(gemm)
        elif packet in flop_registry:
            st.conv_flops += float(flop_registry[packet](*args, **kwargs, out_val=out))
        elif (packet in GROUPED_GEMM_OPS or func.namespace not in ("aten", "prims")) and \
                (gemm := grouped_gemm(args, kwargs, out, self.core_bytes, self.fused_core)) is not None:
            st.gemms.append(gemm)
        elif packet is aten._to_copy and self.core_bytes is not None:
            pass  # the math kernel's upcast of 16-bit inputs to fp32 and back: counted at input precision, as fused
        elif not func.is_view and packet not in NO_TRAFFIC_OPS and not self.fused_core:
            tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
            outs = out if isinstance(out, (tuple, list)) else [out]
            tensors += [x for x in outs if isinstance(x, torch.Tensor)]
            st.memory_bytes += sum(self.bytes(x) for x in tensors
                                   if x.untyped_storage()._cdata not in self.mask_storages)
            if packet in BATCH_NORM_OPS and len(args) > 5 and args[5] is True and isinstance(args[0], torch.Tensor):
                st.memory_bytes += self.bytes(args[0])  # the statistics pass (`BATCH_NORM_OPS`)
                st.kernels += 1
        return out

    def bytes(self, t: torch.Tensor, numel: int | None = None) -> int:
        """`activation_bytes`, inside an unfused attention core at its input's element size."""
        if self.core_bytes is not None and t.is_floating_point():
            return (t.numel() if numel is None else numel) * self.core_bytes
        return activation_bytes(t, numel)


def measure(ep: torch.export.ExportedProgram, args: tuple, kwargs: dict, seq_len: int | None, *,
            fused_attention: bool = False, watch: frozenset = frozenset()) -> dict[torch.fx.Node, NodeStats]:
    """Run the exported program on meta, node by node; return per-node GEMMs, bytes moved and bytes saved. With
    `fused_attention` the attention op is counted as a fused kernel (see `CORE_OPS`). `watch`: nodes whose output's
    storage is recorded (`NodeStats.out_key`) and kept alive, so that no later tensor takes its key."""
    # The lifted graph (parameters and buffers are its first inputs), not `ep.module()`: unlifting writes the
    # model's module names into Python source unescaped (torch.fx), and a name holding a quote or a line break
    # (an `nn.ModuleDict` key may) breaks that source.
    gm = ep.graph_module
    flat = ep._graph_module_flat_inputs(args, kwargs)
    kinds = [s.kind for s in ep.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
    state = flat[:len(kinds)]  # parameters, buffers and constants, in the signature's order
    for kind, t in zip(kinds, state):
        if kind == InputKind.PARAMETER:
            t.requires_grad_(True)
    param_storages = {t.untyped_storage()._cdata for t in state if isinstance(t, torch.Tensor)}
    ep_nodes = {n.name: n for n in ep.graph.nodes}
    recorder = _Recorder()
    seen_storages: set[int] = set()
    core_inputs: dict[torch.fx.Node, dict[int, int]] = {}  # attention-core node -> input storage -> bytes
    alive: list[torch.Tensor] = []  # the inputs of core nodes, kept so that no later tensor reuses their keys

    def storage_bytes(t: torch.Tensor) -> int:
        numel = t.untyped_storage().nbytes() // max(t.element_size(), 1)
        return numel * MASK_BYTES if t.untyped_storage()._cdata in recorder.mask_storages else recorder.bytes(t, numel)

    def pack(t: torch.Tensor):
        node = recorder.node
        if node is None or recorder.fused_core:
            return t
        key = t.untyped_storage()._cdata
        if key not in param_storages:
            recorder.stats[node].all_saved.append((key, storage_bytes(t)))
        if key in param_storages or key in seen_storages:
            return t
        seen_storages.add(key)
        if node in core_inputs:
            core = key not in core_inputs[node]
        else:  # [.., heads, s, s] (or [heads, s, s]); not a [1, s, h] hidden state of a model whose h equals s
            core = (seq_len is not None and t.dim() >= 3 and t.shape[-3] > 1 and t.shape[-1] == seq_len
                    and t.shape[-2] == seq_len)
        recorder.stats[node].saved.append((key, storage_bytes(t), core))
        if not t.requires_grad and key not in recorder.mask_storages:
            recorder.stats[node].fixed.append((recorder.inputs.get(key, node), storage_bytes(t)))
        return t

    def fused_core_saved(node: torch.fx.Node, inputs: list[torch.Tensor], out: torch.Tensor) -> None:
        """What a fused attention kernel moves and saves (see `CORE_OPS`): its inputs and output, and the log-sum-exp
        (core)."""
        st = recorder.stats[node]
        st.kernels += 1
        st.memory_bytes += sum(activation_bytes(a) for a in inputs) + activation_bytes(out)
        for a in (*inputs, out):
            key = a.untyped_storage()._cdata
            if key not in param_storages:
                st.all_saved.append((key, storage_bytes(a)))
            if key not in param_storages and key not in seen_storages:
                seen_storages.add(key)
                st.saved.append((key, storage_bytes(a), False))
        st.saved.append((-id(node), out.numel() // out.shape[-1] * LSE_BYTES, True))

    class Interp(torch.fx.Interpreter):
        def run_node(self, n):
            recorder.node = ep_nodes.get(n.name)
            recorder.inputs = {v.untyped_storage()._cdata: ep_nodes.get(x.name, x) for x in n.all_input_nodes
                               for v in [self.env.get(x)] if isinstance(v, torch.Tensor)}
            core = n.op == "call_function" and n.target in CORE_OPS and recorder.node is not None
            if core:
                inputs = [a for a in fx_pytree.tree_flatten(self.fetch_args_kwargs_from_env(n))[0]
                          if isinstance(a, torch.Tensor)]
                core_inputs[recorder.node] = {a.untyped_storage()._cdata: storage_bytes(a) for a in inputs
                                              if a.untyped_storage()._cdata not in param_storages}
                alive.extend(inputs)
                recorder.fused_core = fused_attention
                recorder.core_bytes = inputs[0].element_size()
            try:
                mode = (recorder.node or n).meta.get(GRAD_ENABLED)  # a no_grad region's op saves nothing
                with torch.set_grad_enabled(torch.is_grad_enabled() if mode is None else mode):
                    out = super().run_node(n)
                if recorder.node is not None and recorder.node in watch and isinstance(out, torch.Tensor):
                    alive.append(out)
                    recorder.stats[recorder.node].out_key = (out.untyped_storage()._cdata, storage_bytes(out))
                if recorder.node is not None:
                    recorder.stats[recorder.node].requires_grad = any(
                        isinstance(x, torch.Tensor) and x.requires_grad for x in fx_pytree.tree_flatten(out)[0])
                if core and fused_attention:
                    if out.dim() >= 3:  # the kernel's [..., seq, heads, head_dim] layout
                        out = out.transpose(-3, -2).contiguous().transpose(-3, -2)
                    recorder.fused_core = False
                    fused_core_saved(recorder.node, inputs, out)
                    alive.append(out)
                return out
            except Exception as e:  # noqa: BLE001 - an op that exported but cannot run on meta (data-dependent)
                raise PartcError(_node_failure(ep_nodes.get(n.name, n), e)) from None
            finally:
                recorder.node, recorder.core_bytes, recorder.fused_core = None, None, False

    # SameShapes below the recorder: the recorder sees every op; a repeated op (same shapes) is not run again.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), SameShapes(), recorder:
        interp = Interp(gm)
        interp.extra_traceback = False  # the PartcError of run_node is one line
        interp.run(*flat)
    kept: set[int] = set()
    for node, inputs in core_inputs.items():
        for key, nbytes in inputs.items():
            if key not in seen_storages and key not in kept:
                kept.add(key)
                recorder.stats[node].core_input_bytes += nbytes
    return recorder.stats


def _node_failure(n: torch.fx.Node, e: Exception) -> str:
    """One line for an exported op that fails on meta tensors: the op, its module and the user's source line."""
    stack = stack_fqns(n)
    where = f" in module {stack[-1]}" if stack and stack[-1] else ""
    frame = innermost(stack_trace_frames(n.meta.get("stack_trace")))
    if frame is not None:
        where += f" at {frame.filename}:{frame.lineno}"
    hint = failure_hint(e)
    if hint == "; " + VALUE_SHAPED_HINT:  # torch's message (a config flag to fake the values) does not help here
        return f"cannot trace the model: {n.target}{where}: {VALUE_SHAPED_HINT}"
    return f"cannot trace the model: {n.target}{where} fails on meta tensors: {type(e).__name__}: {first_line(e)}{hint}"


def stack_fqns(node: torch.fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, _type in stack.values():
        path = re.sub(r"@\d+$", "", path)
        out.append(path)
    return out
