"""Which layer and which unit each node of an exported graph belongs to (`assign`), read from the nodes'
``nn_module_stack``: a layer is a weight-bearing module (Linear, Embedding, a norm, a convolution, ...), a unit a
repeated block or another top-level module, the granularity of pipeline stages and of recomputation. The layer graph
(`passes.trace.build_graph`) and the program (`passes.codegen`) both place nodes by it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from partc.passes.measure import stack_fqns

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


def owner(fqn: str, names: set[str] | list[str]) -> str | None:
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
            unit = owner(m, unit_set)
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


def layer_outputs(a: Assignment) -> dict[str, torch.fx.Node]:
    """Layer FQN -> its last node consumed outside it (the layer's output)."""
    out: dict[str, torch.fx.Node] = {}
    for n in a.nodes:
        if n in a.node_layer and any(a.node_layer.get(u) != a.node_layer[n] for u in n.users):
            out[a.node_layer[n]] = n
    return out
