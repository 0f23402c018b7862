"""The parallel configuration of a plan: one type that validates itself, serializes itself and names the mesh.

Everything else is derived from `Parallel`: the plan's ``parallel`` section (`Parallel.to_dict` /
`Parallel.from_dict`), the one-line summary people read (`Parallel.summary`), the search's pins (`Pins`, one
optional field per choice of `Parallel`) and the CLI options that set them, the cache keys of the cost model
(`partc.reads.Reads`: every field but those a quantity declares it ignores), where each mesh axis's groups sit on
the nodes (`Parallel.spans_nodes`, `Parallel.ranks_per_node`) and the runtime's device mesh (`Parallel.degrees`,
`Parallel.coords` over the axes of `partc.mesh_axes`).

A new dimension (say, context parallelism ``cp``) is a field here, with its `MeshAxis` in `MESH` if it has one;
the cost model, the search space and the runtime's ``apply_*`` for it read the field
(docs/adding-a-dimension.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass, field, fields
from typing import Any

from partc.errors import PartcError
from partc.mesh_axes import MESH, MESH_AXES, MESH_BY_NAME, SUB_AXES_BY_NAME, group_spans_nodes

SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("bf16", "fp32")
TP_STYLES = ("colwise", "rowwise", "replicate", "inner")
"""Tensor-parallel styles of a layer (`partc.passes.tp`): Megatron-LM's colwise and rowwise splits of a Linear or an
Embedding, whole, and ``inner``: a layer split inside as Megatron splits an MLP, its first products colwise and its
last rowwise, its output a partial sum (a mixture of experts' packed weights, `partc.passes.experts`)."""

MAX_GPUS = 2**20
"""The most GPUs partc plans for (1,048,576), and the bound of each degree: several times the largest GPU clusters
built or announced, which hold a few hundred thousand. A larger count is a mistake (``--gpus 10**9``), and a plan
for it would be searched for minutes and run nowhere."""

MAX_BATCH = 2**24
"""The largest global batch (and micro-batch), in samples: 16,777,216. Large-batch training runs at tens of
thousands of samples a step (ImageNet in minutes: 32-64k) and language models at a few million tokens (a few
thousand sequences); every rank draws the whole global batch of a step (`partc.runtime.train`), so a larger one
only exhausts the host's memory."""


def _choice(help: str, *, choices: tuple | None = None, minimum: int | None = None, maximum: int | None = None,
            pin: bool = True) -> Any:
    """Field metadata: the CLI help of its pin, its allowed values (or bounds), and whether it can be pinned."""
    return {"help": help, "choices": choices, "min": minimum, "max": maximum, "pin": pin}


@dataclass(kw_only=True, slots=True, frozen=True)
class Parallel:
    dp: int = field(metadata=_choice("Pin the data-parallel degree.", minimum=1, maximum=MAX_GPUS))
    """Data-parallel degree (mesh axis ``dp``)."""
    tp: int = field(metadata=_choice("Pin the tensor-parallel degree.", minimum=1, maximum=MAX_GPUS))
    """Tensor-parallel degree (mesh axis ``tp``), inside a node unless pinned."""
    pp: int = field(metadata=_choice("Pin the pipeline-parallel degree.", minimum=1, maximum=MAX_GPUS))
    """Pipeline-parallel degree: number of pipeline ranks (mesh axis ``pp``)."""
    cp: int = field(default=1, metadata=_choice("Pin the context-parallel degree (each sequence split over cp "
                                                "ranks).", minimum=1, maximum=MAX_GPUS))
    """Context-parallel degree (mesh axis ``cp``, between ``dp`` and ``tp``): every sequence is cut in 2·cp chunks
    and cp rank i holds chunks i and 2·cp-1-i (the causal load balance of Llama 3); attention all-gathers the keys
    and values over cp (docs/context-parallel.md). Gradients are reduced, and ZeRO shards, over dp x cp."""
    zero: int = field(metadata=_choice("Pin the ZeRO stage (0-3).", choices=ZERO_STAGES))
    """ZeRO stage 0-3 over the ``dp`` axis: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    micro_batch_size: int = field(metadata=_choice("Pin the micro-batch size.", minimum=1, maximum=MAX_BATCH))
    """Samples per micro-batch on one pipeline."""
    global_batch_size: int = field(metadata=_choice("Samples per optimizer step.", minimum=1, maximum=MAX_BATCH,
                                                    pin=False))
    """Samples per optimizer step over all data-parallel replicas."""
    schedule: str = field(default="1f1b", metadata=_choice("Pin the pipeline schedule.", choices=SCHEDULES))
    """``1f1b``, ``interleaved-1f1b`` or ``gpipe``."""
    virtual_stages: int = field(default=1, metadata=_choice("Pin the model chunks per pipeline rank "
                                                            "(interleaved-1f1b).", minimum=1, maximum=MAX_GPUS))
    """Model chunks per pipeline rank (``interleaved-1f1b`` only; 1 otherwise)."""
    recompute: str = field(default="none", metadata=_choice("Pin activation recomputation.", choices=RECOMPUTE))
    """Activation recomputation: ``none``, ``selective`` (attention core) or ``full`` (block inputs only)."""
    precision: str = field(default="bf16", metadata=_choice("Compute precision (bf16 with fp32 master weights, "
                                                            "gradients and optimizer states; or fp32).",
                                                            choices=PRECISIONS))
    """``bf16``: bf16 parameters, activations and compute, fp32 master weights, gradients and optimizer states
    (`partc.precision`); ``fp32``: everything fp32. The model is traced at this precision."""
    sequence_parallel: bool = field(default=False, metadata=_choice("Sequence parallelism under tp > 1 (Korthikanti "
                                                                    "et al. 2022): activations between the "
                                                                    "tensor-parallel layers split along the sequence.",
                                                                    choices=(False, True)))
    """Under tp > 1, the activations between tensor-parallel regions (norms, dropout, residual adds) are split along
    the sequence over tp: an all-gather before each colwise layer and a reduce-scatter after each rowwise one
    replace Megatron's all-reduces (docs/sequence-parallel.md). Not a mesh axis: it reuses the ``tp`` groups."""
    sp_regather: bool = field(default=False, metadata=_choice("Under sequence parallelism, the colwise layers save "
                                                              "their 1/t of the input and all-gather it again in "
                                                              "backward (Megatron-Core): less memory, more tp "
                                                              "bytes.", choices=(False, True)))
    """Under sequence parallelism, the all-gather before the colwise layers keeps only this rank's part of the
    sequence for backward and all-gathers it again there for the weight gradients (Megatron-Core's
    ``LinearWithGradAccumulationAndAsyncCommunication``; Korthikanti et al. 2022, section 4.2.2): the activations
    a layer keeps approach 34·s·b·h/t, for one more all-gather per gather a micro-batch, issued before the input
    gradient's GEMMs and overlapped with them. Needs ``sequence_parallel``; written to plan.json only when on."""
    fuse_pointwise: bool = field(default=False, metadata=_choice(
        "Keep the norms and activations (pointwise regions between the matmuls) at their inputs and replay them in "
        "backward, and run grouped-query attention on unrepeated keys and values: a fused kernel's memory, "
        "for a little time.", choices=(False, True)))
    """The memory behaviour of fused kernels (Megatron-Core, Transformer Engine) with the model's own ops
    (`partc.passes.fuse`): each pointwise region between the matmuls (an RMSNorm written out in fp32, silu(gate) *
    up) keeps only its inputs for backward and runs again there from them (`partc.fused.pointwise`; no matmul runs
    again), and ``scaled_dot_product_attention`` reads keys and values repeated only for it unrepeated
    (``enable_gqa``). Costs the regions' memory-bound forward once more in backward. Written to plan.json only when
    on."""
    ep: int = field(default=1, metadata=_choice("Pin the expert-parallel degree: the routed experts divided among "
                                                "this many data-parallel ranks (it divides dp).", minimum=1,
                                                maximum=MAX_GPUS))
    """Expert-parallel degree, carved from the data-parallel ranks as torchtitan and Megatron-Core carve it: ``dp``
    ranks ``dp_rank // ep`` hold the same experts in groups of ``ep`` neighbours, each rank ``E/ep`` of every layer
    of packed experts (``dp_rank % ep`` its share); tokens travel to their experts' ranks and back with an
    all-to-all (`partc.collectives.expert_parallel`). A sub-axis of ``dp`` (`SUB_AXES`): its groups split the ``dp``
    groups, at each ``cp`` coordinate (each cp rank routes its own s/cp tokens). Expert gradients are reduced (and,
    with ZeRO, sharded) over the ``dp / ep`` x ``cp`` ranks holding the same experts (`expert_shard`), everything
    else over ``dp`` x ``cp`` as without it (docs/expert-parallel.md)."""
    expert_imbalance: float = field(default=1.0, metadata=_choice(
        "Price a skewed routing under ep: the busiest ep rank receives this many times the mean (token, expert) "
        "rows (>= 1.0; 1.0: uniform).", minimum=1.0, maximum=MAX_GPUS))
    """The routing the plan prices under ``ep > 1`` (not a choice of the search: an assumption the user states,
    from a run's measured imbalance, `partc run --log-jsonl`): the busiest rank of every ep group receives F times
    the mean (token, expert) rows, every rank sending it the same share ``F/ep`` of its own (a popular expert's
    rank); capped at ``ep``, all rows to one rank. The plan's ``predicted.ranks`` are that rank's: its experts'
    compute and activations F times, its all-to-alls as long as its F-times share takes to arrive, and the bytes that
    leave it (`partc.passes.cost_axes`). 1.0: uniform routing. Written to the plan only when not 1.0."""

    def __post_init__(self) -> None:
        self.validate()
        if type(self.expert_imbalance) is not float:  # 2 in a plan's JSON: the number 2.0
            object.__setattr__(self, "expert_imbalance", float(self.expert_imbalance))

    # -- validation ----------------------------------------------------------------------------------------------

    def validate(self, where: str = "parallel") -> None:
        """Each field in its range, and the batching consistent: the global batch divides into dp x micro-batch
        x micro-batches, and interleaving needs pp >= 2, v >= 2 and m a multiple of p."""
        for f in _fields(type(self)):
            _check_value(f, getattr(self, f.name), where)
        if self.world_size > MAX_GPUS:
            raise PartcError(f"{where}: {self.world_text()} GPUs, more than partc plans for ({MAX_GPUS:,})")
        if self.global_batch_size % (self.dp * self.micro_batch_size):
            raise PartcError(f"global batch size {self.global_batch_size} is not divisible by dp x micro-batch size "
                             f"= {self.dp} x {self.micro_batch_size}")
        if self.schedule == "interleaved-1f1b":
            if self.pp < 2 or self.virtual_stages < 2:
                raise PartcError("interleaved-1f1b needs pp >= 2 and virtual_stages >= 2")
            if self.num_microbatches % self.pp:
                raise PartcError(f"interleaved-1f1b needs the micro-batches ({self.num_microbatches}) to be a "
                                 f"multiple of pp ({self.pp})")
        elif self.virtual_stages != 1:
            raise PartcError(f"virtual_stages must be 1 for schedule {self.schedule}")
        if self.sequence_parallel and self.tp < 2:
            raise PartcError("sequence_parallel needs tp >= 2 (it splits the activations over the tp ranks)")
        if self.sp_regather and not self.sequence_parallel:
            raise PartcError("sp_regather needs sequence_parallel (it gathers the sequence again in backward)")
        if self.dp % self.ep:
            raise PartcError(f"ep {self.ep} does not divide dp {self.dp} (the expert-parallel ranks are carved from "
                             f"the data-parallel ones)")

    # -- derived quantities --------------------------------------------------------------------------------------

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline per step: m = B / (dp * b)."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def dp_shard(self) -> int:
        """The ranks gradients are averaged and ZeRO shards over: dp x cp (every cp rank holds every parameter and
        gets the gradient of its own tokens)."""
        return self.dp * self.cp

    @property
    def expert_shard(self) -> int:
        """The ranks holding the same experts under ep, which their gradients are averaged and ZeRO shards them over:
        ``dp / ep`` x ``cp`` (`MeshAxis.across_degree` of ``ep``; ``dp_shard`` without ep)."""
        return SUB_AXES_BY_NAME["ep"].across_degree(self)

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, axis) for axis in MESH_AXES)

    @property
    def num_stages(self) -> int:
        """Pipeline stages (model chunks): pp * virtual_stages."""
        return self.pp * self.virtual_stages

    @property
    def chunks_per_rank(self) -> int:
        """v: model chunks per pipeline rank (1 unless interleaved)."""
        return self.virtual_stages if self.schedule == "interleaved-1f1b" else 1

    @property
    def imbalance(self) -> float:
        """The routing imbalance priced: `expert_imbalance` under ep, capped at ``ep`` (the busiest rank receiving
        every row); 1.0 without ep (each rank runs its own rows through every expert)."""
        return min(self.expert_imbalance, float(self.ep)) if self.ep > 1 else 1.0

    # -- the mesh ------------------------------------------------------------------------------------------------

    def degrees(self) -> dict[str, int]:
        """Mesh axis -> its degree, in `MESH` order (outermost first)."""
        return {axis.name: axis.degree(self) for axis in MESH}

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh axis -> the coordinate of global rank `rank` (rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp
        + tp_rank)."""
        out = {}
        for axis in reversed(MESH_AXES):
            out[axis] = rank % getattr(self, axis)
            rank //= getattr(self, axis)
        return {axis: out[axis] for axis in MESH_AXES}

    def rank_of(self, **coords: int) -> int:
        """The global rank at mesh coordinates ``pp=..., dp=..., tp=...`` (inverse of `coords`)."""
        rank = 0
        for axis in MESH_AXES:
            rank = rank * getattr(self, axis) + coords[axis]
        return rank

    def _stride(self, axis: str) -> int:
        """Distance in global ranks between neighbours of an `axis` group: the product of the inner axes."""
        return math.prod(_inner_axes(axis)(self))

    def spans_nodes(self, axis: str, gpus_per_node: int) -> bool:
        """Whether a group of `axis` crosses nodes (ranks are placed on nodes in order, `gpus_per_node` each)."""
        size = getattr(self, axis)
        return size > 1 and group_spans_nodes(size, self._stride(axis), gpus_per_node)

    def ranks_per_node(self, axis: str, gpus_per_node: int) -> int:
        """Members of one `axis` group sharing a node: each has its own InfiniBand adapter, so a group spanning
        nodes crosses them that many links wide (`partc.passes.hw.link`)."""
        return max(1, min(getattr(self, axis), gpus_per_node // self._stride(axis)))

    # -- serialization and display -------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The plan's ``parallel`` section (also each alternative's): every field, and the micro-batches."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.expert_imbalance == 1.0:  # the default routing (uniform) leaves the plan as it was
            del out["expert_imbalance"]
        if not self.sp_regather:  # only when on: the plans without it read as before it existed
            del out["sp_regather"]
        if not self.fuse_pointwise:
            del out["fuse_pointwise"]
        return {**out, "num_microbatches": self.num_microbatches}

    @classmethod
    def from_dict(cls, data: dict, where: str = "parallel") -> Parallel:
        """Read `to_dict`'s output back (fields with a default may be missing); PartcError names what is wrong."""
        if not isinstance(data, dict):
            raise PartcError(f"{where} must be a JSON object")
        known = {f.name for f in fields(cls)} | {"num_microbatches"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PartcError(f"{where}: unknown field '{unknown[0]}'; known: {', '.join(sorted(known))}")
        values = {}
        for f in fields(cls):
            if f.name in data:
                values[f.name] = data[f.name]
            elif f.default is dataclasses.MISSING:
                raise PartcError(f"{where}: missing field '{f.name}'")
            _check_value(f, values.get(f.name, f.default), where)
        par = cls(**values)
        if "num_microbatches" in data and data["num_microbatches"] != par.num_microbatches:
            raise PartcError(f"{where}.num_microbatches is {data['num_microbatches']!r} but global_batch_size / "
                             f"(dp * micro_batch_size) = {par.num_microbatches}")
        return par

    def world_text(self) -> str:
        """``dp x tp x pp = 3 x 2 x 2 = 12``: how the degrees make the world size, for messages."""
        shown = self.shown_axes()
        return f"{' x '.join(shown)} = {' x '.join(str(getattr(self, a)) for a in shown)} = {self.world_size}"

    def shown_axes(self) -> tuple[str, ...]:
        """`SHOWN_AXES` but an axis with a default (``cp``) only when it is not 1."""
        return tuple(a for a in SHOWN_AXES if a in REQUIRED_AXES or getattr(self, a) != 1)

    def summary(self) -> str:
        """One line for people: ``dp=64 tp=2 pp=4 zero=3 mb=1 recompute=none interleaved-1f1b v=4`` (and ``fp32``
        when not bf16)."""
        text = " ".join(f"{a}={getattr(self, a)}" for a in self.shown_axes())
        text += f" zero={self.zero} mb={self.micro_batch_size} recompute={self.recompute} {self.schedule}"
        text += f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        text += " sp" if self.sequence_parallel else ""
        text += "+regather" if self.sp_regather else ""
        text += " fused" if self.fuse_pointwise else ""
        text += f" ep={self.ep}" if self.ep > 1 else ""
        text += f" imbalance={self.imbalance:g}" if self.imbalance != 1.0 else ""
        return text + (f" {self.precision}" if self.precision != "bf16" else "")




@functools.cache
def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """`dataclasses.fields(cls)`, looked up once (`Parallel.validate` runs for every configuration searched)."""
    return fields(cls)


@functools.cache
def _value_rule(f: dataclasses.Field) -> tuple[type, Any, Any, Any]:
    """(type, choices, min, max) of a field, read from its metadata once (the search validates every
    configuration it considers: 62,244 at 529.6B)."""
    meta = f.metadata
    typ = (int if f.type in ("int", int) else bool if f.type in ("bool", bool) else float if f.type in ("float", float)
           else str)
    return typ, meta.get("choices"), meta.get("min"), meta.get("max")


def _check_value(f: dataclasses.Field, value: Any, where: str) -> None:
    typ, choices, lo, hi = _value_rule(f)
    if (type(value) is typ and (choices is None or value in choices) and (lo is None or lo <= value)
            and (hi is None or value <= hi)):
        return  # the common case: every test passes
    if typ is float:  # a number (an integer in JSON is one too), finite; then in range, as every field
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PartcError(f"{where}.{f.name} must be a finite number, got {value!r}")
    elif typ is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise PartcError(f"{where}.{f.name} must be an integer, got {value!r}")
    elif typ is bool and not isinstance(value, bool):
        raise PartcError(f"{where}.{f.name} must be true or false, got {value!r}")
    elif typ is str and not isinstance(value, str):
        raise PartcError(f"{where}.{f.name} must be a string, got {value!r}")
    if choices is not None and value not in choices:
        raise PartcError(f"{where}.{f.name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    if lo is not None and value < lo:
        raise PartcError(f"{where}.{f.name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise PartcError(f"{where}.{f.name} must be <= {hi:,}, got {value:,}")


SHOWN_AXES = tuple(f.name for f in fields(Parallel) if f.name in MESH_AXES)
"""`MESH_AXES` in the order people read them, that of the fields of `Parallel`: ``dp, tp, pp`` (summaries,
messages, the check's rows)."""
assert sorted(SHOWN_AXES) == sorted(MESH_AXES), "every mesh axis is a degree of Parallel"

REQUIRED_AXES = tuple(f.name for f in fields(Parallel) if f.name in MESH_AXES and f.default is dataclasses.MISSING)
"""The axes every plan names (``dp, tp, pp``); the others (``cp``) default to 1 and are shown only when used."""

PINNABLE = tuple(f for f in fields(Parallel) if f.metadata["pin"])
"""The choices of `Parallel` a user may fix for the search (all but the global batch, which is an input)."""


def _pins_allows(self, par: Parallel) -> bool:
    """Whether `par` agrees with every pinned choice."""
    return all(getattr(self, f.name) is None or getattr(self, f.name) == getattr(par, f.name) for f in PINNABLE)


def _pins_pinned(self) -> dict[str, Any]:
    """The pinned choices only."""
    return {f.name: getattr(self, f.name) for f in PINNABLE if getattr(self, f.name) is not None}


def _pins_post_init(self) -> None:
    for f in PINNABLE:
        value = getattr(self, f.name)
        if value is not None:
            _check_value(f, value, "pins")


Pins = dataclasses.make_dataclass(
    "Pins", [(f.name, f"{f.type} | None", field(default=None, metadata=f.metadata)) for f in PINNABLE],
    namespace={"__doc__": "Choices of `Parallel` fixed by the user (None: searched), one field per `PINNABLE`.",
               "__post_init__": _pins_post_init, "allows": _pins_allows, "pinned": _pins_pinned,
               "__module__": __name__},
    kw_only=True, slots=True, frozen=True)


def check_gpus(gpus: int) -> None:
    """A GPU count partc plans for: 1 .. `MAX_GPUS`."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PartcError(f"--gpus must be a positive integer, got {gpus!r}")
    if gpus > MAX_GPUS:
        raise PartcError(f"--gpus {gpus:,} is more than partc plans for ({MAX_GPUS:,}, several times the largest "
                         f"GPU clusters)")


def check_pins(pins: Pins, gpus: int, *, num_units: int, max_stages: int | None = None) -> None:
    """The pinned degrees must fit the GPU count and the model; PartcError names the first that does not."""
    check_gpus(gpus)
    fixed = {a: getattr(pins, a) for a in SHOWN_AXES if getattr(pins, a) is not None}
    for axis, value in fixed.items():
        if gpus % value:
            raise PartcError(f"{MESH_BY_NAME[axis].pin} {value} does not divide the GPU count {gpus}")
    if fixed and gpus % math.prod(fixed.values()):
        raise PartcError(f"the pinned degrees {' x '.join(map(str, fixed.values()))} do not divide the GPU count "
                         f"{gpus}")
    if all(a in fixed for a in REQUIRED_AXES) and math.prod(fixed.values()) != gpus:
        raise PartcError(f"{' x '.join(fixed)} = {math.prod(fixed.values())} but --gpus is {gpus}")
    if pins.sequence_parallel and pins.tp == 1:
        raise PartcError("--sequence-parallel needs tensor parallelism (--tp 2 or more)")
    if pins.sp_regather and (pins.sequence_parallel is False or pins.tp == 1):
        raise PartcError("--sp-regather needs sequence parallelism (--sequence-parallel, --tp 2 or more)")
    others = {a: v for a, v in fixed.items() if a != "dp" and v > 1}  # the data-parallel ranks are what they leave
    if pins.ep is not None and pins.ep > 1 and (pins.dp or gpus // math.prod(others.values())) % pins.ep:
        dp = (f"--dp {pins.dp}" if pins.dp else f"the GPU count {gpus}" if not others else
              f"the {gpus // math.prod(others.values())} data-parallel ranks left of {gpus} GPUs by "
              f"{' '.join(f'{MESH_BY_NAME[a].pin} {v}' for a, v in others.items())}")
        raise PartcError(f"--ep {pins.ep} does not divide {dp} (the expert-parallel ranks are carved from the "
                         f"data-parallel ones)")
    if pins.ep is not None and pins.expert_imbalance is not None and 1 < pins.ep < pins.expert_imbalance:
        raise PartcError(f"--expert-imbalance {pins.expert_imbalance:g} is more than --ep {pins.ep} allows: the "
                         f"busiest of {pins.ep} ranks receives at most {pins.ep} times the mean (every row)")
    if pins.pp is not None and pins.pp > num_units:
        raise PartcError(f"--pp {pins.pp} asks for more pipeline stages than the model has units ({num_units})")
    if pins.pp is not None and max_stages is not None and pins.pp > max_stages:
        raise PartcError(f"--pp {pins.pp} asks for more pipeline stages than the model allows: its {num_units} units "
                         f"split into at most {max_stages} stages, since the embeddings share the first stage and "
                         f"the final layers the last")
    chunks = (pins.pp or 1) * (pins.virtual_stages or 1)
    if pins.virtual_stages is not None and max_stages is not None and chunks > max_stages:
        raise PartcError(f"--virtual-stages {pins.virtual_stages} asks for {chunks} model chunks over "
                         f"{pins.pp or 1} pipeline rank(s), more than the model allows: its {num_units} units split "
                         f"into at most {max_stages} chunks, since the embeddings share the first and the final "
                         f"layers the last")


@functools.cache
def _inner_axes(axis: str):
    """The degrees of the mesh axes inside `axis` (after it in `MESH_AXES`), read at once as a tuple."""
    inner = MESH_AXES[MESH_BY_NAME[axis].position + 1:]
    return (lambda par: ()) if not inner else (lambda par: (getattr(par, inner[0]),)) if len(inner) == 1 \
        else operator.attrgetter(*inner)
