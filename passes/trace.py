"""Trace an unmodified model on the meta device and summarize it as a `ModelGraph`.

1. `passes.export.export_on_meta`: ``torch.export.export(model, args, kwargs, strict=False)`` with meta
   parameters and inputs; a failure becomes a one-line `PartcError` naming the module and source line.
2. `passes.measure.measure`: run the exported graph once more on meta tensors, node by node, recording for every
   FX node the GEMMs it dispatches (shapes), the bytes its other kernels move, and the tensors autograd saves.
3. `build_graph`: group nodes into layers (weight-bearing modules) and units (repeated blocks and other top-level
   modules) by each node's ``nn_module_stack`` (`passes.assign`); add data-flow edges and pipeline cut sizes.

Everything is measured for one sample (micro-batch size 1); the cost model scales linearly.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn
from torch.export.graph_signature import InputKind

from partc.ir import Edge, Layer, ModelGraph, Unit
from partc.model_file import infer_seq_len
from partc.precision import cast_floating, cast_parameters, compute_dtype
from partc.passes.assign import Assignment, assign, layer_outputs, owner
from partc.value_sized import VALUE_SIZED, expected_sizes
from partc.passes.context import is_causal_attention, kv_before_repeat
from partc.passes.cuts import batched_nodes, pipeline_cuts, realizable_cuts, val_bytes
from partc.passes.experts import mark_inner, param_placeholders
from partc.passes.experts_routed import routed_experts
from partc.passes.export import export_on_meta, norms_on_any_batch
from partc.passes import fuse
from partc.passes.measure import NodeStats, measure
from partc.passes.shard import ShardAnalysis

aten = torch.ops.aten

def build_graph(ep: torch.export.ExportedProgram, model: nn.Module, stats: dict[torch.fx.Node, NodeStats], *,
                name: str, seq_len: int | None, a: Assignment | None = None,
                fusions: Fusions | None = None) -> ModelGraph:
    """The `ModelGraph` of an exported model and its per-node costs (`measure`), in steps. `a`: `assign`'s, when the
    caller has it; `fusions`: what `fuse_pointwise` changes (`find_fusions`, the nodes `measure` watched)."""
    a = a or assign(ep, model)                             # 1. node -> layer and unit; execution order
    tied, counted = _tied(a)                               # 2. tied parameters: one canonical name each
    layer_out = layer_outputs(a)                          # 3. the node that carries each layer's output
    linear_out = {m: layer_out[m] for m in a.ordered_layers
                  if a.kind(m) == "linear" and m in layer_out}
    shard = ShardAnalysis(ep.graph, a.node_layer, linear_out)  # 4. where a colwise split flows without collectives
    layers = _layers(a, shard, counted)                    # 5. layers: shapes, split groups, fused pieces
    units = _costs(a, stats, layers, shard, layer_out, batched_nodes(ep))  # 6. per-node costs into layers, units
    if fusions is not None:                                #    and what fused kernels would keep instead
        _fused_savings(a, stats, fusions, units, _whole_saver(a, layers, shard))
    mark_inner(ep.graph, a.node_layer, param_placeholders(ep), layers, stats)  # experts: split inside
    routed = routed_experts(ep.graph, param_placeholders(ep), layers)  # experts as modules: divided by ep
    for layer in layers.values():  # they run on the whole tokens, all-gathered under sequence parallelism
        unit = units.get(layer.unit)
        if layer.inner and unit is not None:
            unit.saved_bytes_replicated_linear += min(
                layer.saved_bytes, unit.saved_bytes_replicated - unit.saved_bytes_replicated_linear)
    unit_index = {u: i for i, u in enumerate(a.unit_names)}
    edges = _edges(a.nodes, a.node_layer, a.node_unit, unit_index, layers, shard, layer_out,  # 7. data flow
                   {u for u, k in a.unit_kind.items() if k == "block"})
    cuts = pipeline_cuts(ep, a, units, stats, seq_len, layer_out)  # 8. bytes across each pipeline cut; unit inputs
    cut_ok, sized = realizable_cuts(a)                     #    and which cuts the program can make
    for u in units.values():
        u.signature = _signature(u, layers)                # 9. identical blocks share TP decisions
    ordered = [units[u] for u in a.unit_names]
    first_req, last_req = _required_ends(ordered)          # 10. embeddings first, head last
    return ModelGraph(name=name, num_params=sum(_numel(tuple(p.shape)) for p in _unique_params(model)),
                      seq_len=seq_len or 1, units=ordered, layers={m: layers[m] for m in a.ordered_layers},
                      edges=edges, cut_bytes=cuts.per_sample, cut_grad_bytes=cuts.grad_per_sample,
                      cut_fixed_bytes=cuts.fixed, cut_grad_fixed_bytes=cuts.grad_fixed, cut_ok=cut_ok,
                      cut_fixed_seq_bytes=cuts.fixed_seq if any(cuts.fixed_seq) else [],
                      cut_grad_fixed_seq_bytes=cuts.grad_fixed_seq if any(cuts.grad_fixed_seq) else [],
                      cut_value_sized=sized if any(sized) else [], tied=tied,
                      cut_layer_outputs=cuts.layer_outputs if any(cuts.layer_outputs) else [],
                      first_unit_required=first_req,
                      last_unit_required=last_req, info=_model_info(layers, ordered, seq_len),
                      sums=_sums(a.nodes, a.node_layer, layer_out, layers), routed_experts=routed)


def _tied(a: Assignment) -> tuple[dict[str, str], set[str]]:
    """(every alias of a tied parameter -> its canonical name, the canonical names of all parameters): the
    canonical name is the first owner in execution order."""
    big = len(a.nodes) + 1

    def param_rank(pname: str) -> int:
        owner = pname.rpartition(".")[0]
        return a.ordered_layers.index(owner) if owner in a.ordered_layers else big

    tied: dict[str, str] = {}
    counted: set[str] = set()
    for names in a.by_id.values():
        names = sorted(names, key=param_rank)
        counted.add(names[0])
        for dup in names[1:]:
            tied[dup] = names[0]
    return tied, counted


def _layers(a: Assignment, shard: ShardAnalysis, counted: set[str]) -> dict[str, Layer]:
    """One `Layer` per weight-bearing module: features, the groups a TP split must respect, fused pieces."""
    layers: dict[str, Layer] = {}
    for m in a.ordered_layers:
        mod = a.layer_mods[m]
        kind = a.kind(m)
        params = {f"{m}.{k}" if m else k: tuple(p.shape) for k, p in mod._parameters.items() if p is not None}
        in_f = out_f = 0
        w = mod._parameters.get("in_proj_weight" if isinstance(mod, nn.MultiheadAttention) else "weight")
        if kind == "linear" and w is not None:
            out_f, in_f = (w.shape[1], w.shape[0]) if type(mod).__name__ == "Conv1D" else (w.shape[0], w.shape[1])
        elif kind == "embedding" and w is not None:
            out_f, in_f = w.shape[0], w.shape[1]
        elif kind == "norm" and w is not None:
            in_f = w.shape[-1]
        unit = owner(m, a.unit_names) or (a.unit_names[0] if a.unit_names else "")
        region = shard.regions.get(m)
        fused = region.fused if region else 1
        col_groups = out_f
        if region and region.groups:
            col_groups = region.groups
        elif fused > 1:
            col_groups = out_f // fused
        layers[m] = Layer(fqn=m, type=type(mod).__name__, kind=kind, unit=unit, params=params,
                          num_params=sum(_numel(s) for p, s in params.items() if p in counted),
                          in_features=in_f, out_features=out_f, col_groups=col_groups, row_groups=in_f,
                          fused=fused, split_stop=region.reason if region and not region.valid else
                          a.attention.get(m, ""))
    # Row groups: a rowwise split must respect the heads of every region that reaches it split.
    for region in shard.regions.values():
        for dst, ok in region.reaches.items():
            if ok and dst in layers and region.groups:
                layers[dst].row_groups = _gcd(layers[dst].row_groups, region.groups)
    return layers


def _costs(a: Assignment, stats: dict[torch.fx.Node, NodeStats], layers: dict[str, Layer], shard: ShardAnalysis,
           layer_out: dict[str, torch.fx.Node], batched: set[torch.fx.Node]) -> dict[str, Unit]:
    """Units with their layers, and every node's GEMMs, bytes moved and bytes saved added to its layer (or, outside
    layers, to its unit: the attention core). `batched`: the nodes whose value carries the batch."""
    units = {u: Unit(fqn=u, kind=a.unit_kind[u], layers=[], num_params=0) for u in a.unit_names}
    for m, layer in layers.items():
        if layer.unit in units:
            units[layer.unit].layers.append(m)
            units[layer.unit].num_params += layer.num_params
    # Split under Megatron's plan: what a colwise layer's output reaches. A layer that a split region reaches on its
    # last dim takes a split input (rowwise), so its own output is whole after its all-reduce (the dropout mask and
    # residual after an attention or MLP output projection), though the analysis propagates from every Linear.
    rowwise = {name for r in shard.regions.values() if r.valid for name, ok in r.reaches.items() if ok}
    sharded_nodes = {n for n in shard.dims if any(src not in rowwise for src in shard.sources.get(n, ()))}
    for n in a.nodes:
        st = stats.get(n)
        u = a.node_unit[n]
        if st is None or u is None:
            continue
        unit = units[u]
        if n.target is torch.ops.aten.scaled_dot_product_attention.default and is_causal_attention(n):
            for given in n.args[1:3]:
                x = kv_before_repeat(given)
                src = x
                while src not in a.node_layer and src.all_input_nodes:  # the layer that made it (a projection)
                    src = src.all_input_nodes[0]
                unit.cp_kv.append((val_bytes(x), a.node_layer.get(src, ""), val_bytes(given)))
            src = n.args[0]
            while src not in a.node_layer and src.all_input_nodes:  # the query's projection
                src = src.all_input_nodes[0]
            unit.cp_out.append((val_bytes(n), a.node_layer.get(src, "")))
        flops = sum(g.flops for g in st.gemms) + st.conv_flops
        saved = sum(b for _, b, _ in st.saved)
        unit.fwd_flops += flops
        unit.kernels += st.kernels
        unit.saved_bytes += saved
        layer = layers[a.node_layer[n]] if n in a.node_layer and a.node_layer[n] in layers else None  # "" is the root
        if layer is not None:
            layer.gemms.extend(st.gemms)
            layer.fwd_flops += flops
            layer.saved_bytes += saved
            layer.memory_bytes += st.memory_bytes
        else:
            unit.core_gemms.extend(st.gemms)
            unit.memory_bytes += st.memory_bytes
            unit.saved_bytes_core += sum(b for _, b, core in st.saved if core) - st.core_input_bytes
        # TP leaves whole what is saved outside split regions: norm and residual inputs, and the inputs of colwise
        # layers. A linear layer saves its input, so whether it is whole depends on the input, not on the layer's
        # output (a colwise layer's is split, its input is not: Korthikanti et al.'s QKV and first-MLP inputs).
        if layer is not None and layer.kind == "linear":
            whole = not any(x in sharded_nodes for x in n.args if isinstance(x, torch.fx.Node))
        else:
            whole = n not in sharded_nodes
        if whole:
            unit.saved_bytes_replicated += saved
            if layer is not None and layer.kind == "linear":
                unit.saved_bytes_replicated_linear += saved
        fixed = sum(nbytes for _, nbytes in st.fixed)
        if not whole:  # what a split op saves of whole tensors: the rotary tables a colwise query is multiplied by
            unit.saved_bytes_replicated += fixed
        unit.saved_bytes_fixed += fixed
        unit.saved_bytes_once += sum(nbytes for src, nbytes in st.fixed if src not in batched)
        if layer is None:
            unit.op_saved_bytes += saved
            unit.op_saved_bytes_replicated += saved if whole else 0
    for m, n in layer_out.items():
        if m in layers:
            layers[m].out_bytes = val_bytes(n)
    return units


def _whole_saver(a: Assignment, layers: dict[str, Layer], shard: ShardAnalysis):
    """Whether what a node saves is whole under TP (`_costs`' rule, for `_fused_savings`)."""
    rowwise = {name for r in shard.regions.values() if r.valid for name, ok in r.reaches.items() if ok}
    sharded_nodes = {n for n in shard.dims if any(src not in rowwise for src in shard.sources.get(n, ()))}

    def whole(n: torch.fx.Node) -> bool:
        layer = layers.get(a.node_layer.get(n, ""))
        if layer is not None and layer.kind == "linear":
            return not any(x in sharded_nodes for x in n.args if isinstance(x, torch.fx.Node))
        return n not in sharded_nodes
    return whole


@dataclass(kw_only=True, slots=True)
class Fusions:
    """What `Parallel.fuse_pointwise` changes in the program (`partc.passes.fuse`), found on the traced graph."""

    regions: list[tuple[str, fuse.Region]]
    """(unit, region) of each pointwise region, found per unit as codegen finds them per unit function."""
    gqa: list[tuple[str, fuse.GQA]]

    def watched(self) -> frozenset:
        """The values whose storage the accounting needs (`measure`'s `watch`)."""
        return frozenset([x for _, r in self.regions for x in r.inputs] +
                         [x for _, g in self.gqa for x in (*g.repeated, *g.unrepeated)])


def find_fusions(ep: torch.export.ExportedProgram, a: Assignment) -> Fusions:
    """The pointwise regions of each unit and the attention ops on repeated keys and values (`partc.passes.fuse`)."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    params = [placeholders[s.arg.name] for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    pv, gv = fuse.param_values(ep.graph, params), fuse.grad_values(ep.graph, params)
    by_unit: dict[str, list[torch.fx.Node]] = {}
    for n in a.nodes:
        if a.node_unit.get(n) is not None:
            by_unit.setdefault(a.node_unit[n], []).append(n)
    regions = [(u, r) for u, nodes in by_unit.items()
               for r in fuse.regions(nodes, params=pv, needs_grad=gv.__contains__)]
    gqa = [(a.node_unit[g.attention], g) for g in fuse.gqa_attention(a.nodes) if a.node_unit.get(g.attention)]
    return Fusions(regions=regions, gqa=gqa)


def _fused_savings(a: Assignment, stats: dict[torch.fx.Node, NodeStats], fusions: Fusions, units: dict[str, Unit],
                   whole) -> None:
    """`Unit.fused_saved_bytes` and the rest: the tensors only a fused region's ops save, less the regions' inputs
    that nothing saved before; each counted once, at the unit that first saves it, whole or split under TP as
    `_costs` counts it. The same with the attention's keys and values unrepeated on top gives
    `Unit.fused_gqa_saved_bytes` (the difference)."""
    regions = _savings(a, stats, fusions.regions, [], whole)
    both = _savings(a, stats, fusions.regions, fusions.gqa, whole)
    for u, unit in units.items():
        unit.fused_saved_bytes, unit.fused_saved_bytes_replicated = regions.get(u, (0, 0))
        total, rep = both.get(u, (0, 0))
        unit.fused_gqa_saved_bytes = total - unit.fused_saved_bytes
        unit.fused_gqa_saved_bytes_replicated = rep - unit.fused_saved_bytes_replicated
    for unit, r in fusions.regions:
        for x in r.inputs:  # a region keeping what enters its unit: a pipeline stage's received input, perhaps
            st = stats.get(x)
            if unit in units and a.node_unit.get(x) != unit and x.op != "placeholder" and st and st.out_key:
                units[unit].fused_input_bytes += st.out_key[1]
        if unit in units:  # the replay's own values, held in the region's backward: what its ops save, its output
            given = {stats[x].out_key[0] for x in r.inputs if x in stats and stats[x].out_key}
            keys = {k: b for n in r.nodes if n in stats for k, b in stats[n].all_saved if k not in given}
            peak = sum(keys.values()) + val_bytes(r.output)
            if whole(r.output):
                units[unit].fused_replay_peak_bytes_replicated = max(units[unit].fused_replay_peak_bytes_replicated,
                                                                     peak)
            else:
                units[unit].fused_replay_peak_bytes = max(units[unit].fused_replay_peak_bytes, peak)
        for n in r.nodes:  # the replay: the region's forward traffic again, in backward
            st = stats.get(n)
            if st is not None and unit in units:
                units[unit].fused_replay_bytes += st.memory_bytes
                units[unit].fused_replay_bytes_replicated += st.memory_bytes if whole(n) else 0


def _savings(a: Assignment, stats: dict[torch.fx.Node, NodeStats], regions: list, gqa: list,
             whole) -> dict[str, tuple[int, int]]:
    """Unit -> (bytes saved less, of which whole) when `regions` keep their inputs and `gqa` reads keys and values
    unrepeated."""
    region_of = {n: r for _, r in regions for n in r.nodes}
    dropped = {g.attention: {stats[x].out_key[0] for x in g.repeated if stats[x].out_key} for _, g in gqa}
    first: dict[int, tuple[torch.fx.Node, int]] = {}
    kept: set[int] = set()
    for n in a.nodes:
        st = stats.get(n)
        if st is None:
            continue
        for key, nbytes in st.all_saved:
            first.setdefault(key, (n, nbytes))
            if n not in region_of and key not in dropped.get(n, ()):
                kept.add(key)
    added: dict[int, tuple[str, torch.fx.Node, int]] = {}
    inputs = [(u, x) for u, r in regions for x in r.inputs] + [(u, x) for u, g in gqa for x in g.unrepeated]
    for unit, x in inputs:
        st = stats.get(x)
        if st is not None and st.out_key is not None and x.op != "placeholder":
            added.setdefault(st.out_key[0], (unit, x, st.out_key[1]))
    out: dict[str, list[int]] = {}
    for key, (n, nbytes) in first.items():
        u = a.node_unit.get(n)
        if key in kept or key in added or u is None:
            continue
        acc = out.setdefault(u, [0, 0])
        acc[0] += nbytes
        acc[1] += nbytes if whole(n) else 0
    for key, (u, x, nbytes) in added.items():
        if key in first:
            continue
        acc = out.setdefault(u, [0, 0])
        acc[0] -= nbytes
        acc[1] -= nbytes if whole(x) else 0
    return {u: (v[0], v[1]) for u, v in out.items()}


def _required_ends(units: list[Unit]) -> tuple[list[str], list[str]]:
    """(units that must be on the first stage: those before the first block; units that must be on the last: those
    after the last block). Without blocks, the first and the last unit."""
    kinds = [u.kind for u in units]
    if "block" not in kinds:
        return [units[0].fqn] if units else [], [units[-1].fqn] if units else []
    first_block = kinds.index("block")
    last_block = len(kinds) - 1 - kinds[::-1].index("block")
    return [u.fqn for u in units[:first_block]], [u.fqn for u in units[last_block + 1:]]


def _edges(nodes, node_layer, node_unit, unit_index, layers, shard, layer_out, block_units) -> list[Edge]:
    out_node_of = {n: m for m, n in layer_out.items()}
    sources: dict[torch.fx.Node, frozenset[str]] = {}
    for n in nodes:
        srcs: set[str] = set()
        for a in n.all_input_nodes:
            if _is_index(a):  # integers carry no gradient and are never converted (a router's choice of experts)
                continue
            if a in out_node_of:
                srcs.add(out_node_of[a])
            elif a in sources and node_layer.get(a) is None:
                srcs |= sources[a]
        # Bound residual chains: keep sources from this unit, the one before, and non-block units.
        ui = unit_index.get(node_unit.get(n), 0)
        srcs = {s for s in srcs if unit_index.get(layers[s].unit, 0) >= ui - 1 or layers[s].unit not in block_units}
        sources[n] = frozenset(srcs)
    found: dict[tuple[str, str], Edge] = {}
    for n in nodes:
        dst = node_layer.get(n)
        if dst is None or n.target is aten._assert_tensor_metadata.default:  # reads no values (the program skips it)
            continue
        for a in n.all_input_nodes:
            if node_layer.get(a) == dst or _is_index(a):
                continue
            srcs = {out_node_of[a]} if a in out_node_of else set(sources.get(a, ()))
            routed = a not in out_node_of and bool(a.meta.get(VALUE_SIZED))
            for s in srcs:
                if s == dst or (s, dst) in found:
                    continue
                region = shard.regions.get(s)
                ok = bool(region and region.valid and region.reaches.get(dst) and layers[dst].kind == "linear")
                nbytes = _read_bytes(layers[s].out_bytes, a, n)
                found[(s, dst)] = Edge(src=s, dst=dst, bytes=min(nbytes, val_bytes(a)) if routed else nbytes,
                                       shard_ok=ok, routed=routed)
    counted = set()
    for n in nodes:  # integers read straight from another layer (a router's choice of experts)
        dst = node_layer.get(n)
        for a in n.all_input_nodes if dst is not None else ():
            src = node_layer.get(a)
            if _is_index(a) and src not in (None, dst) and (src, dst) in found and a not in counted:
                counted.add(a)
                found[(src, dst)].index_bytes += val_bytes(a)
    return list(found.values())


def _is_index(n: torch.fx.Node) -> bool:
    """Whether `n` holds an integer or boolean tensor (indices, masks): data flow through it is no edge."""
    val = n.meta.get("val")
    return isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex())


def _sums(nodes, node_layer, layer_out, layers) -> list[tuple[str, ...]]:
    """Groups of two or more layers whose outputs reach the rest of the model only through their sum: each output
    read by one ``add`` (outside any layer) and nothing else, the adds chained (``a + b + c``). The TP rewrite keeps
    an add of feature-split operands split, so colwise members are converted once, at the sum's readers. Members
    split in fused pieces are left out (their pieces would not line up)."""
    out_node_of = {n: m for m, n in layer_out.items()}
    group: dict[torch.fx.Node, tuple[str, ...]] = {}
    for n in nodes:
        if n.target is not aten.add.Tensor or node_layer.get(n) is not None or len(n.all_input_nodes) != 2:
            continue
        members: list[str] = []
        for a in n.all_input_nodes:
            if len(a.users) != 1:
                break
            if a in group:
                members += group[a]
            elif a in out_node_of and layers[out_node_of[a]].fused <= 1:
                members.append(out_node_of[a])
            else:
                break
        else:
            if len(set(members)) == len(members):
                group[n] = tuple(members)
    inner = {a for n in group for a in n.all_input_nodes if a in group}
    return [g for n, g in group.items() if n not in inner]


_CASTS = (aten.to.dtype, aten._to_copy.default)


def _read_bytes(out_bytes: int, a: torch.fx.Node, n: torch.fx.Node) -> int:
    """Bytes of a source's output as a layer reads it: narrowed where a cast makes it smaller on the way (an fp32
    norm output cast to bf16 for the GEMMs that read it, `partc.precision.Autocast`), since a colwise reader's
    gradient all-reduce (`passes.tp_rewrite`) is of what the GEMM reads. A widening cast (an RMSNorm's upcast)
    leaves the source's bytes: a collective for it runs before the cast."""
    read = [val_bytes(x) for x in (a, n) if x.target in _CASTS and x.args and (x is a or x.args[0] is a)]
    return min([out_bytes, *read])


def _signature(unit: Unit, layers: dict[str, Layer]) -> str:
    if unit.kind != "block":
        return unit.fqn
    parts = []
    for m in unit.layers:
        rel = m[len(unit.fqn) + 1:]
        layer = layers[m]
        parts.append(f"{rel}:{layer.type}:{sorted(layer.params.values())}")
    return "|".join(parts)


def _model_info(layers: dict[str, Layer], units: list[Unit], seq_len: int | None) -> dict:
    embeddings = [l for l in layers.values() if l.kind == "embedding"]
    info: dict[str, object] = {
        "num_layers": len(layers),
        "num_blocks": sum(1 for u in units if u.kind == "block"),
        "seq_len": seq_len,
    }
    if embeddings:
        first = embeddings[0]  # the token embedding runs first
        info["vocab_size"] = first.out_features
        info["hidden_size"] = first.in_features
    return info


def _unique_params(model: nn.Module):
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def _gcd(a: int, b: int) -> int:
    return math.gcd(a, b) if a and b else (a or b)


@dataclass(kw_only=True, slots=True)
class Traced:
    graph: ModelGraph
    exported: torch.export.ExportedProgram
    model: nn.Module
    trace_s: float
    measure_s: float


def trace(model: nn.Module, args: tuple, kwargs: dict, *, name: str, seq_len: int | None = None,
          path: str = "", precision: str = "bf16", fused_attention: bool = False) -> Traced:
    """Trace a meta-device model on one sample of meta inputs and build its `ModelGraph`. The model's parameters
    (in place) and its floating-point inputs are cast to the `precision`'s compute dtype first (`partc.precision`):
    the graph and its byte counts are those of a run at that precision, and the forward's casts at that precision
    (`partc.precision.Autocast`) are ops of the graph. `fused_attention`: count the attention op
    as the fused kernel the cluster runs (`partc.passes.measure.CORE_OPS`)."""
    t0 = time.perf_counter()
    dtype = compute_dtype(precision)
    cast_parameters(model, dtype)
    args, kwargs = cast_floating((args, kwargs), dtype)
    ep = export_on_meta(model, args, kwargs, path=path, precision=precision)
    t1 = time.perf_counter()
    if seq_len is None:
        seq_len = infer_seq_len(args, kwargs)
    if seq_len is None:
        seq_len = _tokens_from_graph(ep)
    sizes = expected_sizes(ep.graph_module.meta)  # value-sized ops at their expected sizes (`partc.value_sized`)
    a = assign(ep, model)
    fusions = find_fusions(ep, a)
    if not fused_attention:  # the math kernel repeats the keys and values inside, under enable_gqa too: no saving
        fusions.gqa = []
    with sizes or contextlib.nullcontext():
        with norms_on_any_batch():  # one sample: a BatchNorm may see one value per channel
            stats = measure(ep, args, kwargs, seq_len, fused_attention=fused_attention, watch=fusions.watched())
        graph = build_graph(ep, model, stats, name=name, seq_len=seq_len, a=a, fusions=fusions)
    t2 = time.perf_counter()
    return Traced(graph=graph, exported=ep, model=model, trace_s=t1 - t0, measure_s=t2 - t1)


def _tokens_from_graph(ep: torch.export.ExportedProgram) -> int | None:
    """Tokens per sample when no input says it: rows of the first Linear's input at one sample."""
    for n in ep.graph.nodes:
        if n.op == "call_function" and n.target is aten.linear.default:
            shape = n.args[0].meta.get("val").shape
            return int(shape[-2]) if len(shape) >= 3 else None
    return None


