"""Export an unmodified model on the meta device; a failure becomes one line naming the module and source line.

``torch.export.export(model, args, kwargs, strict=False)`` with meta parameters and inputs. When it fails, the
forward runs again eagerly with module hooks to find the module that fails, and the message says what to change.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import os
import re
import sys

import torch
from torch import nn

from partc.errors import PartcError, first_line
from partc.frames import exception_frames, innermost, stack_trace_frames
from partc.passes.causal_mask import drop_causal_masks
from partc.precision import MixedPrecisionError, forward_casts

aten = torch.ops.aten


def export_on_meta(model: nn.Module, args: tuple, kwargs: dict, *, path: str = "",
                   precision: str = "fp32", samples: int = 1) -> torch.export.ExportedProgram:
    """Export `model` (already on meta) with meta example inputs (of `samples` samples: a value-sized op's expected
    size is per sample, `concrete_sizes`), under the forward's casts at `precision`
    (`partc.precision.forward_casts`: at bf16 the casts are ops of the graph). Errors name the module and source
    line, and an op that cannot take the dtypes it meets at bf16 is named, with ``--precision fp32`` to try."""
    calls: list[str] = []
    try:
        with _quiet_export(), norms_on_any_batch(), _checkpoint_calls(calls), forward_casts(precision):
            ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # noqa: BLE001 - anything export raises is a model the tracer cannot handle
        with norms_on_any_batch(), forward_casts(precision):
            where = _locate_failure(model, args, kwargs, e)
        mixed = _mixed_precision_error(e)
        first = first_line(mixed or e)
        hint = (f"; at --precision {precision} parameters and activations are {precision}, tensors the model makes "
                f"keep their dtype: train with --precision fp32") if mixed is not None else \
            _experts_hint(model) or failure_hint(e)
        raise PartcError(f"cannot trace {path or type(model).__name__}{where}: {type(e).__name__}: {first}{hint}") \
            from None
    ep.graph_module.meta[CHECKPOINT_CALLS] = calls
    inline_grad_regions(ep, path=path)
    concrete_sizes(ep, args, kwargs, path=path, samples=samples)
    device_neutral(ep)
    drop_causal_masks(ep)
    linears_of_transposes(ep)
    return ep


TRACE_ASSERTS = (aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
                 aten.sym_constrain_range.default)
"""torch.export's checks on unbacked sizes: their bounds are the traced sample's (``u0 <= 6`` tokens at one sample),
not the program's micro-batch, so the program does not run them."""


def _unbacked(val) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    try:
        return bool(free_unbacked_symbols(val))
    except Exception:  # noqa: BLE001 - a value free_unbacked_symbols does not walk
        return False


def _where(n: torch.fx.Node, path: str) -> str:
    stack = [re.sub(r"@\d+$", "", p) for p, _ in (n.meta.get("nn_module_stack") or {}).values()]
    where = f" in module {stack[-1]}" if stack and stack[-1] else ""
    frame = innermost(stack_trace_frames(n.meta.get("stack_trace")))
    return where + (f" at {frame.filename}:{frame.lineno}" if frame is not None else "")


def concrete_sizes(ep: torch.export.ExportedProgram, args: tuple, kwargs: dict, *, path: str = "",
                   samples: int = 1) -> None:
    """Give a graph that torch.export traced with unbacked sizes (`partc.value_sized`) concrete values at the
    expected sizes, in place: every node's ``val`` becomes its value at those sizes and a node whose size depended
    on values is marked (`VALUE_SIZED`); torch.export's runtime checks of those sizes (`TRACE_ASSERTS`) and the
    size arithmetic only they read leave the graph. The expectation: each value-sized op (`VALUE_SIZED_OPS`) reads a
    mask ``x == c``, and the `n` such ops comparing one tensor `x` (the routing's choice, one per expert) each select
    1/n of its elements, a whole number per sample of the `samples` the inputs hold (`partc.value_sized.
    expected_rows`, as `partc check` runs it). A value-sized op of another form is refused in one line."""
    from partc.value_sized import EXPECTED_SIZES, VALUE_SIZED, VALUE_SIZED_OPS, ExpectedSizes

    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    if not any(_unbacked(n.meta.get("val")) for n in nodes):
        return
    sized = [n for n in nodes if n.target in VALUE_SIZED_OPS]
    others = [n for n in nodes if _unbacked(n.meta.get("val")) and n.target not in VALUE_SIZED_OPS
              and not any(_unbacked(x.meta.get("val")) for x in n.all_input_nodes)]
    if others:
        raise PartcError(f"cannot trace the model: {others[0].target}{_where(others[0], path)}: {VALUE_SHAPED_HINT}")
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in sized:
        mask = n.args[0]
        if not (isinstance(mask, torch.fx.Node) and mask.target in (aten.eq.Scalar, aten.eq.Tensor)
                and isinstance(mask.args[0], torch.fx.Node)):
            raise PartcError(f"cannot trace the model: {n.target}{_where(n, path)}: {VALUE_SHAPED_HINT}")
        groups.setdefault(mask.args[0], []).append(n)
    counts = {len(g) for g in groups.values()}
    if len(counts) != 1 or counts == {1}:
        n = sized[0]
        raise PartcError(f"cannot trace the model: {n.target}{_where(n, path)}: {VALUE_SHAPED_HINT} (the same "
                         f"number of experts, two or more, on each routed tensor)")
    n_groups = counts.pop()
    for n in list(reversed(ep.graph.nodes)):  # the checks, then what only they read
        if n.op == "call_function" and (n.target in TRACE_ASSERTS or (
                not n.users and (n.target is aten.sym_size.int or getattr(n.target, "__module__", "") in
                                 ("_operator", "operator")))):
            ep.graph.erase_node(n)
    ep.graph_module.recompile()
    marked = {n for n in ep.graph.nodes if _unbacked(n.meta.get("val"))}
    mode = ExpectedSizes(n_groups, samples)
    vals: dict[str, object] = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            vals[n.name] = out
            return out

    flat = ep._graph_module_flat_inputs(args, kwargs)
    with torch.no_grad(), mode:
        Record(ep.graph_module).run(*flat)
    for n in ep.graph.nodes:
        if n.name in vals and n.op == "call_function":
            n.meta["val"] = vals[n.name]
        if n in marked:
            n.meta[VALUE_SIZED] = True
    first = sized[0]
    frame = innermost(stack_trace_frames(first.meta.get("stack_trace")))
    ep.graph_module.meta[EXPECTED_SIZES] = {
        "op": str(first.target), "where": f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame else "",
        "groups": n_groups, "calls": len(sized)}


CHECKPOINT_CALLS = "partc_checkpoint_calls"
"""Graph-module meta key: ``file:line`` of each call of ``torch.utils.checkpoint`` in the model's forward, in order
(an export without torch.compile runs the checkpointed function inline: the graph keeps no trace of it)."""


@contextlib.contextmanager
def _checkpoint_calls(calls: list[str]):
    """Record in `calls` where the model's forward calls ``torch.utils.checkpoint.checkpoint`` (either variant): the
    function is imported by name into the model's module, so the two implementations it dispatches to, looked up
    in torch.utils.checkpoint at each call, are wrapped instead."""
    import traceback

    import torch.utils.checkpoint as ckpt

    def note():
        frame = innermost(traceback.extract_stack()[:-2])
        calls.append(f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame is not None else "forward")

    generator, function = ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction

    def noted_generator(*args, **kwargs):
        note()
        return generator(*args, **kwargs)

    class NotedFunction(function):
        @classmethod
        def apply(cls, *args, **kwargs):
            note()
            return function.apply(*args, **kwargs)

    ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = noted_generator, NotedFunction
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = generator, function


GRAD_ENABLED = "partc_grad_enabled"
"""Node meta key: False for an op of a ``torch.no_grad()`` / ``torch.set_grad_enabled(False)`` region of the model's
forward (True for an enabling region nested in one). The measurement runs such an op without autograd and the
program runs it under ``torch.no_grad()`` (`partc.passes.codegen`)."""

_GRAD_REGION = "wrap_with_set_grad_enabled"


def inline_grad_regions(ep: torch.export.ExportedProgram, *, path: str = "") -> None:
    """Inline, in place, the higher-order ops torch.export leaves for the model's grad-mode regions
    (``with torch.no_grad():`` becomes ``wrap_with_set_grad_enabled(False, submod, *operands)``): each op of the
    region goes into the graph itself, marked with `GRAD_ENABLED`, so every later pass (measurement, the layer graph,
    the TP rewrite, stage and unit placement) sees plain ATen ops, and the program runs them under the grad mode
    the model asked for. Any other higher-order op (autocast, torch.cond, ...) is refused with one line: the
    program is straight-line ATen code, and partc writes no program it cannot run."""
    gm = ep.graph_module
    graph = ep.graph
    changed = False
    while True:
        hops = [n for n in graph.nodes if n.op == "call_function"
                and isinstance(n.target, torch._ops.HigherOrderOperator)]
        if not hops:
            break
        for n in hops:
            if n.target.name() != _GRAD_REGION:
                raise PartcError(higher_order_refusal(n, path))
            _inline_region(ep, n)
            changed = True
    if changed:
        for name, _ in list(gm.named_children()):
            if not any(x.op == "get_attr" and x.target == name for x in graph.nodes):
                delattr(gm, name)
        graph.lint()
        gm.recompile()


def _inline_region(ep: torch.export.ExportedProgram, n: torch.fx.Node) -> None:
    gm, graph = ep.graph_module, ep.graph
    enabled, sub, *operands = n.args
    assert isinstance(sub, torch.fx.Node) and sub.op == "get_attr", n.format_node()
    body: torch.fx.GraphModule = getattr(gm, sub.target)
    env: dict[torch.fx.Node, object] = {}
    placeholders = [x for x in body.graph.nodes if x.op == "placeholder"]
    assert len(placeholders) == len(operands), n.format_node()
    env.update(zip(placeholders, operands))
    outputs: tuple = ()
    taken = {x.target for x in graph.nodes if x.op == "get_attr"} | {name for name, _ in gm.named_children()}
    with graph.inserting_before(n):
        for x in body.graph.nodes:
            if x.op == "placeholder":
                continue
            if x.op == "output":
                outputs = tuple(x.args[0])
                break
            if x.op == "get_attr":  # a region nested in this one: its body moves to the graph module
                name, i = f"{x.target}_inlined", 0
                while name in taken:
                    i += 1
                    name = f"{x.target}_inlined_{i}"
                taken.add(name)
                gm.add_submodule(name, getattr(body, x.target))
                new = graph.get_attr(name)
                new.meta.update(x.meta)
            else:
                new = graph.node_copy(x, lambda a: env[a])
                if new.op == "call_function":  # a region nested in this one sets its own ops' mode later
                    new.meta[GRAD_ENABLED] = bool(enabled)
            env[x] = new
    results = [env[o] if isinstance(o, torch.fx.Node) else o for o in outputs]
    for user in list(n.users):
        assert user.target is operator.getitem, user.format_node()
        result = results[user.args[1]]
        user.replace_all_uses_with(result)
        for spec in ep.graph_signature.output_specs:  # a model output the region made keeps its place
            if getattr(spec.arg, "name", None) == user.name:
                spec.arg.name = result.name
        graph.erase_node(user)
    graph.erase_node(n)
    if not sub.users:
        graph.erase_node(sub)


_HOP_WHAT = {
    "wrap_with_autocast": ("torch.autocast in forward", "the dtypes it picks are decided at run time, not in the "
                           "traced graph: remove it and choose the precision with --precision (bf16 runs the "
                           "model's matmuls in bfloat16)"),
    "cond": ("torch.cond", "a program of straight-line ops takes no branch: compute both branches and select with "
             "torch.where(pred, a, b)"),
    "while_loop": ("torch.while_loop", "unroll the loop to a fixed count in Python"),
    "map_impl": ("torch.map", "loop over the leading dimension in Python"),
    "tag_activation_checkpoint": ("torch.utils.checkpoint", "call it outside torch.compile, or leave recomputation "
                                  "to partc (--recompute)"),
}


def higher_order_refusal(n: torch.fx.Node, path: str = "") -> str:
    """One line refusing the higher-order op `n`: what it is, where in the model, and what to write instead."""
    name = n.target.name()
    what, hint = _HOP_WHAT.get(name, (f"the higher-order op {name}", "write that part of forward as plain tensor ops"))
    frame = innermost(stack_trace_frames(n.meta.get("stack_trace")))
    if frame is None:  # the op itself has no stack trace: its first user or its body's first op has
        for x in list(n.users) + [a for a in n.args if isinstance(a, torch.fx.Node)]:
            frame = innermost(stack_trace_frames(x.meta.get("stack_trace")))
            if frame is not None:
                break
    where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
    return f"cannot compile {path or 'the model'}: {what}{where} cannot be written into partc's program; {hint}"


def _mixed_precision_error(e: BaseException) -> MixedPrecisionError | None:
    """The `MixedPrecisionError` that caused `e` (export may wrap it), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, MixedPrecisionError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def device_neutral(ep: torch.export.ExportedProgram) -> None:
    """Rewrite, in place, the ops of `ep` that are valid on the tracing device only, so that the program runs on
    any device. A model may branch on its tensors' device type, and the trace, on meta, takes the branch for
    neither CPU nor CUDA: Hugging Face's MoE experts count tokens per expert with `torch.histc` on int32 off CPU
    and MPS (CUDA's deterministic kernel takes integers, CPU's takes floating point only). An integer `histc`
    becomes one on float32 (exact for counts below 2**24), its result cast back to the input's dtype: what the
    model runs on CPU, and valid on CUDA too."""
    graph = ep.graph
    changed = False
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.histc.default:
            continue
        x, val = n.args[0], n.meta.get("val")
        if not isinstance(x, torch.fx.Node) or val is None or val.is_floating_point():
            continue
        with graph.inserting_before(n):
            as_float = graph.call_function(aten.to.dtype, (x, torch.float32))
        as_float.meta.update(n.meta, val=x.meta["val"].to(torch.float32))
        n.replace_input_with(x, as_float)
        with graph.inserting_after(n):
            back = graph.call_function(aten.to.dtype, (n, val.dtype))
        n.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        back.meta.update(n.meta)
        n.meta["val"] = val.to(torch.float32)
        changed = True
    if changed:
        graph.lint()
        ep.graph_module.recompile()


def _transposed_weight(n: torch.fx.Node, params: set[str]) -> torch.fx.Node | None:
    """The 2-D parameter `n` transposes (``w.T``, ``w.t()``, ``w.transpose(0, 1)``, ``w.permute(1, 0)``), or None."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], torch.fx.Node):
        return None
    w = n.args[0]
    val = w.meta.get("val")
    if w.op != "placeholder" or w.name not in params or not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    if n.target in (aten.numpy_T.default, aten.t.default):
        return w
    if n.target is aten.transpose.int and {d % 2 for d in n.args[1:3]} == {0, 1}:
        return w
    if n.target is aten.permute.default and [d % 2 for d in n.args[1]] == [1, 0]:
        return w
    return None


def linears_of_transposes(ep: torch.export.ExportedProgram) -> None:
    """Rewrite, in place, ``x @ w.T`` of a 2-D parameter `w` (Falcon's linear layers multiply so) into
    ``linear(x, w)``: the same product (``linear`` is ``matmul(x, w.t())``), in the form the layer analysis, the
    tensor-parallel split and the FLOP count read as a linear layer."""
    params = {spec.arg.name for spec in ep.graph_signature.input_specs
              if spec.kind == torch.export.graph_signature.InputKind.PARAMETER}
    graph = ep.graph
    changed = False
    for n in list(graph.nodes):
        w = _transposed_weight(n, params)
        users = list(n.users) if w is not None else []
        if len(users) != 1 or users[0].target is not aten.matmul.default or list(users[0].args[1:]) != [n] \
                or users[0].args[0] is n or users[0].kwargs:
            continue
        mm = users[0]
        mm.target = aten.linear.default
        mm.args = (mm.args[0], w)
        graph.erase_node(n)
        changed = True
    if changed:
        graph.lint()
        ep.graph_module.recompile()


# When torch.export meets data-dependent code it logs warnings and prints the partial graph to stderr; the one-line
# PartcError already says what failed and where, so that output is dropped on failure (and passed on on success).
# TORCH_LOGS, when set, is left to the user.
_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export",
                   "torch._subclasses.fake_tensor")  # the last logs a traceback for an op whose shapes do not fit


@contextlib.contextmanager
def _quiet_export():
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    loggers = [logging.getLogger(name) for name in _EXPORT_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
        sys.stderr.write(captured.getvalue())
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


@contextlib.contextmanager
def norms_on_any_batch():
    """BatchNorm in training refuses one value per channel (one sample whose map is 1 x 1, ResNet's last stage on
    a small image; BatchNorm1d on one sample), and the fake-tensor rule behind its shapes divides by n - 1 for the
    running variance. The trace is of one sample on meta: shapes only, no values, so both are off while tracing
    (the shapes are those of any batch). `partc.compile` keeps such a model off micro-batches of one sample."""
    import torch.nn.functional as F
    from torch._decomp import decompositions as D

    saved = F._verify_batch_size, D.native_batch_norm_helper
    helper = saved[1]

    def one_value_helper(input, weight, bias, running_mean, running_var, training, momentum, eps, functional):
        if not (training and running_var is not None and input.numel() == input.shape[1]):
            return helper(input, weight, bias, running_mean, running_var, training, momentum, eps, functional)
        out = helper(input, weight, bias, running_mean, None, training, momentum, eps, functional)
        new_var = running_var * (1 - momentum)  # the update's shape and dtype (a meta trace has no values)
        if not functional:
            running_var.copy_(new_var)
        return (*out[:4], new_var)

    F._verify_batch_size, D.native_batch_norm_helper = (lambda size: None), one_value_helper
    try:
        yield
    finally:
        F._verify_batch_size, D.native_batch_norm_helper = saved


def _model_frame(e: BaseException) -> str:
    """file:line of the innermost frame of model code in `e`'s traceback ('' if none)."""
    frame = innermost(exception_frames(e))
    return "" if frame is None else f"{frame.filename}:{frame.lineno}"


def _locate_failure(model: nn.Module, args, kwargs, export_error: Exception) -> str:
    """Re-run the forward eagerly on meta with module hooks to name the module that fails."""
    stack: list[str] = []
    hooks = []
    failing: list[str] = []

    def pre(name):
        def hook(mod, inputs):
            stack.append(name)
        return hook

    def post(name):
        def hook(mod, inputs, output):
            if stack and stack[-1] == name:
                stack.pop()
        return hook

    for name, mod in model.named_modules():
        hooks.append(mod.register_forward_pre_hook(pre(name or type(model).__name__)))
        hooks.append(mod.register_forward_hook(post(name or type(model).__name__)))
    frame = _model_frame(export_error)
    try:
        model(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        failing = list(stack)
        frame = _model_frame(e) or frame
    finally:
        for h in hooks:
            h.remove()
    parts = []
    if failing:
        parts.append(f"in module {failing[-1]}")
    if frame:
        parts.append(f"at {frame}")
    return (" " + " ".join(parts)) if parts else ""


def _experts_hint(model: nn.Module) -> str:
    """'; ...' for a Hugging Face mixture of experts set to its eager experts (a Python loop over the experts that
    tokens were routed to: data-dependent, so no trace can hold it); '' otherwise."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "eager":
        return ""
    return ("; the model's experts_implementation='eager' loops over the experts its tokens were routed to, which "
            "no trace can hold: set experts_implementation='grouped_mm' in its config (the default: one grouped GEMM over all experts)")


VALUE_SHAPED_HINT = (
    "its output's size depends on tensor values (nonzero, torch.where(mask) with one argument, boolean-mask "
    "indexing, unique), which partc prices only as a mixture's routing, idx = torch.nonzero(choice == e) once per "
    "expert e: write it so, or keep every shape fixed, e.g. for a mixture of experts "
    "run each expert on all tokens and multiply its output by its routing weight times the mask "
    "(y = y + expert(x) * (weight * (choice == e)).unsqueeze(-1)), or use one grouped GEMM over the experts")
"""What to write instead of an op whose output size depends on values (the hint names no such op as the fix)."""


def failure_hint(e: Exception) -> str:
    """What to change in the model for an error torch.export (or a meta run) raised: '; ...' or ''."""
    text = f"{type(e).__name__} {e}"
    if re.search(r"nonzero|data-independent|unbacked", text, re.I):
        return "; " + VALUE_SHAPED_HINT
    if re.search(r"data.dependent|GuardOnDataDependent|meta tensor|item\(\)|Could not guard", text, re.I):
        return ("; replace Python control flow on tensor values (if/while on a tensor, .item(), .tolist()) with "
                "tensor ops such as torch.where, or compute it outside forward")
    if re.search(r"must have same reduction dim|shapes cannot be multiplied|size mismatch|must match the size|"
                 r"Expected .*input.* to have \d+ channels", text):
        return "; the shapes of example_inputs do not fit the model's layers: check the sizes example_inputs returns"
    return "; the model must run under torch.export.export(model, args, strict=False) on meta tensors"

