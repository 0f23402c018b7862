"""`partc check`'s memory tracker: torch's FSDP2 memory tracker (``FSDPMemTracker``) over every stage module and
optimizer of one rank, each storage filed under the plan's categories (`categories`), with the
most each category holds at any moment of the step beside the peak of the total. Where FSDP's bookkeeping and the
plan's categories differ (a gathered parameter, an accumulation that becomes a gradient, the tensors DTensor's
sharding propagation makes on fake tensors), the hooks here say which is which; `partc.runtime.check` drives it.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from partc._torch import TRACKER_TOTAL, FSDPMemTracker, FSDPModMemStats, FSDPRefType
from partc.runtime.api import Program
from partc.runtime.stage import StageModule, UnitModule


CATEGORIES = ("params", "grads", "optimizer", "activations")
"""The plan's memory categories (``predicted.ranks[].memory_bytes``), `categories` maps the tracker's kinds to them."""


def categories(zero: int) -> dict[str, tuple[str, ...]]:
    """The plan's categories -> the tracker's kinds, by the plan's own table (`partc.passes.zero`): ``params`` are
    the sharded fp32 master weights, and below ZeRO-3 the gathered compute copies; ``grads`` the sharded fp32
    gradients, and below ZeRO-2 the unsharded fp32 accumulation (recorded as the tracker's sharded gradients, see
    `Tracker`); ``activations`` everything transient, as the plan's activations hold saved activations,
    recomputation, ZeRO's working memory (a unit's compute-dtype gradient, at ZeRO-3 the gathered units) and the
    loss (`partc.passes.memory.stage_extra_bytes`), and here also the model's buffers and the input micro-batches."""
    gathered = (FSDPRefType.UNSHARDED_PARAM,)
    params = (FSDPRefType.SHARDED_PARAM, *(gathered if zero < 3 else ()))
    transient = (FSDPRefType.ACT, FSDPRefType.TEMP, FSDPRefType.ALL_GATHER, FSDPRefType.REDUCE_SCATTER,
                 FSDPRefType.INP, FSDPRefType.BUFFER, FSDPRefType.UNSHARDED_GRAD, *(gathered if zero == 3 else ()))
    return {"params": params, "grads": (FSDPRefType.SHARDED_GRAD,), "optimizer": (FSDPRefType.OPT,),
            "activations": transient}


class Tracker(FSDPMemTracker):
    """FSDP2's memory tracker over every stage module and optimizer of this rank (the torch class takes one of each),
    recording the most each category holds at any moment besides the peak of the total."""

    def __init__(self, prog: Program, kinds: dict[str, tuple[str, ...]]):
        super().__init__(prog.stages[0], None)
        self.kinds = kinds
        self._root_mod = nn.ModuleList(prog.stages)  # the parent class walks `.modules()` and `.buffers()` only
        self._optms = list(prog.optimizers)
        self.most: dict[str, int] = {}

    def _instrument_optimizer(self) -> None:
        # The states exist already (`_create_optimizer_states`) and are updated in place; what the optimizer step
        # allocates besides (foreach AdamW's temporaries) is transient, so it is not marked as optimizer states.
        for optm in self._optms:
            self._track_optimizer_states(FSDPRefType.OPT, optm)

    def _instrument_fsdp_module(self) -> None:
        # The packed experts' FSDP groups (ep under ZeRO 1-3) are gathered by `FSDPModule.unshard`, not by a forward
        # of their module (the stage code reads their tensors): their gathered copies are recorded when they arrive.
        super()._instrument_fsdp_module()
        self._unshards: list[Any] = []
        for module in self._root_mod.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            if group is not None and not isinstance(module, (StageModule, UnitModule)):
                self._unshards.append((group, group.wait_for_unshard))
                group.wait_for_unshard = self._recorded_unshard(group, group.wait_for_unshard)

    def _fsdp_state_pre_forward(self, fsdp_mod: nn.Module, orig: Callable) -> Callable:
        # The torch tracker refuses a second forward of a module called from no other (it takes it for the next
        # step), but the schedule calls the stage once a micro-batch. The stage holds parameters of its own, and so
        # its forward is instrumented, where units share a weight (a tied embedding and head on one stage stay in
        # the stage's group, `apply_zero`): its later micro-batches are the same step, recorded as a module called
        # again within it. The stage's name is known once its forward has begun: a parent besides "Global".
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def pre_forward(*args: Any, **kwargs: Any) -> Any:
            tracker = self._mod_tracker
            again = fsdp_mod in self.memory_tracking and not tracker.is_bw and "partc.step" not in tracker.parents
            if again:
                tracker.parents.add("partc.step")
            try:
                return inner(*args, **kwargs)
            finally:
                if again:
                    tracker.parents.discard("partc.step")

        return pre_forward

    def _recorded_unshard(self, group: Any, orig: Callable) -> Callable:
        def wait_for_unshard(*args: Any, **kwargs: Any) -> None:
            orig(*args, **kwargs)
            for fsdp_param in group.fsdp_params:
                self._update_and_maybe_create_winfos(fsdp_param.unsharded_param, FSDPRefType.UNSHARDED_PARAM)

        return wait_for_unshard

    def _deregister_module_and_optimizer_hooks(self) -> None:
        super()._deregister_module_and_optimizer_hooks()
        for group, orig in self._unshards:
            group.wait_for_unshard = orig
        self._unshards.clear()

    def _fsdp_param_group_post_backward(self, fsdp_mod: nn.Module, orig: Callable) -> Callable:
        # ZeRO 0 and 1 accumulate each micro-batch's gradient unsharded in fp32 until the last one (FSDP's
        # ``unsharded_accumulated_grad``): the plan's gradients, which the torch tracker leaves as temporaries. They
        # are recorded as sharded gradients, the kind the plan's ``grads`` take (`categories`), apart from the
        # compute-dtype gradient of the unit (unsharded gradients), which the plan counts as working memory.
        inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig)

        def post_backward(*args: Any, **kwargs: Any) -> None:
            if fsdp_mod not in self.memory_tracking:  # packed experts (ep): the stage code reads their tensors
                # without calling their module, whose forward the torch tracker would have recorded
                self.memory_tracking[fsdp_mod] = FSDPModMemStats(self._mod_tracker.get_known_fqn(fsdp_mod) or "")
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            with self._reduction_output_as_gradient(group), self._accumulation_as_gradient(group):
                inner(*args, **kwargs)
            for fsdp_param in group.fsdp_params if group is not None else ():
                grad = fsdp_param.unsharded_accumulated_grad
                if grad is not None:
                    self._update_and_maybe_create_winfos(grad, FSDPRefType.SHARDED_GRAD)

        return post_backward

    @contextlib.contextmanager
    def _accumulation_as_gradient(self, group: Any) -> Iterator[None]:
        """While `group`'s post-backward runs: ZeRO 0 and 1 start each parameter's fp32 accumulation from its first
        micro-batch's compute-dtype gradient (FSDP's ``to_accumulated_grad_if_needed``: the copy made, then the
        gradient dropped). The copy is the plan's gradient (``grads``) from the moment it is allocated, not a
        temporary until the post-backward returns (beside the compute-dtype gradients of the rest of the group,
        one parameter's fp32 gradient in the transient memory: a layer's gate and up projections of its packed
        experts, where they are a group of their own)."""
        params = list(group.fsdp_params) if group is not None else []
        for p in params:
            p.to_accumulated_grad_if_needed = self._as_gradient(p.to_accumulated_grad_if_needed, lambda: True)
        try:
            yield
        finally:
            for p in params:
                del p.to_accumulated_grad_if_needed  # the class's method again

    @contextlib.contextmanager
    def _reduction_output_as_gradient(self, group: Any) -> Iterator[None]:
        """While `group` reduces its gradients, where none of its parameters holds a sharded gradient yet (ZeRO 0 and
        1; ZeRO 2 and 3 in the first micro-batch), the reduction's output is the new sharded gradient from the moment
        it is allocated (FSDP's ``foreach_reduce``: the input, the accumulation copied into it and freed, then the
        output). The torch tracker records it as a temporary until the reduction returns: with the input beside it,
        one unit's fp32 gradient twice in the transient memory (the plan's activations), never in the gradients.
        It is made the plan's kind (``grads``) as it is allocated (the second allocation of the group's
        reduce-scatter in the call), where the accumulation it replaces is gone by then; one still held beside it
        (an embedding's, at dp 2) leaves it working memory, as the plan charges it."""
        comm = getattr(group, "_reduce_scatter_comm", None)
        if comm is None or any(p.sharded_param.grad is not None for p in group.fsdp_params):
            yield
            return
        allocate, own, calls = comm.allocate, vars(comm).get("allocate"), [0]
        folded = [weakref.ref(p.unsharded_accumulated_grad) for p in group.fsdp_params
                  if p.unsharded_accumulated_grad is not None]

        def second_with_nothing_folded() -> bool:
            calls[0] += 1
            return calls[0] == 2 and all(ref() is None for ref in folded)

        comm.allocate = self._as_gradient(allocate, second_with_nothing_folded)
        try:
            yield
        finally:
            if own is None:
                del comm.allocate  # the class's method again
            else:
                comm.allocate = own

    def _as_gradient(self, fn: Callable, when: Callable[[], bool]) -> Callable:
        """`fn`, whose allocations are filed as the plan's gradients (``grads``) in the calls where `when()` says so
        (asked once a call, before it runs)."""
        def call(*args: Any, **kwargs: Any) -> Any:
            self._making_gradient = when()
            try:
                return fn(*args, **kwargs)
            finally:
                self._making_gradient = False

        return call

    _making_gradient = False
    _propagating = 0

    @contextlib.contextmanager
    def sharding_propagation_untracked(self) -> Iterator[None]:
        """DTensor's sharding propagation (the sharded parameters' ops in the optimizer step, on a cache miss: every
        op of the check's one step) runs the op on fake tensors of the global shapes, made under the fake mode it
        finds active, else a new one (``ShardingPropagator._propagate_tensor_meta_non_cached``). On a GPU none is
        active: they hold no memory. Here the check's is, and the tracker took them for transient memory: at
        Mixtral-8x7B's dims under ZeRO-1, the fp32 arguments of an AdamW op on a layer's experts (2.6 GiB, three of
        0.88) measured as activations beyond the plan's. They are not tracked."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def untracked(*args: Any, **kwargs: Any) -> Any:
            self._propagating += 1
            try:
                return propagate(*args, **kwargs)
            finally:
                self._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = untracked
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = propagate

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        if self._propagating:
            return
        super()._track(FSDPRefType.SHARDED_GRAD if self._making_gradient else reftype, t)

    def _update_snap(self, *args: Any, **kwargs: Any) -> None:
        super()._update_snap(*args, **kwargs)
        for snap in self._curr_mem_snap.values():
            for category, kinds in self.kinds.items():
                nbytes = sum(snap.get(k, 0) for k in kinds)
                if nbytes > self.most.get(category, 0):
                    self.most[category] = nbytes

    def _update_peak_stats(self, peak_state: Any) -> None:
        # The peak of the device only: the torch class also updates every module's own peak after every op, which
        # costs more than the op itself with thousands of modules (and no one reads them here).
        for dev, snap in self._curr_mem_snap.items():
            if snap[TRACKER_TOTAL] > self._peak_mem.get(dev, 0):
                self._peak_mem[dev] = snap[TRACKER_TOTAL]
                self._peak_mem_snap[dev] = dict(snap)

    def categories(self) -> dict[str, int]:
        """The plan's categories: the most each held at once; ``total``: the peak (one device)."""
        out = {c: self.most.get(c, 0) for c in CATEGORIES}
        out["total"] = max(self._peak_mem.values(), default=0)
        return out
