"""Context parallelism in the graph: which ops see the sequence, proven from two exports, and their rewrite.

Each cp rank holds ``s/cp`` tokens of every sample (chunks i and 2·cp-1-i of 2·cp, `partc.collectives`). The
program of a cp plan is the model exported at ``s/cp`` tokens, which gives every shape at the rank's length; what
that graph computes is then per position except in three kinds of op, which the rewrite gives the rank's global
positions:

    aten.arange over the tokens                     -> collectives.cp_arange    (the rank's positions)
    a slice of a table by position (x[:s])          -> collectives.cp_slice     (the rows of the rank's positions)
    causal scaled_dot_product_attention             -> collectives.cp_attention (keys and values all-gathered)

The proof compares the graph exported at ``s/cp`` with the traced one at ``s``, node by node (same ops in the same
order): a dim whose size differs between them is a sequence dim, and must be ``cp`` times smaller. Every op must
keep the sequence where it is, position by position; it is refused (`PartcError`, one line naming the op and its
source line) where it

- holds two sequence dims (attention scores or a mask computed outside ``scaled_dot_product_attention``);
- takes a sequence dim and returns none (a sum, mean or product over positions), or changes its length other
  than by cp (a shift, a pad, a slice of the sequence);
- mixes positions along a kept sequence dim (a convolution or scan over time, softmax or a sort over
  positions, a gather indexed by position, ``tril``/``triu``);
- is attention with a mask or not causal (a sliding window or an arbitrary mask; a mask proven exactly causal,
  Hugging Face's, is gone from the graph already: `partc.passes.causal_mask`);
- makes positions other than by an ``arange`` or a slice of a table.

Grouped-query attention repeats its key/value heads just before attention (``repeat_interleave`` on the head
dim, or Hugging Face's ``repeat_kv``: an expand and a reshape): the rewrite gathers the heads before they are
repeated, `repeats` times fewer bytes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from partc import collectives as C
from partc.errors import PartcError

aten = torch.ops.aten

ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
SLICES = {aten.slice.Tensor}
ATTENTION = {aten.scaled_dot_product_attention.default}

ALONG_DIM = {aten._softmax.default: 1, aten._log_softmax.default: 1, aten.softmax.int: 1, aten.log_softmax.int: 1,
             aten.cumsum.default: 1, aten.cumprod.default: 1, aten.logcumsumexp.default: 1, aten.sort.default: 1,
             aten.sort.stable: 2, aten.topk.default: 2, aten.cummax.default: 1, aten.cummin.default: 1,
             aten.flip.default: 1, aten.roll.default: 2, aten.argsort.default: 1}
"""Ops mixing positions along their dim argument (the position of the argument)."""

DEFAULT_DIM = {aten.topk.default: -1, aten.sort.default: -1, aten.sort.stable: -1, aten.argsort.default: -1}
"""The dim of the `ALONG_DIM` ops whose dim argument may be left out (a router's ``topk(probs, k)``: the last)."""

MIXING = {"convolution", "_convolution", "tril", "triu", "index", "index_select", "gather", "take", "scatter",
          "scatter_add", "scatter_reduce", "index_add", "index_put", "index_copy", "index_fill", "_unsafe_index",
          "grid_sampler_2d", "pad", "unfold", "im2col", "col2im", "diff", "diagonal", "diag"}
MIXING_PREFIXES = ("conv", "max_pool", "avg_pool", "adaptive_", "fft_", "upsample", "_upsample", "reflection_pad",
                   "replication_pad", "constant_pad", "lp_pool", "_fft")
"""Ops that mix positions of their first argument whenever it holds the sequence."""


@dataclass(kw_only=True, slots=True)
class ContextSplit:
    """What the rewrite changes in the graph at ``s/cp`` tokens, by node name (names survive `rebatch` and the
    TP rewrite), and how the runtime cuts the inputs."""

    cp: int
    seq_len: int
    """Tokens per sample (s), whole."""
    input_dims: dict[int, int] = field(default_factory=dict)
    """Position among the model's user inputs -> its sequence dim."""
    aranges: list[str] = field(default_factory=list)
    slices: list[str] = field(default_factory=list)
    attention: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"degree": self.cp, "seq_len": self.seq_len, "input_dims": {str(k): v for k, v in
                                                                         self.input_dims.items()},
                "attention_layers": len(self.attention)}


def local_inputs(args: tuple, kwargs: dict, seq_len: int, cp: int) -> tuple[tuple, dict]:
    """The example inputs at ``s/cp`` tokens: each tensor cut along its one dim (after the batch) of s."""
    if seq_len % (2 * cp):
        raise PartcError(f"--cp {cp}: the sequence of {seq_len} tokens does not split into 2 x cp = {2 * cp} "
                         f"equal chunks")

    def cut(t):
        if not isinstance(t, torch.Tensor):
            return t
        dims = [d for d in range(1, t.dim()) if t.shape[d] == seq_len]
        if len(dims) > 1:
            raise PartcError(f"context parallelism: an input of shape {list(t.shape)} has {len(dims)} dims of "
                             f"{seq_len} tokens; partc cannot tell which is the sequence")
        return t.narrow(dims[0], 0, seq_len // cp) if dims else t
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _vals(node: torch.fx.Node) -> list:
    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return [v] if isinstance(v, torch.Tensor) else []


def _where(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    if lines:
        last = lines[-1]
        try:
            path = last.split('"')[1].rsplit("/", 1)[-1]
            line = last.split("line ")[1].split(",")[0]
            return f"{node.target} at {path}:{line}"
        except IndexError:
            pass
    return f"{node.target} ({node.name})"


def analyze(full: torch.export.ExportedProgram, local: torch.export.ExportedProgram, cp: int,
            seq_len: int, token_wise: set[str] = frozenset()) -> ContextSplit:
    """Prove that the graph at ``s/cp`` tokens (`local`) computes position by position but for the ops the
    rewrite replaces (module docstring), comparing it with the graph at `seq_len` tokens (`full`); PartcError
    names the first op that mixes positions otherwise. `token_wise`: names of `local`'s nodes proven elsewhere to
    compute each token's output from that token alone, whatever their ops (the layers of experts whose routing
    `partc.passes.experts_ep.token_wise_nodes` follows: they sort and gather the tokens by expert); only their
    sequence dims are read."""
    fn, ln = list(full.graph.nodes), list(local.graph.nodes)
    why = "context parallelism (--cp {}) is not proven for this model: ".format(cp)
    if len(fn) != len(ln) or any(a.op != b.op or a.target != b.target for a, b in zip(fn, ln)):
        raise PartcError(why + "its graph at another sequence length has other ops (it branches on the length)")
    out = ContextSplit(cp=cp, seq_len=seq_len)
    seq: dict[torch.fx.Node, set[int]] = {}  # local node -> its sequence dims
    user_inputs = [s.arg.name for s in local.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    for f, node in zip(fn, ln):
        fv, lv = _vals(f), _vals(node)
        dims: set[int] = set()
        if node.name in token_wise:  # per token as a whole (counts and offsets by expert have no sequence dim)
            seq[node] = {d for a, b in zip(fv, lv) if a.dim() == b.dim()
                         for d, (x, y) in enumerate(zip(a.shape, b.shape))
                         if isinstance(x, int) and isinstance(y, int) and x != y}
            continue
        for a, b in zip(fv, lv):
            if a.dim() != b.dim():
                raise PartcError(why + f"{_where(node)} changes rank with the sequence length")
            for d, (x, y) in enumerate(zip(a.shape, b.shape)):
                if x != y:
                    if x != y * cp:
                        raise PartcError(why + f"{_where(node)} has a dim of {y} at {seq_len // cp} tokens and "
                                               f"{x} at {seq_len}, not cp times as many: it shifts, pads or cuts "
                                               f"the sequence")
                    dims.add(d)
            if len([d for d, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]) > 1:
                raise PartcError(why + f"{_where(node)} holds two sequence dims (attention scores or a mask "
                                       f"outside scaled_dot_product_attention)")
        seq[node] = dims
        if node.op == "placeholder":
            if node.name in user_inputs and dims:
                out.input_dims[user_inputs.index(node.name)] = min(dims)
            continue
        if node.op != "call_function":
            continue
        ins = [a for a in node.all_input_nodes]
        seq_in = [a for a in ins if seq.get(a)]
        if node.target is operator.getitem or not lv:  # an assert or a size: no tensor made
            continue
        if node.target in ATTENTION:
            if not is_causal_attention(node):
                raise PartcError(why + f"attention {_where(node)} is not causal or has a mask (a sliding window "
                                       f"or an arbitrary mask); only causal attention without a mask is split")
            out.attention.append(node.name)
            continue
        if not seq_in:
            if not dims:
                continue
            if node.target in ARANGES:
                out.aranges.append(node.name)
            elif node.target in SLICES and node.args[1] in dims:
                out.slices.append(node.name)
            elif not ins or node.target in (aten.expand.default,):
                pass  # a constant made at the sequence's length (ones, zeros, full) or broadcast to it
            else:
                raise PartcError(why + f"{_where(node)} makes a tensor along the sequence from tensors that have "
                                       f"none; only arange and a slice of a table by position are followed")
            continue
        if not dims:
            raise PartcError(why + f"{_where(node)} reduces over the sequence (a sum, mean or product over "
                                   f"positions)")
        first = node.args[0] if node.args else None
        op = getattr(getattr(node.target, "_overloadpacket", None), "__name__", "")
        if (op in MIXING or op.startswith(MIXING_PREFIXES)) and isinstance(first, torch.fx.Node) and seq.get(first):
            raise PartcError(why + f"{_where(node)} mixes positions (a convolution, scan, mask or gather along "
                                   f"the sequence)")
        if node.target in ALONG_DIM:
            i = ALONG_DIM[node.target]
            d = node.args[i] if len(node.args) > i else node.kwargs.get("dim", DEFAULT_DIM.get(node.target))
            src = seq.get(first, set()) if isinstance(first, torch.fx.Node) else set()
            ds = d if isinstance(d, (list, tuple)) else [d]
            nd = _vals(first)[0].dim() if isinstance(first, torch.fx.Node) and _vals(first) else 1
            if d is None or any((x % nd) in src for x in ds if isinstance(x, int)):
                raise PartcError(why + f"{_where(node)} mixes positions along the sequence")
    if not out.attention:
        raise PartcError(why + "it has no causal scaled_dot_product_attention to split")
    return out


def is_causal_attention(node: torch.fx.Node) -> bool:
    """Whether a ``scaled_dot_product_attention`` node is causal, with no mask: what context parallelism splits."""
    attn_mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return attn_mask is None and bool(causal)


def kv_repeat(x) -> tuple[torch.fx.Node, int, list[torch.fx.Node]] | None:
    """(the key or value before grouped-query attention repeats its heads, the repeats, the nodes that repeat it)
    for ``repeat_interleave(x, g, dim=1)`` or Hugging Face's ``repeat_kv`` (``x[:, :, None]`` expanded to
    ``[b, h, g, s, d]`` and reshaped to ``[b, h·g, s, d]``: each head g times in a row, the same); None else."""
    if not isinstance(x, torch.fx.Node):
        return None
    if x.target == aten.repeat_interleave.self_int and len(x.args) > 2 and x.args[2] == 1:
        return x.args[0], x.args[1], [x]
    if x.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        e = x.args[0]
        if not (isinstance(e, torch.fx.Node) and e.target == aten.expand.default and len(e.args[1]) == 5):
            return None
        u = e.args[0]
        if not (isinstance(u, torch.fx.Node) and u.target == aten.unsqueeze.default and u.args[1] == 2):
            return None
        b, h, g, s, d = e.args[1]
        shape = list(x.args[1])
        if len(shape) != 4 or shape[2:] != [s, d] or shape[1] not in (-1, h * g) or not isinstance(g, int):
            return None
        return u.args[0], g, [x, e, u]
    return None


def kv_before_repeat(x):
    """The key or value node before grouped-query attention repeats its heads (`kv_repeat`), else `x`."""
    rep = kv_repeat(x)
    return rep[0] if rep is not None else x


def rewrite(ep: torch.export.ExportedProgram, split: ContextSplit) -> None:
    """Replace the position ops and causal attention of `ep` (the graph at ``s/cp`` tokens) in place."""
    by_name = {n.name: n for n in ep.graph.nodes}
    for name in split.aranges:
        node = by_name[name]
        a = node.args
        start, end, step = ((0, a[0], 1) if node.target == aten.arange.default else
                            (a[0], a[1], 1) if node.target == aten.arange.start else (a[0], a[1], a[2]))
        node.target, node.args = C.cp_arange, (start, end, step)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k in ("dtype", "device")}
    for name in split.slices:
        node = by_name[name]
        node.target = C.cp_slice
    for name in split.attention:
        node = by_name[name]
        args = list(node.args)
        kwargs = dict(node.kwargs)
        k, v = kv_repeat(args[1]), kv_repeat(args[2])
        chains = [r[2] for r in (k, v) if r is not None and all(len(n.users) == 1 for n in r[2])]
        if len(chains) == 2 and k[1] == v[1]:
            args[1], args[2] = k[0], v[0]
            kwargs["repeats"] = k[1]
        node.target, node.args, node.kwargs = C.cp_attention, tuple(args), kwargs
        if len(chains) == 2 and "repeats" in kwargs:
            for chain in chains:
                for x in chain:
                    ep.graph.erase_node(x)
    ep.graph.lint()
