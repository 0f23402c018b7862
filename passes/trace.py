"""Trace an unmodified model on the meta device and summarize it as a `ModelGraph`.

1. `passes.export.export_on_meta`: ``torch.export.export(model, args, kwargs, strict=False)`` with meta
   parameters and inputs; a failure becomes a one-line `PartcError` naming the module and source line.
2. `passes.measure.measure`: run the exported graph once more on meta tensors, node by node, recording for every
   FX node the GEMMs it dispatches (shapes), the bytes its other kernels move, and the tensors autograd saves.
3. `build_graph`: group nodes into layers (weight-bearing modules) and units (repeated blocks and other top-level
   modules) by each node's ``nn_module_stack``; add data-flow edges and pipeline cut sizes.

Everything is measured for one sample (micro-batch size 1); the cost model scales linearly.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from partc.ir import Edge, Layer, ModelGraph, Unit
from partc.model_file import infer_seq_len
from partc.precision import cast_floating, cast_parameters, compute_dtype
from partc.passes.cuts import pipeline_cuts, realizable_cuts, val_bytes
from partc.passes.experts import mark_inner, param_placeholders
from partc.passes.export import export_on_meta, norms_on_any_batch
from partc.passes.measure import NodeStats, measure, stack_fqns
from partc.passes.shard import ShardAnalysis

aten = torch.ops.aten

NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm)


def _module_kind(mod: nn.Module) -> str:
    name = type(mod).__name__
    if isinstance(mod, nn.Linear) or name == "Conv1D":
        return "linear"
    if isinstance(mod, nn.Embedding):
        return "embedding"
    if isinstance(mod, NORM_TYPES) or "Norm" in name:
        return "norm"
    return "other"


def _block_containers(model: nn.Module) -> set[str]:
    """FQNs of ModuleLists/Sequentials holding >= 2 parameterized children of one class (repeated blocks)."""
    found = set()
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            kids = [c for c in mod.children() if any(True for _ in c.parameters())]
            if len(kids) >= 2 and len({type(c) for c in kids}) == 1 and len(kids) == len(list(mod.children())):
                found.add(name)
    return found


def _units_of(model: nn.Module) -> list[tuple[str, str]]:
    """(fqn, kind) of the stage units, in module order: repeated blocks and the other top-level modules."""
    containers = _block_containers(model)
    # Nested containers (a block holding its own ModuleList) do not count: keep the outermost.
    containers = {c for c in containers if not any(c != o and c.startswith(o + ".") for o in containers)}

    def contains(prefix: str) -> bool:
        return any(c == prefix or c.startswith(prefix + ".") or prefix == "" for c in containers)

    units: list[tuple[str, str]] = []

    def expand(prefix: str, mod: nn.Module):
        for name, child in mod.named_children():
            fqn = f"{prefix}.{name}" if prefix else name
            if fqn in containers:
                for i, _ in child.named_children():
                    units.append((f"{fqn}.{i}", "block"))
            elif containers and contains(fqn):
                expand(fqn, child)
            elif any(True for _ in child.parameters()):
                units.append((fqn, "module"))

    expand("", model)
    # A plain wrapper (one parameterized child) gets unwrapped so a pipeline has something to split.
    while len(units) == 1 and units[0][1] == "module":
        fqn = units[0][0]
        units = []
        sub = model.get_submodule(fqn)
        for name, child in sub.named_children():
            if any(True for _ in child.parameters()):
                units.append((f"{fqn}.{name}", "module"))
        if not units:
            units = [(fqn, "module")]
            break
    # The root's own parameters are read by the root's forward wherever it uses them (an embedding table at the
    # start, a scale at the end): that code is glue, run by the stage that needs it. The root is a unit only when
    # nothing else is (a model of bare parameters).
    if not units and any(True for _ in model.parameters(recurse=False)):
        units = [("", "module")]
    return units


def _owner(fqn: str, names: set[str] | list[str]) -> str | None:
    """The longest name in `names` that is `fqn` or a prefix module of it (the root unit "" holds everything)."""
    while True:
        if fqn in names:
            return fqn
        if not fqn:
            return None
        fqn = fqn.rpartition(".")[0]


@dataclass(kw_only=True, slots=True)
class Assignment:
    """Which layer and unit every call_function node of an exported graph belongs to."""

    nodes: list[torch.fx.Node]
    layer_mods: dict[str, nn.Module]
    """Modules owning parameters directly (the layers), by FQN."""
    node_layer: dict[torch.fx.Node, str]
    node_unit: dict[torch.fx.Node, str | None]
    """None only for ops after every unit that feed the model output alone."""
    unit_names: list[str]
    """Units in execution order."""
    unit_kind: dict[str, str]
    ordered_layers: list[str]
    by_id: dict[int, list[str]]
    """id(parameter) -> every FQN it goes by (tied parameters have several)."""
    attention: dict[str, str]
    """nn.MultiheadAttention FQN -> "" where it is a Linear of its packed in-projection (`_packed_attention`), else
    why it stays one whole layer."""

    def kind(self, m: str) -> str:
        """The layer kind of module `m` (`_module_kind`; a self-attention nn.MultiheadAttention is a linear)."""
        return "linear" if self.attention.get(m) == "" else _module_kind(self.layer_mods[m])


def assign(ep: torch.export.ExportedProgram, model: nn.Module) -> Assignment:
    """Attribute nodes to layers (deepest weight-bearing module on the node's ``nn_module_stack``) and units
    (the stage units of `_units_of`); glue outside every unit (position ids, masks) goes with the first unit
    that uses it."""
    graph = ep.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    # Parameters: owners, ties (one tensor under several names).
    by_id: dict[int, list[str]] = defaultdict(list)
    for pname, p in model.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(pname)
    modules = dict(model.named_modules(remove_duplicate=False))
    layer_mods = {m: mod for m, mod in modules.items() if any(p is not None for p in mod._parameters.values())}
    layer_names = list(layer_mods)
    unit_list = _units_of(model)
    unit_names = [u for u, _ in unit_list]
    unit_set = set(unit_names)

    # Attribute each node to its layer (deepest weight-bearing module on its stack) and unit. A module that holds
    # parameters beside weight-bearing children (a ViT's class token and positions at its root) owns only the ops
    # that read its own parameters: the rest of its forward is glue between its children, as in a module without
    # parameters (timm's attention core would otherwise be "inside" the root layer, out of the shard analysis).
    # nn.MultiheadAttention, which calls its child out_proj's weight itself, is `_packed_attention`'s to sort out.
    above = set()  # every module above a weight-bearing one (the root "" included)
    for m in layer_names:
        while m:
            m = m.rpartition(".")[0]
            above.add(m)
    containers = {m for m in layer_names if m in above and not isinstance(layer_mods[m], nn.MultiheadAttention)}
    param_owner = {name: fqn.rpartition(".")[0] for name, fqn in ep.graph_signature.inputs_to_parameters.items()}
    node_layer: dict[torch.fx.Node, str] = {}
    node_unit: dict[torch.fx.Node, str | None] = {}
    for n in nodes:
        stack = stack_fqns(n)
        layer = next((m for m in reversed(stack) if m in layer_mods), None)
        if layer in containers and not any(param_owner.get(x.name) == layer for x in n.all_input_nodes
                                           if x.op == "placeholder"):
            layer = None
        if layer is not None:
            node_layer[n] = layer
        unit = None
        for m in stack:
            unit = _owner(m, unit_set)
            if unit is not None:
                break
        node_unit[n] = unit
    attention = _packed_attention(ep, layer_mods, node_layer)
    # Execution order of units: by each unit's first op of its own (glue does not count: Whisper's encoder
    # permutes the conv output before it adds embed_positions, and that glue goes with layers.0, which still runs
    # after embed_positions).
    first_seen: dict[str, int] = {}
    for i, n in enumerate(nodes):
        u = node_unit[n]
        if u is not None:
            first_seen.setdefault(u, i)
    big = len(nodes) + 1
    unit_names = sorted(unit_names, key=lambda u: (first_seen.get(u, big), unit_names.index(u)))

    # Glue (ops outside every unit: position ids, masks) goes with the first unit that uses it.
    order = {u: i for i, u in enumerate(unit_names)}
    for n in reversed(nodes):
        if node_unit[n] is None:
            users = [node_unit.get(u) for u in n.users if node_unit.get(u) is not None]
            node_unit[n] = min(users, key=lambda u: order[u]) if users else None

    layer_first: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n in node_layer:
            layer_first.setdefault(node_layer[n], i)
    ordered_layers = sorted(layer_names, key=lambda m: (layer_first.get(m, big), layer_names.index(m)))

    return Assignment(nodes=nodes, layer_mods=layer_mods, node_layer=node_layer, node_unit=node_unit,
                      unit_names=unit_names, unit_kind=dict(unit_list), ordered_layers=ordered_layers, by_id=by_id,
                      attention=attention)


def _packed_attention(ep: torch.export.ExportedProgram, layer_mods: dict[str, nn.Module],
                      node_layer: dict[torch.fx.Node, str]) -> dict[str, str]:
    """nn.MultiheadAttention calls its projections through its own parameters (``F.multi_head_attention_forward``),
    so every op of it sits in the MHA module. Under self-attention (query is key is value) its packed
    ``in_proj_weight`` [3E, E] is read by linear ops alone: those are the MHA layer's own (a Linear of 3 fused
    pieces), out_proj's linear is out_proj's, and the attention core between them belongs to no layer, as in any
    other attention (`node_layer` is updated in place). Returns MHA FQN -> "" for those, else why it stays whole
    (cross-attention splits the weight inside forward)."""
    params = ep.graph_signature.inputs_to_parameters
    placeholder = {params[n.name]: n for n in ep.graph.nodes if n.op == "placeholder" and n.name in params}
    out: dict[str, str] = {}
    for m, mod in layer_mods.items():
        if not isinstance(mod, nn.MultiheadAttention):
            continue
        prefix = f"{m}." if m else ""
        w, ow = placeholder.get(f"{prefix}in_proj_weight"), placeholder.get(f"{prefix}out_proj.weight")
        if not mod._qkv_same_embed_dim or mod.bias_k is not None or w is None or ow is None:
            out[m] = "pattern: nn.MultiheadAttention with separate q, k and v weights (kdim or vdim) or bias_k " \
                     "and bias_v is kept whole"
            continue
        other = next((u for u in w.users if u.target is not aten.linear.default or u.args[1] is not w), None)
        if other is not None:
            out[m] = f"pattern: nn.MultiheadAttention reads its packed in_proj_weight in {other.target}, not in " \
                     f"one linear (query is not key and value: cross-attention splits the weight in forward); " \
                     f"only self-attention is split"
            continue
        out[m] = ""
        for n in [n for n, layer in node_layer.items() if layer == m]:
            if n.target is aten.linear.default and n.args[1] is w:
                continue
            if n.target is aten.linear.default and n.args[1] is ow:
                node_layer[n] = f"{prefix}out_proj"
            else:
                del node_layer[n]
    return out


def build_graph(ep: torch.export.ExportedProgram, model: nn.Module, stats: dict[torch.fx.Node, NodeStats], *,
                name: str, seq_len: int | None) -> ModelGraph:
    """The `ModelGraph` of an exported model and its per-node costs (`measure`), in steps."""
    a = assign(ep, model)                                  # 1. node -> layer and unit; execution order
    tied, counted = _tied(a)                               # 2. tied parameters: one canonical name each
    layer_out = _layer_outputs(a)                          # 3. the node that carries each layer's output
    linear_out = {m: layer_out[m] for m in a.ordered_layers
                  if a.kind(m) == "linear" and m in layer_out}
    shard = ShardAnalysis(ep.graph, a.node_layer, linear_out)  # 4. where a colwise split flows without collectives
    layers = _layers(a, shard, counted)                    # 5. layers: shapes, split groups, fused pieces
    units = _costs(a, stats, layers, shard, layer_out)     # 6. per-node costs into layers and units
    mark_inner(ep.graph, a.node_layer, param_placeholders(ep), layers, stats)  # experts: split inside
    unit_index = {u: i for i, u in enumerate(a.unit_names)}
    edges = _edges(a.nodes, a.node_layer, a.node_unit, unit_index, layers, shard, layer_out,  # 7. data flow
                   {u for u, k in a.unit_kind.items() if k == "block"})
    cuts = pipeline_cuts(ep, a, units, stats)             # 8. bytes across each pipeline cut; unit inputs
    cut_ok = realizable_cuts(a)                            #    and which cuts the program can make
    for u in units.values():
        u.signature = _signature(u, layers)                # 9. identical blocks share TP decisions
    ordered = [units[u] for u in a.unit_names]
    first_req, last_req = _required_ends(ordered)          # 10. embeddings first, head last
    return ModelGraph(name=name, num_params=sum(_numel(tuple(p.shape)) for p in _unique_params(model)),
                      seq_len=seq_len or 1, units=ordered, layers={m: layers[m] for m in a.ordered_layers},
                      edges=edges, cut_bytes=cuts.per_sample, cut_grad_bytes=cuts.grad_per_sample,
                      cut_fixed_bytes=cuts.fixed, cut_grad_fixed_bytes=cuts.grad_fixed, cut_ok=cut_ok, tied=tied,
                      first_unit_required=first_req,
                      last_unit_required=last_req, info=_model_info(layers, ordered, seq_len))


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


def _layer_outputs(a: Assignment) -> dict[str, torch.fx.Node]:
    """Layer FQN -> its last node consumed outside it (the layer's output)."""
    out: dict[str, torch.fx.Node] = {}
    for n in a.nodes:
        if n in a.node_layer and any(a.node_layer.get(u) != a.node_layer[n] for u in n.users):
            out[a.node_layer[n]] = n
    return out


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
        unit = _owner(m, a.unit_names) or (a.unit_names[0] if a.unit_names else "")
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
           layer_out: dict[str, torch.fx.Node]) -> dict[str, Unit]:
    """Units with their layers, and every node's GEMMs, bytes moved and bytes saved added to its layer (or, outside
    layers, to its unit: the attention core)."""
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
        if layer is None:
            unit.op_saved_bytes += saved
            unit.op_saved_bytes_replicated += saved if whole else 0
    for m, n in layer_out.items():
        if m in layers:
            layers[m].out_bytes = val_bytes(n)
    return units


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
            if node_layer.get(a) == dst:
                continue
            srcs = {out_node_of[a]} if a in out_node_of else set(sources.get(a, ()))
            for s in srcs:
                if s == dst or (s, dst) in found:
                    continue
                region = shard.regions.get(s)
                ok = bool(region and region.valid and region.reaches.get(dst) and layers[dst].kind == "linear")
                found[(s, dst)] = Edge(src=s, dst=dst, bytes=_read_bytes(layers[s].out_bytes, a, n), shard_ok=ok)
    return list(found.values())


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
    with norms_on_any_batch():  # one sample: a BatchNorm may see one value per channel
        stats = measure(ep, args, kwargs, seq_len, fused_attention=fused_attention)
    graph = build_graph(ep, model, stats, name=name, seq_len=seq_len)
    t2 = time.perf_counter()
    return Traced(graph=graph, exported=ep, model=model, trace_s=t1 - t0, measure_s=t2 - t1)


def _tokens_from_graph(ep: torch.export.ExportedProgram) -> int | None:
    """Tokens per sample when no input says it: rows of the first Linear's input at one sample."""
    for n in ep.graph.nodes:
        if n.op == "call_function" and n.target is aten.linear.default:
            shape = n.args[0].meta.get("val").shape
            return int(shape[-2]) if len(shape) >= 3 else None
    return None


